"""docs/ir.md stays true: the op table matches the registry, and its IR examples are canonical."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from remat.ir import OPS, parse, verify

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ir.md"


def _gen_ops():
    spec = importlib.util.spec_from_file_location("gen_ops", ROOT / "docs" / "gen_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_op_table_is_up_to_date() -> None:
    gen = _gen_ops()
    text = DOC.read_text(encoding="utf-8")
    assert gen.update(text) == text, "docs/ir.md's op table is out of date: run `python docs/gen_ops.py`"
    assert gen.main(["--check"]) == 0


def test_op_table_lists_every_op_once() -> None:
    table = _gen_ops().render_table()
    rows = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    assert sorted(rows) == sorted(OPS)


def test_ir_examples_in_the_doc_are_canonical() -> None:
    """Every fenced block that starts with `func` is valid, canonical IR."""
    blocks = re.findall(r"```\n(func .*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "no IR examples found in docs/ir.md"
    for b in blocks:
        m = parse(b)
        verify(m)
        assert str(m) == b
