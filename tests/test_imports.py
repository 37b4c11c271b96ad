"""The package's module graph has no cycles (a newcomer can read it bottom-up), and neither has its
folder graph: each folder of the package (`decode`, `models`, ...) taken as one node, the root's
modules as nodes of their own, so imports flow one way between folders.

Every `import` / `from ... import` of a `dspark_jax` module counts, also those inside functions
(a deferred import is how a cycle hides)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "dspark_jax"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                # `from pkg import mod` imports a module when `pkg.mod` is one
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for name in names:
                while name and name not in modules:      # `dspark_jax.x.y` where y is an attribute
                    name = name.rpartition(".")[0]
                if name and name != mod and not mod.startswith(name + "."):
                    graph[mod].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cyc := visit(n)):
                return cyc
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cyc := visit(m)):
            return cyc
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert "dspark_jax.decode.generate" in graph and graph["dspark_jax.api"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def folder_of(module: str) -> str:
    """`dspark_jax.decode.engine` -> `decode`; a root module stays itself (`dspark_jax.cache`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else module


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {folder_of(m): set() for m in graph}
    for m, deps in graph.items():
        out[folder_of(m)] |= {folder_of(d) for d in deps} - {folder_of(m)}
    return out


def test_the_folder_graph_collapses_folders():
    graph = {"dspark_jax.a.x": {"dspark_jax.b.y"}, "dspark_jax.b.y": {"dspark_jax.a.z"}, "dspark_jax.a.z": set(),
             "dspark_jax.leaf": set()}
    assert find_cycle(folder_graph(graph)) == ["a", "b", "a"]      # acyclic as modules, not as folders
    assert find_cycle(graph) is None


def test_no_import_cycles_between_folders():
    graph = folder_graph(import_graph())
    assert {"decode", "models", "checkpoint", "train", "data"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "folder import cycle: " + " -> ".join(cycle)
