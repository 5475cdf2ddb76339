"""docs/architecture.md names every module of the product (a new module that it does not
list is an architecture nobody can read about)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_ROOTS = ("core", "owner", "proxy", "analyst", "app")


def test_every_module_is_named_in_the_architecture_document() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    modules = [
        path
        for root in PACKAGE_ROOTS
        for path in sorted((ROOT / root).rglob("*.py"))
        if "v1" not in path.parts and path.name not in ("__init__.py", "__main__.py")
    ]
    assert len(modules) > 50  # the walk found the product, not an empty folder
    missing = [
        str(path.relative_to(ROOT))
        for path in modules
        if not re.search(rf"(?<![\w.]){re.escape(path.name)}(?!\w)", text)
    ]
    assert missing == [], f"modules not named in docs/architecture.md: {missing}"
