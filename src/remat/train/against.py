"""What a compiled step was compiled against that a user can change between calls.

A step captures the model as it was: its training mode, which tensors are its parameters and
which of them train, their dtypes, and the precision it computes in. :class:`Against` records that
cheaply (one pass over ``model.parameters()``), so that each call can tell whether the model has
changed since (``model.eval()``, a replaced or frozen parameter, ``model.double()``, a caller's
``torch.autocast``) and follow the change with a step compiled for it, instead of running stale.
"""
from __future__ import annotations

from dataclasses import dataclass

_AUTOCAST_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Against:
    """The model's training mode, its parameters (identity, ``requires_grad``, dtype; in
    ``model.parameters()`` order) and the precision the step computes in."""

    training: bool
    params: tuple[tuple[int, bool, object], ...]
    precision: str

    @staticmethod
    def now(model, precision: str) -> "Against":
        """The model as it is now; ``precision``: the step's own, unless the caller runs it under
        ``torch.autocast`` (then the autocast's dtype: "bf16" or "fp16")."""
        import torch

        if torch.is_autocast_enabled("cpu"):
            dtype = str(torch.get_autocast_dtype("cpu")).removeprefix("torch.")
            precision = _AUTOCAST_PRECISION.get(dtype, dtype)
        return Against(model.training, tuple((id(p), p.requires_grad, p.dtype) for p in model.parameters()),
                       precision)

    def changes(self, now: "Against", model) -> list[str]:
        """What differs in ``now``, in words (the parameters by name)."""
        out = []
        if now.training != self.training:
            out.append(f"model.{'train' if now.training else 'eval'}() was called")
        names = [n for n, _ in model.named_parameters()]
        was = {i: (rg, dt) for i, rg, dt in self.params}
        for name, (i, rg, dt) in zip(names, now.params):
            if i not in was:
                out.append(f"parameter {name} was replaced")
            elif was[i][0] != rg:
                out.append(f"parameter {name} is {'trainable' if rg else 'frozen'} now")
            elif was[i][1] != dt:
                out.append(f"parameter {name} is {dt} now, was {was[i][1]}")
        if len(now.params) != len(self.params) and not out:
            out.append(f"the model has {len(now.params)} parameters, was {len(self.params)}")
        if now.precision != self.precision:
            out.append(f"it is called in {now.precision} (torch.autocast), was compiled for {self.precision}")
        return out
