"""Optimizer updates generated in the IR from a user's ``torch.optim`` optimizer.

The optimizer's own state tensors (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``step``)
are the ones remat updates in place, so ``optimizer.state_dict()`` stays valid and a run can
switch between remat and eager PyTorch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ir import Builder, DType, TensorType, Value, get_op
from ..ir.opdef import REQUIRED


@dataclass
class ParamUpdate:
    """How one parameter is updated: the IR op, its attributes, and the state slots it uses."""

    op: str                 # "sgd_step" | "adam_step"
    attrs: dict[str, Any]
    state_keys: tuple[str, ...]  # names in torch's optimizer.state[p]


def _attrs_from_group(op: str, group, **given: Any) -> dict[str, Any]:
    """The update op's attributes from a torch param group: ``given`` first, then the group's
    entry of the same name, then the op's declared default (the one place defaults live)."""
    out = {}
    for a in get_op(op).attrs:
        value = given[a.name] if a.name in given else group.get(a.name, a.default)
        if value is REQUIRED:
            raise ValueError(f"the optimizer's param group has no '{a.name}', which '{op}' requires")
        out[a.name] = a.coerce(op, value)
    return out


def _sgd(group) -> ParamUpdate:
    attrs = _attrs_from_group("sgd_step", group)
    return ParamUpdate("sgd_step", attrs, ("momentum_buffer",) if attrs["momentum"] != 0 else ())


def _adam(group, decoupled: bool) -> ParamUpdate:
    if group.get("amsgrad", False):
        raise ValueError("remat supports Adam/AdamW without amsgrad; set amsgrad=False")
    b1, b2 = group["betas"]
    attrs = _attrs_from_group("adam_step", group, beta1=float(b1), beta2=float(b2), decoupled=decoupled)
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
    """The state tensors per parameter as the first compiled step will see them: the optimizer's
    own where it has them, fresh zeros otherwise. The optimizer is not modified (a compile that
    fails must leave it as it was; torch too creates its state at the first step)."""
    import torch

    states = []
    for p, u in zip(params, updates):
        st = optimizer.state.get(p, {})  # .get: indexing the defaultdict would add an entry
        states.append([st[k] if st.get(k) is not None else torch.zeros_like(p, memory_format=torch.preserve_format)
                       for k in u.state_keys])
    return states


def steps_taken(optimizer, params: list, updates: list[ParamUpdate]) -> int:
    """How many steps the optimizer has already applied to ``params`` (eagerly or compiled).

    Adam/AdamW keep a per-parameter ``step``; SGD keeps none, and its update only depends on
    whether a momentum buffer exists yet (1 stands for "at least one"). Raises ValueError when
    parameters disagree: the compiled step passes one step count to every update.
    """
    import torch

    counts = {}
    for k, (p, u) in enumerate(zip(params, updates)):
        st = optimizer.state.get(p, {})
        if u.op == "adam_step":
            s = st.get("step", 0)
            counts[k] = int(s.item() if torch.is_tensor(s) else s)
        else:
            counts[k] = int(bool(u.state_keys) and st.get(u.state_keys[0]) is not None)
    if len(set(counts.values())) > 1:
        lo, hi = min(counts, key=counts.get), max(counts, key=counts.get)
        raise ValueError(f"the optimizer has taken {counts[lo]} step(s) for parameter {lo} (shape {list(params[lo].shape)}) "
                         f"but {counts[hi]} for parameter {hi} (shape {list(params[hi].shape)}); remat applies one step "
                         "count to every parameter, so all must have been stepped equally often")
    return next(iter(counts.values()), 0)


def current_state(optimizer, params: list, updates: list[ParamUpdate]) -> list[list]:
    """The state tensors the next step updates in place: the optimizer's own, and fresh zeros
    for those it has not created yet. Nothing is registered in the optimizer: a step that fails
    must leave ``optimizer.state_dict()`` as it was; :func:`bind_state` registers them after
    the step succeeded (torch too creates its state during the first step)."""
    return init_state(optimizer, params, updates)


def bind_state(optimizer, params: list, updates: list[ParamUpdate], fallback: list[list]) -> list[list]:
    """The live state tensors for the next step, registering ``fallback`` tensors (from
    :func:`init_state`) for any the optimizer does not have yet, so that ``optimizer.state`` and
    ``state_dict()`` hold exactly the tensors remat updates in place."""
    import torch

    states = []
    for p, u, fb in zip(params, updates, fallback):
        st = optimizer.state[p]
        for key, t in zip(u.state_keys, fb):
            if st.get(key) is None:
                st[key] = t
        if u.op == "adam_step" and "step" not in st:
            dt = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # as torch.optim
            st["step"] = torch.tensor(0.0, dtype=dt)
        states.append([st[k] for k in u.state_keys])
    return states


def advance_steps(optimizer, params: list, updates: list[ParamUpdate]) -> None:
    """Count one more step in the optimizer's state (Adam/AdamW's ``step``, in place like torch)."""
    import torch

    for p, u in zip(params, updates):
        st = optimizer.state[p]
        if "step" in st:
            if torch.is_tensor(st["step"]):
                st["step"].add_(1)
            else:
                st["step"] += 1


def emit_update(b: Builder, u: ParamUpdate, param: Value, grad: Value, state: list[Value], step: Value) -> list[Value]:
    """Emit the in-place update; returns the new SSA values of (param, *state)."""
    if u.op == "sgd_step":
        buf = state[0] if state else param  # momentum 0: no buffer; the kernel leaves this operand alone
        p2, buf2 = b.op("sgd_step", param, grad, buf, step, **u.attrs)
        return [p2] + ([buf2] if state else [])
    p2, m2, v2 = b.op("adam_step", param, grad, state[0], state[1], step, **u.attrs)
    return [p2, m2, v2]


STEP_TYPE = TensorType(DType.i64, ())
