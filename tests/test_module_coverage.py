"""tests/ mirrors the package: a test module sits in the folder named after the package folder
it tests (`tests/decode/` for `dspark_jax/decode/`, the root's modules at `tests/`) and imports
something from it; every package module with logic of its own (a function or a method) is
imported by some test module; and no package module grows past MAX_LINES (a larger one is split)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dspark_jax"
TESTS = ROOT / "tests"
MAX_LINES = 460


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """The dspark_jax modules `path` imports (`from a.b import c` counts a.b and a.b.c)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dspark_jax"):
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("dspark_jax")}
    return out


def modules_with_logic() -> list[Path]:
    return [p for p in sorted(PKG.rglob("*.py"))
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(ast.parse(p.read_text())))]


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_every_module_with_logic_is_imported_by_a_test():
    imported = set().union(*(imported_modules(t) for t in _test_files()))
    modules = modules_with_logic()
    assert PKG / "decode" / "engine.py" in modules and PKG / "train" / "init_draft.py" in modules
    untested = [str(p.relative_to(ROOT)) for p in modules if module_name(p) not in imported]
    assert not untested, f"package modules no test module imports: {untested}"


def test_test_folders_mirror_the_package():
    for t in _test_files():
        rel = t.relative_to(TESTS)
        if len(rel.parts) == 1:
            continue
        folder = rel.parts[0]
        assert len(rel.parts) == 2 and (PKG / folder).is_dir(), f"{rel}: tests/ folders are the package's folders"
        assert any(m.startswith(f"dspark_jax.{folder}.") for m in imported_modules(t)), \
            f"{rel} imports nothing from dspark_jax/{folder}/"


def test_no_module_is_over_the_line_limit():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"
