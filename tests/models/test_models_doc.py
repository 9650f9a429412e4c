"""docs/models.md stays true to the model table: one row per model of ``hf_zoo.MODELS``, in order,
with its class, inputs and parameter count, in the generator's format (timings are not checked:
they are of the machine that generated the file). Regenerate with ``python docs/gen_models.py``."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hf_zoo import MODELS

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_models", ROOT / "docs" / "gen_models.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_models"] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_models_doc_has_one_generated_row_per_model():
    gen = _gen()
    text = gen.DOC.read_text(encoding="utf-8")
    rows = gen.parse(text)
    assert gen.render(rows) == text, "docs/models.md is not in the generated format: run `python docs/gen_models.py`"
    assert [(r.name, r.hf_class) for r in rows] == [(m.name, m.hf_class) for m in MODELS], \
        "docs/models.md lists other models than tests/models/hf_zoo.py: run `python docs/gen_models.py`"
    for r, m in zip(rows, MODELS):
        model, inputs = m.build()
        assert r.inputs == gen._describe(inputs), f"{m.name}: inputs changed; regenerate docs/models.md"
        assert r.parameters == sum(p.numel() for p in model.parameters()), f"{m.name}: parameter count changed"
        assert 0 < r.min_fraction <= 0.5, f"{m.name}: the table promises a feasible 50% budget"
        assert r.step_ratio > 0 and r.setup_seconds > 0
