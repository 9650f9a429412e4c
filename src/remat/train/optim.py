"""Optimizer updates generated in the IR from a user's ``torch.optim`` optimizer.

The optimizer's own state tensors (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``step``)
are the ones remat updates in place, so ``optimizer.state_dict()`` stays valid and a run can
switch between remat and eager PyTorch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ir import Builder, DType, TensorType, Value


@dataclass
class ParamUpdate:
    """How one parameter is updated: the IR op, its attributes, and the state slots it uses."""

    op: str                 # "sgd_step" | "adam_step"
    attrs: dict[str, Any]
    state_keys: tuple[str, ...]  # names in torch's optimizer.state[p]


def _sgd(group) -> ParamUpdate:
    attrs = dict(lr=float(group["lr"]), momentum=float(group.get("momentum", 0.0)),
                 dampening=float(group.get("dampening", 0.0)), weight_decay=float(group.get("weight_decay", 0.0)),
                 nesterov=bool(group.get("nesterov", False)), maximize=bool(group.get("maximize", False)))
    return ParamUpdate("sgd_step", attrs, ("momentum_buffer",) if attrs["momentum"] != 0 else ())


def _adam(group, decoupled: bool) -> ParamUpdate:
    if group.get("amsgrad", False):
        raise ValueError("remat supports Adam/AdamW without amsgrad; set amsgrad=False")
    b1, b2 = group["betas"]
    attrs = dict(lr=float(group["lr"]), beta1=float(b1), beta2=float(b2), eps=float(group["eps"]),
                 weight_decay=float(group.get("weight_decay", 0.0)), decoupled=decoupled,
                 maximize=bool(group.get("maximize", False)))
    return ParamUpdate("adam_step", attrs, ("exp_avg", "exp_avg_sq"))


def updates_from_torch(optimizer, params: list) -> list[ParamUpdate]:
    """One :class:`ParamUpdate` per parameter in ``params`` (the model's, in import order).

    Raises ValueError naming the optimizer or parameter when something is unsupported.
    """
    import torch

    kinds = {torch.optim.SGD: lambda g: _sgd(g), torch.optim.Adam: lambda g: _adam(g, False),
             torch.optim.AdamW: lambda g: _adam(g, True)}
    make = kinds.get(type(optimizer))
    if make is None:
        raise ValueError(f"optimizer {type(optimizer).__name__} is not supported; remat generates SGD (with momentum), "
                         "Adam and AdamW updates in the IR")
    by_id = {}
    for gi, group in enumerate(optimizer.param_groups):
        if torch.is_tensor(group["lr"]):
            raise ValueError(f"param group {gi}: a tensor learning rate is not supported; use a float")
        u = make(group)
        for p in group["params"]:
            by_id[id(p)] = u
    out = []
    for k, p in enumerate(params):
        if id(p) not in by_id:
            raise ValueError(f"parameter {k} of the model (shape {list(p.shape)}) is not in the optimizer's param groups; "
                             "pass an optimizer built from model.parameters()")
        out.append(by_id[id(p)])
    return out


def init_state(optimizer, params: list, updates: list[ParamUpdate]) -> list[list]:
    """The optimizer's state tensors per parameter, created (zeros, like torch) if absent."""
    import torch

    states = []
    for p, u in zip(params, updates):
        st = optimizer.state[p]
        for key in u.state_keys:
            if st.get(key) is None:
                st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if "step" not in st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
        states.append([st[k] for k in u.state_keys])
    return states


def emit_update(b: Builder, u: ParamUpdate, param: Value, grad: Value, state: list[Value], step: Value) -> list[Value]:
    """Emit the in-place update; returns the new SSA values of (param, *state)."""
    if u.op == "sgd_step":
        buf = state[0] if state else grad  # momentum 0: no buffer; the gradient slot is consumed instead
        p2, buf2 = b.op("sgd_step", param, grad, buf, step, **u.attrs)
        return [p2] + ([buf2] if state else [])
    p2, m2, v2 = b.op("adam_step", param, grad, state[0], state[1], step, **u.attrs)
    return [p2, m2, v2]


STEP_TYPE = TensorType(DType.i64, ())
