"""docs/architecture.md names every module of the product's packages (a newcomer finds each part)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "architecture.md").read_text()
MODULES = sorted(p for pkg in ("sidecar", "integrations", "tiers") for p in (ROOT / pkg).rglob("*.py")
                 if p.name != "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_module_is_named_in_the_architecture_doc(path: Path) -> None:
    assert f"`{path.name}`" in DOC or f"{path.parent.name}/{path.name}" in DOC, path
