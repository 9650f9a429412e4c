"""A cached capture is checked against the model before use (issue 47, item 1): a forward that
reads a dict global, a class attribute or an environment variable computes another program when
they change, which the cache key cannot see; the second compile captures again (with a warning
naming the entry) and trains as eager PyTorch does."""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

import remat
from remat.frontend.torch_import import import_module

SETTINGS = {"act": "relu"}


class ByDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.relu(h) if SETTINGS["act"] == "relu" else torch.tanh(h))


class ByClassAttribute(ByDict):
    act = "relu"

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.relu(h) if type(self).act == "relu" else torch.tanh(h))


class ByEnvironment(ByDict):
    def forward(self, x):
        h = self.a(x)
        return self.b(torch.relu(h) if os.environ.get("REMAT_TEST_ACT", "relu") == "relu" else torch.tanh(h))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("REMAT_CAPTURE_CACHE", "1")
    yield
    SETTINGS["act"] = "relu"
    ByClassAttribute.act = "relu"


def _set(case: str, act: str, monkeypatch) -> None:
    if case == "dict":
        SETTINGS["act"] = act
    elif case == "class":
        ByClassAttribute.act = act
    else:
        monkeypatch.setenv("REMAT_TEST_ACT", act)


def _train(cls, steps: int = 3):
    """Compile a fresh model (the same weights each time) and train it as eager does; the report."""
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = remat.compile(model, (x, y), nn.functional.mse_loss, optimizer=opt)
    for _ in range(steps):
        loss = step(x, y)
        ref_opt.zero_grad()
        want = nn.functional.mse_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(torch.as_tensor(float(loss)), want.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return step.report()


@pytest.mark.parametrize("case", ["dict", "class", "env"])
def test_a_changed_value_the_forward_reads_is_captured_again(case, monkeypatch):
    cls = {"dict": ByDict, "class": ByClassAttribute, "env": ByEnvironment}[case]
    _set(case, "relu", monkeypatch)
    assert not _train(cls).capture_cached
    assert _train(cls).capture_cached  # unchanged: the cache answers, checked
    _set(case, "tanh", monkeypatch)
    with pytest.warns(RuntimeWarning, match="no longer matches the model's eager output"):
        assert not _train(cls).capture_cached  # the relu program is not reused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _train(cls).capture_cached  # the tanh capture, cached in its place
    _set(case, "relu", monkeypatch)
    with pytest.warns(RuntimeWarning, match="no longer matches"):
        assert not _train(cls).capture_cached


def test_dropout_is_checked_with_every_element_kept():
    """A model with dropout is validated (not captured again each time): both sides keep every
    element; its buffers and the RNG state are as before the check."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    ex = (torch.randn(5, 4), torch.randn(5, 2))
    import_module(model, ex, nn.functional.mse_loss, cache=True)
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert import_module(model, ex, nn.functional.mse_loss, cache=True).from_cache
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))
    assert torch.equal(rng, torch.get_rng_state())


def test_a_model_drawing_other_random_numbers_is_captured_again_quietly():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x) + 0.01 * torch.rand_like(x[:, :2])

    torch.manual_seed(0)
    model, ex = Noisy(), (torch.randn(3, 4), torch.randn(3, 2))
    import_module(model, ex, nn.functional.mse_loss, cache=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not import_module(model, ex, nn.functional.mse_loss, cache=True).from_cache


def test_the_check_can_be_skipped(monkeypatch):
    """``REMAT_CAPTURE_CHECK=0`` trusts the key (the check costs two forwards): the documented trade-off."""
    monkeypatch.setenv("REMAT_CAPTURE_CHECK", "0")
    torch.manual_seed(0)
    ex = (torch.randn(3, 4), torch.randn(3, 2))
    import_module(ByDict(), ex, nn.functional.mse_loss, cache=True)
    SETTINGS["act"] = "tanh"
    assert import_module(ByDict(), ex, nn.functional.mse_loss, cache=True).from_cache  # not checked


def test_a_capture_under_autocast_is_checked_at_16_bit_tolerance(tmp_path, monkeypatch):
    """A bf16 step's loss is fp32 but computed in bf16: eager autocast and the cached program round
    differently (a tiny T5: 2.5e-3 apart). The cached capture is the same program: used, not rebuilt."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    inputs = dict(input_ids=torch.randint(0, 100, (2, 16)), labels=torch.randint(1, 100, (2, 8)))
    remat.compile(copy.deepcopy(model), inputs, precision="bf16")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = remat.compile(copy.deepcopy(model), inputs, precision="bf16")
    assert again.report().capture_cached
    assert not [w for w in seen if "capture cache entry" in str(w.message)]  # a rebuilt entry warns
