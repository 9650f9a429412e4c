"""Shared helpers for the ``remat.compile`` tests: eager references, per-step batches, comparisons."""
from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from remat import zoo

NAMES = ("mlp", "resnet", "gpt", "unet")


def make(name: str, dtype: torch.dtype = torch.float32, **kwargs):
    """A tiny zoo model; the GPT without dropout unless asked (eager and remat draw different masks)."""
    if name == "gpt":
        kwargs.setdefault("dropout", 0.0)
    return zoo.make(name, "tiny", dtype, **kwargs)


def eager_loss(model: nn.Module, inputs: Sequence[torch.Tensor], loss_fn: Callable) -> torch.Tensor:
    """``loss_fn(model(*inputs[:-1]), inputs[-1])``: every zoo loss takes one target."""
    return loss_fn(model(*inputs[:-1]), inputs[-1])


def batches(inputs: Sequence[torch.Tensor], n: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """``n`` different batches with the shapes and dtypes of ``inputs``: float tensors get fresh
    noise, integer tensors (labels, tokens) are rolled so they stay in their valid range."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        b = []
        for t in inputs:
            if t.dtype.is_floating_point:
                b.append(t + 0.5 * torch.randn(t.shape, generator=g, dtype=t.dtype))
            else:
                b.append(torch.roll(t.flatten(), k).reshape(t.shape).clone())
        out.append(tuple(b))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero): a tensor-wise relative error."""
    a, b = a.detach().double(), b.detach().double()
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def assert_tensors_close(got: dict, want: dict, tol: float, what: str) -> None:
    """Same keys; every tensor within ``tol`` (relative, tensor-wise); integer tensors exactly equal."""
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for k in want:
        g, w = got[k], want[k]
        if torch.is_tensor(w) and not w.dtype.is_floating_point:
            assert torch.equal(g, w), f"{what} {k}: {g} != {w}"
            continue
        if not torch.is_tensor(w):
            assert float(g) == float(w), f"{what} {k}: {g} != {w}"
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} {k}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
        e = rel_err(g, w)
        assert e <= tol, f"{what} {k}: relative error {e:.3g} > {tol:g}"


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each named parameter's ``.grad`` (tied weights once, as ``named_parameters`` lists them)."""
    out = {}
    for n, p in model.named_parameters():
        assert p.grad is not None, f"parameter {n} has no gradient"
        out[n] = p.grad
    return out


def snapshot(model: nn.Module, optimizer=None) -> dict:
    """Deep copies of the model's parameters, buffers and gradients, and of the optimizer's state."""
    snap = {"model": copy.deepcopy(model.state_dict()),
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}}
    if optimizer is not None:
        snap["optim"] = copy.deepcopy(optimizer.state_dict())
    return snap


def assert_snapshot_equal(a: dict, b: dict) -> None:
    """Two :func:`snapshot` results are bit-identical (same keys, ``torch.equal`` tensors)."""
    def eq(x, y, where):
        if torch.is_tensor(x) or torch.is_tensor(y):
            assert torch.is_tensor(x) and torch.is_tensor(y) and torch.equal(x, y), f"{where} changed"
        elif isinstance(x, dict):
            assert isinstance(y, dict) and set(x) == set(y), f"{where}: keys changed: {sorted(map(str, set(x) ^ set(y)))}"
            for k in x:
                eq(x[k], y[k], f"{where}[{k!r}]")
        elif isinstance(x, (list, tuple)):
            assert type(x) is type(y) and len(x) == len(y), f"{where} changed"
            for i, (u, v) in enumerate(zip(x, y)):
                eq(u, v, f"{where}[{i}]")
        else:
            assert x == y, f"{where}: {x!r} != {y!r}"

    eq(a, b, "state")


class DeepMLP(nn.Module):
    """A deep, narrow MLP on a large batch: parameters are a few KiB, activations hundreds of KiB,
    so the unconstrained training step is dominated by activations (a chain remat can shrink)."""

    def __init__(self, width: int = 8, depth: int = 16, classes: int = 4):
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_deep_mlp(batch: int = 1024, dtype: torch.dtype = torch.float32, seed: int = 0):
    """(model, (x, y), loss_fn) for :class:`DeepMLP`."""
    torch.manual_seed(seed)
    model = DeepMLP().to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 8, generator=g, dtype=dtype)
    y = torch.randint(0, 4, (batch,), generator=g)
    return model, (x, y), F.cross_entropy
