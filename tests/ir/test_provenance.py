"""Provenance: each instruction's source location and, for a recomputation, the value it
recomputes, printed as a trailing  // loc(...) that parses back; IR without them prints unchanged."""
from __future__ import annotations

import pytest

from remat.ir import Loc, ParseError, parse, print_module

TEXT = """func @f(%0: f32[2,3]) -> f32[2,3] {
  %1 = exp %0 : f32[2,3]  // loc("layers.0.mlp", "model.py":12)
  %2 = exp %0 : f32[2,3]  // loc("layers.0.mlp", "model.py":12, recompute=%1)
  %3 = add %1, %2 : f32[2,3]  // loc("")
  free %1  // loc(recompute=%2)
  return %3
}
"""


def test_locations_round_trip():
    m = parse(TEXT)
    assert print_module(m) == TEXT
    ins = m["f"].entry.instrs
    assert ins[0].loc == Loc("layers.0.mlp", "model.py", 12) and ins[0].recomputes is None
    assert ins[1].recomputes is ins[0].results[0]
    assert ins[2].loc == Loc("")
    assert ins[3].loc is None and ins[3].recomputes is ins[1].results[0]


def test_clone_keeps_provenance():
    f = parse(TEXT)["f"].clone()
    assert print_module(parse(TEXT)) == print_module(type(parse(TEXT))([f]))
    assert f.entry.instrs[1].recomputes is f.entry.instrs[0].results[0]


def test_without_provenance_nothing_is_printed():
    text = TEXT.replace('  // loc("layers.0.mlp", "model.py":12, recompute=%1)', "").replace(
        '  // loc("layers.0.mlp", "model.py":12)', "").replace('  // loc("")', "").replace("  // loc(recompute=%2)", "")
    assert "loc" not in print_module(parse(text)) and print_module(parse(text)) == text


@pytest.mark.parametrize("bad, message", [
    ('loc(12)', "expected a module path"),
    ('loc("a", "f.py":1, "g.py":2)', "two source locations"),
    ('loc("a" "b")', "expected ','"),
    ('loc(recompute=%9)', "use of undefined value %9"),
])
def test_bad_locations_are_errors(bad, message):
    text = TEXT.replace('loc("")', bad)
    with pytest.raises(ParseError, match=message):
        parse(text)
