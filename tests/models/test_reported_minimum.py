"""The minimum a refusal reports is itself a feasible budget, also when only the memory-lean
algorithms reach it and kernel workspaces are counted (a tiny Hugging Face EfficientNet: its
channels-last depthwise convolutions' weight gradients allocate far more than the VM counts)."""
from __future__ import annotations

import pytest
import torch

import remat

tf = pytest.importorskip("transformers")


def _efficientnet():
    cfg = tf.EfficientNetConfig(image_size=32, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=128,
                                dropout_rate=0.0, drop_connect_rate=0.0, num_labels=10)
    model = tf.EfficientNetForImageClassification(cfg)
    for m in model.modules():  # torch's default init (Hugging Face's leaves this tiny net's logits ~1e-38)
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            m.reset_parameters()
    return model.train()


def test_the_reported_minimum_compiles():
    """The minimum below was reached with the lean batch-norm backward. Asked for again, the
    chooser took the reference algorithms alone because the unconstrained step's VM count fitted,
    though its allocator bound (with workspaces) did not, and refused its own minimum."""
    torch.manual_seed(0)
    inputs = dict(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.randint(0, 10, (2,)))
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(_efficientnet(), inputs, budget="50%")
    step = remat.compile(_efficientnet(), inputs, budget=e.value.minimum)
    step(**inputs)
    assert step.last_stats.peak_bytes == step.report().predicted_peak <= step.budget


def test_a_minimum_from_a_plan_made_at_a_lower_budget_is_checked():
    """A refusal's minimum can come from a plan made at a lower budget, whose peak a plan asked for
    that minimum need not reach (the greedy is not monotone in the budget); a refusal checks its
    minimum by planning it, so the minimum it reports compiles: Hugging Face GPT-2 tiny in bf16,
    asked for 45% of its peak, below its floor."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_zoo import MODELS

    model, inputs = next(m for m in MODELS if m.name == "gpt2").build()
    opts = dict(precision="bf16", count_workspaces=False)
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(model, inputs, budget=0.45, **opts)
    step = remat.compile(model, inputs, budget=e.value.minimum, **opts)
    step(**inputs)
    assert step.last_stats.peak_bytes == step.report().predicted_peak <= e.value.minimum
