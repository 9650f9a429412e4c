"""The model table planned on meta tensors (``remat.compile(..., dry_run=True)``): the same program
as the real compile, and its predicted peak the VM's measured peak, to the byte."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "train"))

from hf_zoo import MODELS  # noqa: E402
from test_dry_run import check_same, compile_both  # noqa: E402

CHECKED = ("gpt2", "bert", "llama", "t5")


@pytest.mark.parametrize("name", CHECKED)
def test_meta_planned_step_is_the_real_one(name):
    entry = next(m for m in MODELS if m.name == name)
    dry, real = compile_both(lambda: (*entry.build(), None), "60%")
    check_same(dry, real)
