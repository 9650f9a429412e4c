"""The IR's ``autocast`` pass (``remat.passes.autocast``) on ``transformers`` models at tiny configs
with random weights: on each model's float32 capture it gives the program captured under
``torch.autocast``, bit for bit. Models whose code casts dtypes itself are left out: a cast to
float32 is no cast in a float32 capture (Llama's RMS norm, T5's layer norm, the mixture-of-experts
routers' softmax), and GPT-2's ``addmm`` bias is added after its product in the IR."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from hf_zoo import MODELS  # noqa: E402

import os, sys  # noqa: E402,E401
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "passes"))
from _checked import autocast_as_captured  # noqa: E402

AS_CAPTURED = ("bert", "vit", "resnet", "convnext", "segformer", "vitmae")


@pytest.mark.parametrize("zm", [m for m in MODELS if m.name in AS_CAPTURED], ids=lambda m: m.name)
def test_hf_model_as_captured_under_torch_autocast(zm):
    model, inputs = zm.build()
    autocast_as_captured(model, inputs)
