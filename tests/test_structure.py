"""The size bar of the product's packages (docs/architecture.md, "Rooms"): no module over 500 lines,
no class over 250, no function over 60, in ``sidecar``, ``integrations`` and ``tiers``.

A room past the bar is one to split (STYLE.md: a class past ~250 lines has more than one job). The
check reads the source with ``ast``, so a docstring counts as the code it explains does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sidecar", "integrations", "tiers")
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 250, 60  # lines


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def oversized(path: Path, root: Path = ROOT) -> list[str]:
    """What in ``path`` is over the bar, as ``module:name lines`` strings."""
    text = path.read_text()
    rel = path.relative_to(root).as_posix()
    found = []
    if (n := len(text.splitlines())) > MAX_MODULE:
        found.append(f"{rel} {n} lines (module, max {MAX_MODULE})")
    for node in ast.walk(ast.parse(text)):
        limit = (MAX_CLASS if isinstance(node, ast.ClassDef)
                 else MAX_FUNCTION if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None)
        if limit is not None and node.end_lineno is not None:
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                found.append(f"{rel}:{node.name} {n} lines (max {limit})")
    return found


def test_the_checker_sees_what_is_too_big(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    (tmp_path / "big.py").write_text(f"def f():\n{body}\n    return 0\n\ndef g():\n    return 1\n")
    assert oversized(tmp_path / "big.py", tmp_path) == [f"big.py:f {MAX_FUNCTION + 2} lines (max {MAX_FUNCTION})"]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_room_over_the_bar(path: Path) -> None:
    assert oversized(path) == []
