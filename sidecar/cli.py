"""The ``kvtier`` command: serve, demo, state inspect, sessions, cache, stats."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from tiers.errors import ConfigError, KVTierError

USAGE = """usage: kvtier <command> [options]

commands:
  serve              run the sidecar in front of llama-server (kvtier serve --help)
  demo               rolling-update demo: two llama-servers, two sidecars, Valkey
  state inspect F    describe a llama.cpp sequence-state file (--json)
  sessions ACTION    ls | show ID | rm ID | save ID | restore ID  (a running sidecar's sessions API)
  cache ACTION       ls | rm --all|--namespace ID|--salt S|--session ID|--tokens JSON  (Redis, or a sidecar)
  stats              hit rates per tier and tokens restored vs recomputed (from /metrics)
"""


def cmd_serve(argv: Sequence[str]) -> int:
    from tiers.pace import set_background_pace
    from tiers.threads import set_background_nice

    from .app import effective_config, run
    from .config import load_settings
    from .heap import reuse_freed_memory
    from .logs import setup_logging

    try:
        settings = load_settings(argv)
        _check_slot_dir(settings.slot_dir or "")
    except ConfigError as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_format)
    logging.getLogger("kvtier").info("effective config: %s", effective_config(settings))
    reuse_freed_memory()
    set_background_nice(settings.save_nice)  # process-wide, as the malloc setting: before any save
    set_background_pace(settings.save_cpu_share)
    run(settings)
    return 0


def _check_slot_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise ConfigError(f"slot_dir {path!r} does not exist or is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"slot_dir {path!r} is not writable")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    try:
        if command == "serve":
            return cmd_serve(rest)
        if command == "state" and rest[:1] == ["inspect"]:
            from integrations.fingerprint import inspect_main

            return inspect_main(rest[1:])
        if command == "demo":
            from .demo import main as demo_main

            return demo_main(rest)
        if command == "sessions":
            from .cli_client import sessions_main

            return sessions_main(rest)
        if command == "cache":
            from .cli_cache import cache_main

            return cache_main(rest)
        if command == "stats":
            from .cli_client import stats_main

            return stats_main(rest)
    except KVTierError as exc:
        print(f"kvtier {command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
