"""What ``kvtier serve`` loads: the service, never the launcher, the benchmarks or the tests.

``launch`` is in the wheel for ``kvtier demo`` alone; ``bench`` and ``tests`` run from a checkout.
The check runs in a fresh interpreter from the repository root, where all three are importable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The serve path up to its first check: cmd_serve imports the app and the settings, then stops at
# the slot dir (exit 2) before it would start anything.
SERVE = """
import json, sys
import sidecar.app
from sidecar.cli import main
rc = main(["serve", "--slot-dir", "/nonexistent/kvtier-slots"])
print(json.dumps({"rc": rc, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def test_serve_imports_neither_the_launcher_nor_the_benchmarks_nor_the_tests() -> None:
    run = subprocess.run([sys.executable, "-c", SERVE], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["rc"] == 2 and "does not exist" in run.stderr
    assert {"sidecar", "tiers", "aiohttp"} <= set(out["modules"])
    assert not {"launch", "bench", "tests"} & set(out["modules"])
