"""The operator's and core's layout (issue 21): no module grows past 400 lines, and
operator/README.md's layout table names every operator module and none that is gone."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "core" / "pdfabric_core"
OPERATOR = REPO / "operator" / "pdfabric_operator"
MAX_LINES = 400


def modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_core_or_operator_module_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for root in (CORE, OPERATOR)
        for p in modules(root)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by responsibility: {long}"


def test_the_operator_readme_lists_every_module() -> None:
    doc = (REPO / "operator" / "README.md").read_text()
    table = doc[doc.index("## Layout") :]
    table = table[: table.index("\n## ", 4)]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| `")]
    listed = {m for row in rows for m in re.findall(r"`([a-z_]+\.py)`", row[1])}
    # A package row names its modules in the role column: `builders/` | `agent_pod.py` (...), ...
    for row in rows:
        package = re.fullmatch(r" `([a-z_]+)/` ", row[1])
        if package:
            listed |= {f"{package.group(1)}/{m}" for m in re.findall(r"`([a-z_]+\.py)`", row[2])}
    present = {str(p.relative_to(OPERATOR)) for p in modules(OPERATOR) if p.name != "__init__.py"}
    assert present - listed == set(), f"operator/README.md's layout does not list {sorted(present - listed)}"
    assert listed - present == set(), (
        f"operator/README.md's layout lists modules that do not exist: {sorted(listed - present)}"
    )
