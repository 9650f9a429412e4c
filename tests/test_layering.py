"""Layering facts of the source tree, read from the code: the IR imports nothing else of remat,
and there is exactly one ``BudgetTooSmall``, one simulator of record and one memory accounting."""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "remat"


@functools.cache
def _modules() -> tuple:
    """Every source file and its syntax tree, parsed once per process (the tests only read them)."""
    return tuple((path, ast.parse(path.read_text(), str(path))) for path in sorted(SRC.rglob("*.py")))


def test_ir_imports_nothing_else_of_remat():
    for path, tree in _modules():
        if SRC / "ir" not in path.parents:
            continue
        depth = len(path.relative_to(SRC / "ir").parts)  # 1: ir/x.py, 2: ir/ops/x.py
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                outside = (node.level > depth) or (node.level == 0 and (node.module or "").startswith("remat")
                                                   and not (node.module or "").startswith("remat.ir"))
                assert not outside, f"{path.relative_to(SRC)}:{node.lineno} imports {'.' * node.level}{node.module}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    assert not (a.name.startswith("remat") and not a.name.startswith("remat.ir")), \
                        f"{path.relative_to(SRC)}:{node.lineno} imports {a.name}"


def test_exactly_one_budget_too_small():
    found = [f"{path.relative_to(SRC)}:{node.lineno}" for path, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef) and node.name == "BudgetTooSmall"]
    assert found == ["errors.py:5"], found


def test_exactly_one_simulator():
    """One memory simulator of record (``plan.simulator.simulate``, behind ``predict_peak``)."""
    found = [f"{path.relative_to(SRC)}" for path, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.FunctionDef) and node.name in ("simulate", "predict_peak")]
    assert sorted(found) == ["plan/simulator.py", "plan/simulator.py"], found


def test_one_memory_accounting():
    """The simulator and the VM count bytes with the same classes (``remat.accounting``), so the
    predicted and measured counts cannot drift: no other class releases reference-counted storages,
    and the accounting imports nothing else of remat."""
    found = [f"{path.relative_to(SRC)}:{node.name}" for path, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef)
             and any(isinstance(m, ast.FunctionDef) and m.name == "release" for m in node.body)]
    assert sorted(found) == ["accounting.py:KindCounter", "accounting.py:StorageCounter"], found
    tree = ast.parse((SRC / "accounting.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.level or "remat" in (n.module or ""))]


def _package_imports(module_level_only: bool) -> dict[str, set[str]]:
    """Top-level package (or module) of remat -> the ones it imports."""
    edges: dict[str, set[str]] = {}
    for path, tree in _modules():
        parts = path.relative_to(SRC).parts
        src = parts[0].removesuffix(".py")
        here = list(parts[:-1])
        nodes = tree.body if module_level_only else ast.walk(tree)
        for node in nodes:
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                targets = base[:1] or [a.name for a in node.names]
            elif (node.module or "").startswith("remat."):
                targets = [node.module.split(".")[1]]
            else:
                continue
            edges.setdefault(src, set()).update(t for t in targets if t != src)
    return edges


@pytest.mark.parametrize("module_level_only", [True, False], ids=["at-import-time", "inside-functions-too"])
def test_no_import_cycle_between_packages(module_level_only: bool):
    """Not even through an import deferred into a function body: the packages form layers."""
    edges = _package_imports(module_level_only)
    state: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(edges.get(n, ())):
            assert state.get(m) != 1, f"import cycle: {' -> '.join(stack + [n, m])}"
            if m not in state:
                visit(m, stack + [n])
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n, [])


def test_the_pass_registry_sits_above_passes_autodiff_and_plan():
    edges = _package_imports(module_level_only=False)
    assert {"passes", "autodiff", "plan"} <= edges["pipeline"]
    for pkg in ("ir", "passes", "autodiff", "plan"):
        assert "pipeline" not in edges.get(pkg, set()), f"{pkg}/ imports the pass registry above it"
    for path, tree in _modules():
        if path.name == "pipeline.py":
            caught = [n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler)]
            assert not caught, f"{path.relative_to(SRC)} catches an exception (import errors must surface)"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out.update(id(n) for n in ast.walk(node))
    return out


def _file_imports() -> dict[str, set[str]]:
    """Module (file) of remat -> the modules of remat it imports, at import time or inside functions
    (``from .x import y`` counts ``x.y`` when that is a module, else ``x``); ``TYPE_CHECKING``
    imports excluded."""
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in paths}
    trees = dict(_modules())
    for name, path in paths.items():
        tree = trees[path]
        skip = _type_checking_nodes(tree)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                mod = ".".join(base + (node.module.split(".") if node.module else []))
                if mod.split(".")[0] != "remat":
                    continue
                for a in node.names:
                    target = f"{mod}.{a.name}" if f"{mod}.{a.name}" in paths else mod
                    if target in paths:
                        edges[name].add(target)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in paths)
        edges[name].discard(name)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_files_outside_the_ir():
    """Files form layers too, also through imports deferred into function bodies (annotations'
    ``TYPE_CHECKING`` imports aside); only the IR's core and printer may need each other."""
    cycles = [c for c in _cycles(_file_imports()) if not all(m.startswith("remat.ir") for m in c)]
    assert not cycles, "import cycles between files: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_file_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
