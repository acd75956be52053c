"""``kvtier sessions ...`` and ``kvtier stats``: a running sidecar's API from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

DEFAULT_URL = "http://127.0.0.1:8081"


def _request(method: str, url: str, token: str | None, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except (urllib.error.URLError, OSError) as exc:
        raise SystemExit(f"kvtier: cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("KVTIER_URL", DEFAULT_URL), help="sidecar base URL")
    p.add_argument("--token", default=os.environ.get("KVTIER_AUTH_TOKEN"), help="bearer token (or KVTIER_AUTH_TOKEN)")
    p.add_argument("--salt", default=None, help="tenant salt (X-KVTier-Salt)")


def sessions_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtier sessions")
    sub = p.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("ls", help="list sessions")
    ls.add_argument("--prefix", default="")
    ls.add_argument("--limit", type=int, default=100)
    for name in ("show", "rm", "save", "restore"):
        sp = sub.add_parser(name)
        sp.add_argument("id")
        if name in ("save", "restore"):
            sp.add_argument("--slot", type=int, default=None)
    for sp in sub.choices.values():
        _common(sp)
    args = p.parse_args(list(argv))
    base = args.url.rstrip("/") + "/v1/sessions"
    body = {"slot": args.slot} if getattr(args, "slot", None) is not None else {}
    if args.action == "ls":
        from urllib.parse import urlencode

        status, out = _request("GET", f"{base}?{urlencode({'prefix': args.prefix, 'limit': args.limit})}", args.token)
        if status == 200:
            for s in out["sessions"]:
                print(f"{s['id']:40} {s['n_tokens']:>8} tokens {s['bytes'] / 1e6:>9.1f} MB  node {s['node']}")
            if not out["shared"]:
                print("(no Redis: sessions are local to this node)")
            return 0
    elif args.action == "show":
        status, out = _request("GET", f"{base}/{args.id}", args.token)
    elif args.action == "rm":
        status, out = _request("DELETE", f"{base}/{args.id}", args.token)
    elif args.action == "save":
        status, out = _request("PUT", f"{base}/{args.id}", args.token, body)
    else:
        status, out = _request("POST", f"{base}/{args.id}/restore", args.token, body)
    print(json.dumps(out, indent=2) if not isinstance(out, str) else out)
    return 0 if status == 200 else 1


def stats_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtier stats", description="hit rates and tokens from a sidecar's /metrics")
    _common(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(list(argv))
    status, text = _request("GET", args.url.rstrip("/") + "/metrics", args.token)
    if status != 200 or not isinstance(text, str):
        print(f"kvtier stats: /metrics answered {status}", file=sys.stderr)
        return 1
    summary = summarize_metrics(text)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{'tier':10} {'hits':>8} {'misses':>8} {'hit rate':>9} {'MB read':>9} {'MB written':>11} {'evictions':>10}")
    for tier, t in summary["tiers"].items():
        print(f"{tier:10} {t['hits']:>8.0f} {t['misses']:>8.0f} {t['hit_rate']:>9.1%} {t['bytes_read'] / 1e6:>9.1f} "
              f"{t['bytes_written'] / 1e6:>11.1f} {t['evictions']:>10.0f}")
    tok = summary["tokens"]
    print(f"tokens restored {tok['restored']:.0f}, reused in slot {tok['slot_reused']:.0f}, "
          f"recomputed {tok['recomputed']:.0f} (restored share {tok['restored_share']:.1%})")
    route = summary["routing"]
    print(f"requests forwarded {route['forwarded']:.0f}, served here {route['served_here']:.0f}, here after a "
          f"failed forward {route['fallback']:.0f}, restored {route['restored']:.0f}, received from peers "
          f"{route['received']:.0f}; {route['bytes_not_moved'] / 1e6:.1f} MB not moved")
    return 0


def summarize_metrics(text: str) -> dict[str, Any]:
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def get(name: str, **labels: str) -> float:
        return values.get((name, tuple(sorted(labels.items()))), 0.0)

    tiers: dict[str, dict[str, float]] = {}
    for name, labels in values:
        if name == "kvtier_tier_hits_total":
            tier = dict(labels)["tier"]
            hits, misses = get("kvtier_tier_hits_total", tier=tier), get("kvtier_tier_misses_total", tier=tier)
            tiers[tier] = {"hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                           "bytes_read": get("kvtier_tier_bytes_read_total", tier=tier),
                           "bytes_written": get("kvtier_tier_bytes_written_total", tier=tier),
                           "evictions": get("kvtier_tier_evictions_total", tier=tier)}
    restored = get("kvtier_tokens_restored_total")
    recomputed = get("kvtier_tokens_recomputed_total")
    reused = get("kvtier_tokens_slot_reused_total")
    total = restored + recomputed + reused
    decisions = {d: get("kvtier_route_decisions_total", decision=d) for d in ("forwarded", "served_here", "fallback")}
    routing = {**decisions, "restored": get("kvtier_cost_decisions_total", decision="restore"),
               "received": get("kvtier_route_forwarded_in_total"),
               "bytes_not_moved": get("kvtier_route_bytes_not_moved_total")}
    return {"tiers": tiers, "tokens": {"restored": restored, "recomputed": recomputed, "slot_reused": reused,
                                       "restored_share": restored / total if total else 0.0},
            "routing": routing}
