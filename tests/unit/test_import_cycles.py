"""No import circle in the agent or the engine integrations (issue 42), type-only ones included.

test_agent_layout.py's cycle test counts what runs; this one counts every import the code names:
an import under ``if TYPE_CHECKING:`` is still a lower module knowing its caller, and mypy,
readers and the next refactor all follow it. Imports inside functions count too (they only defer
the circle). Each package set is its own graph: the agent, the SGLang plugin, the vLLM connector;
an edge is kept only inside one set (the plugins import the agent's client, never the reverse).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.import_graph import strongly_connected

REPO = Path(__file__).resolve().parents[2]
# (the folder on sys.path, its top-level package): one graph each.
PACKAGE_SETS = (
    (REPO / "agent", "pdfabric_agent"),
    (REPO / "integrations" / "sglang", "pdfabric_sglang"),
    (REPO / "integrations" / "vllm", "pdfabric_vllm"),
)


@dataclass(frozen=True)
class Source:
    path: Path
    is_package: bool  # an __init__.py: its relative imports start from itself


@dataclass(frozen=True)
class Edge:
    target: str
    line: int
    type_only: bool


def sources(root: Path, package: str) -> dict[str, Source]:
    found: dict[str, Source] = {}
    for path in sorted((root / package).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = Source(path, is_package)
    return found


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes in the body of an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): only
    to say so in the message, since those imports count as much as any."""
    return {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and is_type_checking(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }


def absolute_base(module: str, source: Source, node: ast.ImportFrom) -> str | None:
    """The module a ``from X import ...`` names, relative levels resolved against `module`."""
    if node.level == 0:
        return node.module
    package = module.split(".") if source.is_package else module.split(".")[:-1]
    if node.level - 1 > len(package):
        return None  # beyond the top-level package: not ours
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, source: Source, known: dict[str, Source]) -> Iterator[Edge]:
    """Every import of a module in `known` that `module` names, wherever it stands in the file."""
    tree = ast.parse(source.path.read_text(), filename=str(source.path))
    typing_only = type_checking_nodes(tree)
    for node in ast.walk(tree):
        type_only = id(node) in typing_only
        if isinstance(node, ast.Import):
            for alias in node.names:
                # `import a.b.c` names a.b.c; its parents' __init__s are not the circle's cause.
                target = longest_known_prefix(alias.name, known)
                if target:
                    yield Edge(target, node.lineno, type_only)
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(module, source, node)
            if base is None:
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                # `from pkg import name` imports pkg.name when that is a module, else a name of pkg.
                target = submodule if submodule in known else longest_known_prefix(base, known)
                if target:
                    yield Edge(target, node.lineno, type_only)


def longest_known_prefix(name: str, known: dict[str, Source]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def import_graph(root: Path, package: str) -> tuple[dict[str, Source], dict[str, dict[str, Edge]]]:
    """module -> {imported module -> its first import (a run-time one if any)}."""
    known = sources(root, package)
    graph: dict[str, dict[str, Edge]] = {}
    for module, source in known.items():
        edges: dict[str, Edge] = {}
        for edge in imports_of(module, source, known):
            first = edges.get(edge.target)
            if first is None or (first.type_only and not edge.type_only):
                edges[edge.target] = edge
        graph[module] = edges
    return known, graph


def circle_through(first: str, members: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path first -> ... -> first inside one component (breadth-first)."""
    came_from: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following: list[str] = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == first:
                    path = [v]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return [first, *reversed(path[:-1]), first]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    return [first]


def describe(
    component: list[str],
    known: dict[str, Source],
    graph: dict[str, dict[str, Edge]],
    targets: dict[str, set[str]],
    shown_from: Path,
) -> str:
    members = set(component)
    circle = " -> ".join(circle_through(component[0], members, targets))
    lines = [f"{len(component)} modules ({', '.join(component)}), e.g. {circle}; their imports of each other:"]
    for module in component:
        for target, edge in sorted(graph[module].items(), key=lambda item: item[1].line):
            if target in members:
                where = known[module].path.relative_to(shown_from)
                kind = " (under TYPE_CHECKING)" if edge.type_only else ""
                lines.append(f"    {where}:{edge.line} imports {target}{kind}")
    return "\n".join(lines)


def circles(root: Path, package: str, shown_from: Path = REPO) -> list[str]:
    """Each self-import and each circle, as text naming the files and lines to change."""
    known, graph = import_graph(root, package)
    targets = {module: set(edges) for module, edges in graph.items()}
    found = [
        f"{module} imports itself ({known[module].path.relative_to(shown_from)}:{edges[module].line})"
        for module, edges in graph.items()
        if module in edges
    ]
    without_self = {module: edges - {module} for module, edges in targets.items()}
    found += [
        describe(component, known, graph, without_self, shown_from)
        for component in strongly_connected(without_self)
        if len(component) > 1
    ]
    return found


@pytest.mark.parametrize(("root", "package"), PACKAGE_SETS, ids=[package for _, package in PACKAGE_SETS])
def test_no_import_circle(root: Path, package: str) -> None:
    assert sources(root, package), f"no modules found under {root / package}"
    found = circles(root, package)
    assert found == [], (
        f"{len(found)} import circle(s) in {package}; a lower module must not import its callers, "
        "not even for type hints (move the shared type down, or state what it uses as a Protocol):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"], ["d"]]),
        ({"a": {"b"}, "b": set()}, [["b"], ["a"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
    ids=["circle", "none", "two"],
)
def test_the_component_finder(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert strongly_connected(graph) == expected


def test_the_checker_sees_type_only_relative_and_deferred_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import high\n"
    )
    (package / "sub" / "high.py").write_text("def f() -> None:\n    from .. import low\n")
    (package / "alone.py").write_text("from pkg import alone\n")
    found = circles(tmp_path, "pkg", shown_from=tmp_path)
    assert found[0].startswith("pkg.alone imports itself")
    assert found[1].splitlines()[0].endswith("e.g. pkg.low -> pkg.sub.high -> pkg.low; their imports of each other:")
    assert "(under TYPE_CHECKING)" in found[1]
    assert len(found) == 2
