"""The package has no import cycles, including imports hidden inside functions or under `if TYPE_CHECKING:` (a
cycle there still means two modules that cannot be understood one without the other; hiding it from the
interpreter does not take it out of the design). Importing `plexd.a.b` runs `plexd/a/__init__.py` too, so that
counts as an edge."""

from __future__ import annotations

import ast
from pathlib import Path

import plexd

ROOT = Path(plexd.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = name if is_package else name.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)  # `from pkg import module`
            visit(child)

    visit(tree)
    edges: set[str] = set()
    for target in found:
        if target not in known:
            continue
        parts = target.split(".")
        # the module and every package above it, except the root package and the importer's own packages
        for i in range(2, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and not name.startswith(prefix + ".") and prefix != name:
                edges.add(prefix)
    return edges


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, name, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_checker_finds_a_cycle():
    """Control: the walk sees imports inside functions, under TYPE_CHECKING and through packages."""
    graph = import_graph()
    assert "plexd.controlplane.client" in graph["plexd.actions.outbox"]  # under TYPE_CHECKING
    assert "plexd.node.agent" in graph["plexd.node.assembly"]  # a top-level import
    assert "plexd.node" in graph["plexd.cli"]  # importing plexd.node.control runs plexd/node/__init__.py
    assert "plexd.node.control" in graph["plexd.cli"]  # an import inside a function
    graph["plexd.node.agent"].add("plexd.node.assembly")
    assert any({"plexd.node.agent", "plexd.node.assembly"} <= set(c) for c in cycles(graph))


def test_the_node_daemon_does_not_import_the_devplane_stack():
    """starlette, sse-starlette and uvicorn are the `devplane` extra: nothing outside plexd.devplane uses them."""
    offenders = []
    for name, path in modules().items():
        if name.startswith("plexd.devplane"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [(name, t) for t in targets if t.split(".")[0] in ("starlette", "sse_starlette", "uvicorn")]
    assert offenders == []
