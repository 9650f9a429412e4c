"""Layering facts of the source tree, read from the code: the IR imports nothing else of remat,
and there is exactly one ``BudgetTooSmall``."""
from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "remat"


def _modules():
    for path in SRC.rglob("*.py"):
        yield path, ast.parse(path.read_text(), str(path))


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


def test_exactly_one_budget_too_small():
    found = [f"{path.relative_to(SRC)}:{node.lineno}" for path, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef) and node.name == "BudgetTooSmall"]
    assert found == ["errors.py:5"], found
