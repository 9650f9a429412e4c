"""bench/third_party.py (issue 16's check on transformers models): its criteria on hand-made rows and
its attention-mask variants; the run itself (minutes) is not part of the tests."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
pytest.importorskip("transformers")
import third_party as tp  # noqa: E402


def _met(comps, model, start):
    (c,) = [c for c in comps if c["model"] == model and c["criterion"].startswith(start)]
    return c["met"]


def test_criteria_on_hand_made_rows():
    specs = {"a": tp.Spec("a", "A", lambda: None), "b+mask": tp.Spec("b+mask", "B", lambda: None, mask_variant=True),
             "c": tp.Spec("c", "C", lambda: None)}
    a = tp.Row("a", "A", none_status="ok", ratio_unconstrained=1.19, ratio_alloc=1.21, half_status="ok",
               half_loss_match=True, half_loss_rel_err=0.0, quarter_status="refused", quarter_compile_s=19.9)
    b = tp.Row("b+mask", "B", none_status="ok", ratio_unconstrained=1.0, ratio_alloc=1.0, none_loss_match=True,
               half_status="ok (VM)", half_loss_match=True, quarter_status="planned", quarter_compile_s=30.0)
    c = tp.Row("c", "C", none_status="error", half_status="skipped", quarter_status="skipped",
               errors={"unconstrained": "UnsupportedOpError: ..."})
    comps = tp.criteria([a, b, c], specs)
    assert _met(comps, "a", "remat unconstrained (report()") is True
    assert _met(comps, "a", "remat unconstrained (allocator") is False
    assert _met(comps, "a", "25% refusal") is True
    assert _met(comps, "b+mask", "25% refusal") is None          # it planned: no refusal to time
    assert _met(comps, "b+mask", "attention-mask variant") is True
    assert _met(comps, "b+mask", "50% compiles") is True
    assert _met(comps, "c", "remat unconstrained (report()") is False  # not compiled: fails, not n/a
    assert _met(comps, "c", "50% compiles") is None


def test_mask_variants():
    specs = tp.model_specs()
    for base in ("gpt2", "llama"):
        _, plain = specs[base].build()
        _, ones = specs[f"{base}+mask"].build()
        _, end = specs[f"{base}+endpad"].build()
        _, left = specs[f"{base}+leftpad"].build()
        assert torch.equal(ones["input_ids"], plain["input_ids"]) and bool(ones["attention_mask"].all())
        for v, cols in ((end, slice(-8, None)), (left, slice(0, 8))):
            assert torch.equal(v["input_ids"], plain["input_ids"])
            assert int((v["attention_mask"] == 0).sum()) == 32 and not bool(v["attention_mask"][1, cols].any())
            assert torch.equal(v["labels"] == -100, v["attention_mask"] == 0)
