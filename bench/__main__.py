"""The benchmarks, run from a checkout: ``python -m bench NAME [options]`` (``NAME --help`` for each).

They are not in the wheel: they start llama-servers, Valkey and sidecars through ``launch`` and
write their results under ``bench/results``. ``make bench`` runs ``report``, which renders
docs/benchmarks.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

from bench import (
    capacity,
    chatsteps,
    datapath,
    hop,
    llama_cpp_python,
    neverworse,
    overhead,
    relays,
    report,
    state,
    tiers,
)

BENCHMARKS: dict[str, Callable[[list[str]], int | None]] = {
    "tiers": tiers.main,
    "state": state.main,
    "hop": hop.main,
    "overhead": overhead.main,
    "llama-cpp-python": llama_cpp_python.main,
    "report": report.main,
    "capacity": capacity.main,
    "neverworse": neverworse.main,
    "datapath": datapath.main,
    "chatsteps": chatsteps.main,
    "relays": relays.main,
}
USAGE = f"usage: python -m bench NAME [options]\n\nNAME: {', '.join(BENCHMARKS)}"


def main(argv: Sequence[str]) -> int:
    """Run one benchmark and print its wall time to stderr."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    name, rest = argv[0], list(argv[1:])
    if name not in BENCHMARKS:
        print(f"python -m bench: unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rc = int(BENCHMARKS[name](rest) or 0)
    print(f"(bench {name}: {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
