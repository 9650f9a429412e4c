"""Shared helpers of the lowering tests: a zoo step trained with and without a rewrite."""
from __future__ import annotations

import torch

import remat
from remat import zoo


def train(name: str, precision: str, budget, module=None, finder: str = "", steps: int = 3, size: str = "small"):
    """A zoo model (of ``size``) compiled with SGD at ``budget`` (or at the minimum, where that is
    above it) and trained ``steps`` steps: the step,
    its losses, and the parameters and buffers after. With ``module``, its ``finder`` finds nothing
    while compiling: the step without that rewrite."""
    real = getattr(module, finder) if module is not None else None
    if module is not None:
        setattr(module, finder, lambda *args, **kwargs: [])
    try:
        torch.manual_seed(0)
        model, ex, loss_fn = zoo.make(name, size)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        try:
            step = remat.compile(model, ex, loss_fn, optimizer=opt, budget=budget, precision=precision)
        except remat.BudgetTooSmall as e:  # the floor counts this machine's kernel workspaces: plan at it
            torch.manual_seed(0)
            model, ex, loss_fn = zoo.make(name, size)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            step = remat.compile(model, ex, loss_fn, optimizer=opt, budget=e.minimum, precision=precision)
    finally:
        if module is not None:
            setattr(module, finder, real)
    losses = [float(step(*ex)) for _ in range(steps)]
    return step, losses, [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
