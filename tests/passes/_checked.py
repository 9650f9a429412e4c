"""Running passes on IR text in tests: the input verified, the passes' output verified after each
pass (run_pipeline under the test suite's REMAT_VERIFY_EACH_PASS), and the input left untouched."""
from __future__ import annotations

from remat.ir import parse, verify
from remat.pipeline import run_pipeline


def run_checked(text: str, passes: list[str]):
    """``(the parsed input module, the module after the passes)``."""
    m = parse(text)
    verify(m)
    before = str(m)
    out = run_pipeline(m, passes).module
    assert str(m) == before, "the pass mutated its input"
    return m, out
