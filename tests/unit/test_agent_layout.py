"""The agent's layout shows its architecture (issue 21): every module sits in a package by concern,
every package is in the written layering, no module grows past 400 lines, docs/agent.md's code map
names every module, and no import cycle exists anywhere in the repository's Python code."""

from __future__ import annotations

import ast
import configparser
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.import_graph import strongly_connected

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "agent" / "pdfabric_agent"
MAX_LINES = 400
# Where each top-level import name lives: the repository's packages and hack/'s modules.
SOURCE_ROOTS = (REPO / "core", REPO / "operator", REPO / "agent", REPO / "integrations" / "sglang", REPO / "hack")


def agent_modules() -> list[Path]:
    return sorted(p for p in AGENT.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_agent_module_sits_in_a_package_by_concern() -> None:
    loose = [p.name for p in AGENT.glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"modules directly in pdfabric_agent/: {loose}; put each in the package of its concern"
    for package in (p for p in AGENT.iterdir() if p.is_dir() and p.name != "__pycache__"):
        init = package / "__init__.py"
        assert init.is_file(), f"{package.name}/ has no __init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{package.name}/__init__.py says nothing of its concern"


def test_every_agent_package_is_in_the_written_layering() -> None:
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    layers = config["importlinter:contract:agent-layers"]["layers"]
    named = {name.strip() for line in layers.split("\n") for name in line.split("|") if name.strip()}
    packages = {p.name for p in AGENT.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert packages == named, f"packages not in the agent-layers contract: {sorted(packages - named)}"


def test_no_agent_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(AGENT)): n for p in agent_modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by responsibility: {long}"


def test_the_code_map_lists_every_agent_module() -> None:
    doc = (REPO / "docs" / "agent.md").read_text()
    code_map = doc[doc.index("## Code map") :]
    code_map = code_map[: code_map.index("\n## ", 4)]
    rows = "\n".join(line.split("|")[2] for line in code_map.splitlines() if line.startswith("| "))
    listed = set(re.findall(r"`([a-z0-9_/]+\.py)`", rows))  # the table's module column
    modules = {str(p.relative_to(AGENT)) for p in agent_modules()}
    # A package's __init__.py says its concern (test above); the map lists the modules.
    unlisted = {m for m in modules - listed if not m.endswith("__init__.py")}
    assert unlisted == set(), f"docs/agent.md's code map does not list {sorted(unlisted)}"
    assert listed - modules == set(), (
        f"docs/agent.md's code map lists modules that do not exist: {sorted(listed - modules)}"
    )


def python_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for root in SOURCE_ROOTS:
        for path in root.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def imports_of(path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The repository modules `path` imports at run time (``if TYPE_CHECKING:`` blocks aside)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    yield full
                elif node.module in modules:
                    yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in modules)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module."""
    return [c for c in strongly_connected(graph) if len(c) > 1]


def test_no_import_cycle_in_the_repository() -> None:
    modules = python_modules()
    graph = {name: set(imports_of(path, modules)) - {name} for name, path in modules.items()}
    assert cycles(graph) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]), ({"a": {"b"}, "b": set()}, [])],
    ids=["cycle", "none"],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected


def test_no_test_module_imports_another() -> None:
    """Helpers live in helper modules (tests/unit/agents.py, tests/deadlines.py, tests/e2e/...)."""
    found = []
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            # `from tests.e2e import test_x` names the module in its aliases
            names += [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(REPO)}: {n}" for n in names if re.fullmatch(r"tests(\.\w+)*\.test_\w+", n)]
    assert found == []
