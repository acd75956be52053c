"""``kvtier cache ls|rm``: list and purge the automatic cache, in Redis directly (``--redis``) or
through a running sidecar's admin API (``--url``; it clears that node's RAM, shared directory and
slots too). Either way every sidecar following the model's events drops the same from its tiers."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiers import purge
from tiers.errors import ConfigError, KVTierError
from tiers.events import EventBus
from tiers.keys import events_channel
from tiers.redis_conn import RedisConnection
from tiers.sessions import validate_session_id

from .cli_client import DEFAULT_URL, _request


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier cache", description="list and purge cached KV")
    sub = p.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("ls", help="namespaces: chunks, tails, sessions, bytes")
    ls.add_argument("--namespace", default=None, help="only this namespace id")
    ls.add_argument("--json", action="store_true")
    rm = sub.add_parser("rm", help="delete cached KV (one scope)")
    what = rm.add_mutually_exclusive_group()  # or none: --salt alone purges a tenant
    what.add_argument("--all", action="store_true", help="every namespace")
    what.add_argument("--namespace", help="one namespace id (kvtier cache ls)")
    what.add_argument("--session", help="one session: its manifest, tail and prefix chunks")
    what.add_argument("--tokens", help="one conversation's token ids: a JSON list, or @FILE holding one")
    what.add_argument("--prompt", help="one conversation's prompt text (--url only: the sidecar tokenizes it)")
    what.add_argument("--messages", help="one chat as a JSON list of messages, or @FILE (--url only)")
    rm.add_argument("--salt", default=None,
                    help="the tenant: alone, its namespace under every model; with a conversation, whose it is")
    for sp in (ls, rm):
        sp.add_argument("--redis", default=os.environ.get("KVTIER_REDIS_URL"),
                        help="Redis/Valkey URL (or KVTIER_REDIS_URL): work on Redis directly")
        sp.add_argument("--redis-username", default=os.environ.get("KVTIER_REDIS_USERNAME"))
        sp.add_argument("--redis-password-file", default=None, help="file holding the Redis password "
                                                                    "(or KVTIER_REDIS_PASSWORD)")
        sp.add_argument("--url", default=os.environ.get("KVTIER_URL", DEFAULT_URL),
                        help="a sidecar's base URL, used without --redis")
        sp.add_argument("--token", default=os.environ.get("KVTIER_AUTH_TOKEN"),
                        help="the sidecar's bearer token (or KVTIER_AUTH_TOKEN)")
    return p


def cache_main(argv: Sequence[str]) -> int:
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:  # argparse printed why (or the help)
        return exc.code if isinstance(exc.code, int) else 2
    if args.action == "rm" and args.salt is None and not any(
            (args.all, args.namespace, args.session, args.tokens, args.prompt, args.messages)):
        print("kvtier cache rm: give --all, --namespace, --salt, --session, --tokens, --prompt or --messages",
              file=sys.stderr)
        return 2
    if args.action == "rm" and args.salt is not None and (args.all or args.namespace):
        print("kvtier cache rm: --salt does not go with --all or --namespace (a tenant is --salt alone)",
              file=sys.stderr)
        return 2
    try:
        if args.redis:
            return asyncio.run(_direct(args))
        return _through_sidecar(args)
    except (ValueError, ConfigError, OSError) as exc:
        print(f"kvtier cache: {exc}", file=sys.stderr)
        return 2


def _json_arg(value: str) -> Any:
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    try:
        return json.loads(text)
    except ValueError:
        raise ValueError("not valid JSON") from None


def _tokens(value: str) -> list[int]:
    tokens = _json_arg(value)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in tokens):
        raise ValueError("--tokens must be a non-empty JSON list of token ids")
    return tokens


# -- through a sidecar ----------------------------------------------------------------------------

def _through_sidecar(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/") + "/v1/cache"
    if args.action == "ls":
        query = f"?namespace={args.namespace}" if args.namespace else ""
        status, out = _request("GET", base + query, args.token)
        if status == 200 and not args.json:
            _print_usage([u for u in out["namespaces"]], out["this_node"].get("namespace"))
            return 0
    else:
        body: dict[str, Any] = {"salt": args.salt} if args.salt is not None else {}
        if args.all:
            body = {"all": True}
        elif args.namespace:
            body = {"namespace": args.namespace}
        elif args.session:
            body["session"] = args.session
        elif args.tokens:
            body["tokens"] = _tokens(args.tokens)
        elif args.prompt:
            body["prompt"] = args.prompt
        elif args.messages:
            body["messages"] = _json_arg(args.messages)
        status, out = _request("POST", base + "/purge", args.token, body)
    print(json.dumps(out, indent=2) if not isinstance(out, str) else out)
    return 0 if status == 200 else 1


def _print_usage(rows: list[dict[str, Any]], this_node: str | None = None) -> None:
    print(f"{'namespace':16}  {'chunks':>8} {'tails':>8} {'sessions':>8} {'MB':>10}  model")
    for u in rows:
        model = u.get("model")
        label = f"{model[:48]} (chunk {u['chunk_tokens']})" if model else "(a tenant's, or not recorded)"
        mark = "  <- this node" if u["namespace"] == this_node else ""
        print(f"{u['namespace']:16}  {u['chunks']:>8} {u['tails']:>8} {u['sessions']:>8} {u['bytes'] / 1e6:>10.1f}  "
              f"{label}{mark}")


# -- on Redis directly ----------------------------------------------------------------------------

def _connection(args: argparse.Namespace) -> RedisConnection:
    password = os.environ.get("KVTIER_REDIS_PASSWORD")
    if args.redis_password_file:
        password = Path(args.redis_password_file).read_text().strip()
    return RedisConnection(args.redis, username=args.redis_username, password=password)


async def _direct(args: argparse.Namespace) -> int:
    if args.action == "rm" and (args.prompt or args.messages):
        raise ValueError("--prompt and --messages need a sidecar to tokenize them: use --url, or --tokens")
    conn = _connection(args)
    try:
        if args.action == "ls":
            listed = await purge.usage(conn, args.namespace)
            rows = [u.public() for u in listed]
            if args.json:
                print(json.dumps({"shared": True, "namespaces": rows}, indent=2))
            else:
                _print_usage(rows)
            return 0
        return await _remove(conn, args)
    except KVTierError as exc:
        print(f"kvtier cache: {exc}", file=sys.stderr)
        return 1
    finally:
        await conn.aclose()


async def _remove(conn: RedisConnection, args: argparse.Namespace) -> int:
    events = EventBus(conn, node_id=f"kvtier-cli:{socket.gethostname()}:{os.getpid()}")
    known = await purge.models(conn)
    salt = args.salt or ""
    if args.all or args.namespace:
        ns = purge.ALL if args.all else purge.validate_namespace_id(args.namespace)
        deleted = await purge.purge_namespace(conn, ns)
        for model in known:
            await events.publish_cache_purged(events_channel(model.salted()), ns)
        return _report("all" if args.all else "namespace", [ns], deleted, known)
    if not known:
        print("kvtier cache: Redis records no model (sidecars record theirs when they start); purge by "
              "--namespace, or through a sidecar with --url", file=sys.stderr)
        return 1
    if not args.session and not args.tokens:
        if not salt:
            raise ValueError("--salt must name a tenant (the unsalted namespace is a model's: --namespace ID)")
        ids = sorted({m.salted(salt).id for m in known})
        deleted = 0
        for ns in ids:
            deleted += await purge.purge_namespace(conn, ns)
        for model in known:
            for ns in ids:
                await events.publish_cache_purged(events_channel(model.salted()), ns)
        return _report("tenant", ids, deleted, known)
    return await _remove_conversation(conn, events, known, args, salt)


async def _remove_conversation(conn: RedisConnection, events: EventBus, known: list[purge.ModelRecord],
                               args: argparse.Namespace, salt: str) -> int:
    tokens = _tokens(args.tokens) if args.tokens else None
    if args.session:
        validate_session_id(args.session)
    deleted = 0
    touched: list[str] = []
    for model in known:
        ns = model.salted(salt)
        if tokens is not None:
            keys = purge.conversation_keys(ns, tokens)
        else:
            found = await purge.session_purge_keys(conn, ns, args.session)
            if found is None:
                continue
            keys = found
        n = await purge.purge_keys(conn, keys)
        if n or args.session:
            touched.append(ns.id)
        deleted += n
        await events.publish_cache_purged(events_channel(model.salted()), ns.id, keys)
    if args.session and not touched:
        print(f"kvtier cache: no session {args.session!r}" + (" for that salt" if salt else ""), file=sys.stderr)
        return 1
    return _report("conversation", touched, deleted, known)


def _report(scope: str, namespaces: list[str], deleted: int, known: list[purge.ModelRecord]) -> int:
    print(json.dumps({"scope": scope, "namespaces": namespaces, "redis_keys_deleted": deleted,
                      "models_told": [m.namespace for m in known]}, indent=2))
    return 0
