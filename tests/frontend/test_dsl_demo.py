"""The foundation demo (``python -m remat.examples_dsl``) runs, and both dialects and the static prediction agree."""
from __future__ import annotations

from remat import examples_dsl


def test_demo_runs_and_agrees(capsys):
    assert examples_dsl.main() == 0
    out = capsys.readouterr().out
    assert "func @mlp(" in out and "cond_br" in out and "call @conv_block(" in out
    assert out.count("-> agree") >= 3 and "DISAGREE" not in out
    assert "matches the measurement" in out and "DIFFERS" not in out
