"""``remat.compile`` with Hugging Face conventions on a plain module (no ``transformers``):
keyword example inputs, a dict output whose ``loss`` is used (no ``loss_fn``) or whose
``logits`` go to ``loss_fn``, and the errors for calls that do not match what was compiled."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.frontend.torch_import import ModelOutputError


class DictOut(torch.nn.Module):
    """Returns ``{"logits": ...}``, plus ``"loss"`` when given ``labels`` (the HF convention)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)

    def forward(self, x, scale=None, labels=None):
        h = torch.tanh(self.fc1(x))
        if scale is not None:
            h = h * scale
        logits = self.fc2(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def _data():
    torch.manual_seed(0)
    return torch.randn(5, 6), torch.rand(5, 16), torch.randint(0, 3, (5,))


@pytest.mark.parametrize("own_loss", [True, False], ids=["own-loss", "loss_fn-on-logits"])
def test_dict_output_step_matches_eager(own_loss):
    torch.manual_seed(0)
    model = DictOut()
    x, s, y = _data()
    eager = copy.deepcopy(model)
    if own_loss:
        inputs, loss_fn = dict(x=x, scale=s, labels=y), None
        want = eager(x, scale=s, labels=y)["loss"]
    else:
        inputs, loss_fn = dict(x=x, scale=s, target=y), F.cross_entropy
        want = F.cross_entropy(eager(x, scale=s)["logits"], y)
    step = remat.compile(model, inputs, loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    got = step(**inputs)
    want.backward()
    torch.optim.SGD(eager.parameters(), lr=0.5).step()
    assert abs(float(got) - float(want.detach())) <= 1e-6
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)


def test_positional_inputs_with_loss_fn_use_logits():
    torch.manual_seed(0)
    model = DictOut()
    x, s, y = _data()
    step = remat.compile(model, (x, s, y), F.cross_entropy, keep_grads=True)
    got = step(x, s, y)
    assert abs(float(got) - float(F.cross_entropy(model(x, s)["logits"], y).detach())) <= 1e-6


def test_keyword_step_errors_name_what_was_compiled():
    model = DictOut()
    x, s, y = _data()
    step = remat.compile(model, dict(x=x, labels=y), keep_grads=True)
    with pytest.raises(TypeError, match=r"compiled with keyword inputs x, labels.*missing: labels"):
        step(x=x)
    with pytest.raises(TypeError, match=r"unexpected: scale"):
        step(x=x, labels=y, scale=s)
    with pytest.raises(TypeError, match=r"no positional inputs \(got 2\)"):
        step(x, y)
    with pytest.raises(TypeError, match=r"input x= of the training step: expected torch.float32\[5, 6\] \(as compiled"):
        step(x=torch.randn(5, 6, dtype=torch.float64), labels=y)
    positional = remat.compile(model, (x, y), F.cross_entropy, keep_grads=True)
    with pytest.raises(TypeError, match=r"compiled with positional inputs; got keywords \['x'\]"):
        positional(x=x)


def test_unsupported_conventions_are_refused_clearly():
    model = DictOut()
    x, _, y = _data()
    with pytest.raises(ModelOutputError, match=r"dict without 'loss' \(fields: logits\).*labels=.*or give a loss_fn"):
        remat.compile(model, dict(x=x))
    with pytest.raises(TypeError, match=r"name its target\(s\) after the loss's parameters \(target"):
        remat.compile(model, dict(x=x, y=y), F.cross_entropy)
    with pytest.raises(TypeError, match=r"identifier names"):
        remat.compile(model, {"x": x, 1: y})

    class NoLogits(DictOut):
        def forward(self, x):
            h = self.fc1(x)
            return {"hidden": h, "scores": h.relu()}

    with pytest.raises(ModelOutputError, match=r"without 'logits' \(fields: hidden, scores\), so the loss_fn was given "
                                               r"the output itself.*TypeError: cross_entropy"):
        remat.compile(NoLogits(), (x, y), F.cross_entropy)


def test_keyword_step_compiles_other_shapes_too():
    torch.manual_seed(0)
    model = DictOut()
    x, _, y = _data()
    step = remat.compile(model, dict(x=x, labels=y), keep_grads=True, progress=lambda m: None)
    x3, y3 = torch.randn(3, 6), torch.randint(0, 3, (3,))
    got = step(labels=y3, x=x3)
    assert step.report().shapes_cached == 2
    assert abs(float(got) - float(model(x3, labels=y3)["loss"].detach())) <= 1e-6


def test_loss_fn_takes_an_output_without_logits_as_it_is():
    """diffusers' models return a ModelOutput with a ``sample`` and no ``logits``: the loss_fn gets the
    output, as eager code's ``F.mse_loss(unet(x, t).sample, target)`` reads it."""
    from diffusers.utils import BaseOutput

    @dataclasses.dataclass
    class SampleOutput(BaseOutput):
        sample: torch.Tensor = None

    class Denoiser(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 6)

        def forward(self, x):
            return SampleOutput(sample=self.fc(x))

    torch.manual_seed(0)
    model = Denoiser()
    x, target = torch.randn(5, 6), torch.randn(5, 6)
    step = remat.compile(model, (x, target), lambda out, t: F.mse_loss(out.sample, t), keep_grads=True)
    got = step(x, target)
    assert abs(float(got) - float(F.mse_loss(model(x).sample, target).detach())) <= 1e-6
