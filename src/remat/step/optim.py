"""Optimizer updates generated in the IR from a user's ``torch.optim`` optimizer.

The optimizer's own state tensors (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``step``)
are the ones remat updates in place, so ``optimizer.state_dict()`` stays valid and a run can
switch between remat and eager PyTorch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from ..ir import Builder, DType, TensorType, Value, get_op
from ..ir.opdef import REQUIRED
from ..ir.ops.optim import HYPER, hyper_type

STEP_TYPE = TensorType(DType.i64, ())
"""The step count operand of the updates (1-based)."""


@dataclass
class ParamUpdate:
    """How one parameter is updated: the IR op, its attributes (what changes the update's form),
    the state slots it uses, and the index of its param group, whose hyperparameters (learning rate,
    momentum, betas, eps, weight decay) the step reads at every call (:func:`hyper_values`)."""

    op: str                 # "sgd_step" | "adam_step"
    attrs: dict[str, Any]
    state_keys: tuple[str, ...]  # names in torch's optimizer.state[p]
    group: int = 0          # index in optimizer.param_groups


def _group_settings(op: str, group, **given: Any) -> dict[str, Any]:
    """The update op's attributes from a torch param group: ``given`` first, then the group's
    entry of the same name, then the op's declared default (the one place defaults live)."""
    out = {}
    for a in get_op(op).attrs:
        value = given[a.name] if a.name in given else group.get(a.name, a.default)
        if value is REQUIRED:
            raise ValueError(f"the optimizer's param group has no '{a.name}', which '{op}' requires")
        out[a.name] = a.coerce(op, value)
    return out


def _sgd(group, gi: int) -> ParamUpdate:
    attrs = _group_settings("sgd_step", group)
    return ParamUpdate("sgd_step", attrs, ("momentum_buffer",) if group.get("momentum", 0) != 0 else (), gi)


def _adam(group, gi: int, decoupled: bool) -> ParamUpdate:
    if group.get("amsgrad", False):
        raise ValueError("remat supports Adam/AdamW without amsgrad; set amsgrad=False")
    return ParamUpdate("adam_step", _group_settings("adam_step", group, decoupled=decoupled), ("exp_avg", "exp_avg_sq"),
                       gi)


def _make_update(optimizer) -> Callable[[dict, int], ParamUpdate]:
    import torch

    # Adam(decoupled_weight_decay=True) is AdamW (its param groups say so; AdamW's too).
    kinds = {torch.optim.SGD: _sgd, torch.optim.Adam: lambda g, gi: _adam(g, gi, g.get("decoupled_weight_decay", False)),
             torch.optim.AdamW: partial(_adam, decoupled=True)}
    make = kinds.get(type(optimizer))
    if make is None:
        raise ValueError(f"optimizer {type(optimizer).__name__} is not supported; remat generates SGD (with momentum), "
                         "Adam and AdamW updates in the IR")
    return make


def updates_from_torch(optimizer, params: list) -> list[ParamUpdate]:
    """One :class:`ParamUpdate` per parameter in ``params`` (the model's trainable ones, in import
    order), each with its param group's index.

    Raises ValueError naming the optimizer or parameter when something is unsupported.
    """
    make = _make_update(optimizer)
    by_id = {}
    for gi, group in enumerate(optimizer.param_groups):
        u = make(group, gi)
        hyper_values(u, group)  # fails now on values the step cannot take
        for p in group["params"]:
            by_id[id(p)] = u
    out = []
    for k, p in enumerate(params):
        if id(p) not in by_id:
            raise ValueError(f"parameter {k} of the model (shape {list(p.shape)}) is not in the optimizer's param groups; "
                             "pass an optimizer built from model.parameters()")
        out.append(by_id[id(p)])
    return out


def hyper_values(u: ParamUpdate, group) -> np.ndarray:
    """The ``hyper`` operand of ``u``'s update for the param group ``group`` as it is now (float64,
    in the order of :data:`remat.ir.ops.optim.HYPER`). Raises ValueError for a value the update
    cannot take (a tensor learning rate, betas outside [0, 1), nesterov without momentum)."""
    import torch

    values = dict(group)
    if u.op == "adam_step":
        values["beta1"], values["beta2"] = group["betas"]
    for name in HYPER[u.op]:
        v = values.get(name, 0.0)
        if torch.is_tensor(v):
            if v.numel() != 1:
                raise ValueError(f"param group {u.group}: {name} must be a number, got a tensor of shape {list(v.shape)}")
            values[name] = v.item()
    if u.op == "adam_step":
        for k in ("beta1", "beta2"):
            if not 0.0 <= values[k] < 1.0:
                raise ValueError(f"param group {u.group}: {k} must be in [0, 1), got {values[k]}")
    elif u.attrs["nesterov"] and (values["momentum"] <= 0 or values["dampening"] != 0):
        raise ValueError(f"param group {u.group}: nesterov needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")
    return np.array([float(values.get(k, 0.0)) for k in HYPER[u.op]], dtype=np.float64)


def check_updates(optimizer, params: list, updates: list[ParamUpdate]) -> None:
    """RuntimeError when the optimizer changed what the compiled updates cannot follow: a parameter
    moved to another param group, a group's ``nesterov``, ``maximize``, ``amsgrad`` or momentum on
    or off (the form of the update and its state). Values of the hyperparameters may change freely
    (:func:`hyper_values` reads them at every step). Runs at every step: once per group, and one
    lookup per parameter."""
    groups = optimizer.param_groups
    make = _make_update(optimizer)
    for u in update_groups(updates):
        gi = u.group
        try:
            now = make(groups[gi], gi) if gi < len(groups) else None
        except ValueError as e:
            raise RuntimeError(f"param group {gi} changed after remat.compile: {e}; compile the step again") from e
        if now is None or (now.attrs, now.state_keys) != (u.attrs, u.state_keys):
            raise RuntimeError(f"param group {gi} changed after remat.compile from {u.attrs} (state "
                               f"{list(u.state_keys)}) to {'nothing' if now is None else now.attrs} (state "
                               f"{[] if now is None else list(now.state_keys)}); these settings shape the compiled "
                               "update: compile the step again")
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    for k, (p, u) in enumerate(zip(params, updates)):
        gi = group_of.get(id(p))
        if gi != u.group:
            raise RuntimeError(f"parameter {k} (shape {list(p.shape)}) moved from param group {u.group} to "
                               f"{'none' if gi is None else gi} after remat.compile; compile the step again")


def update_groups(updates: list[ParamUpdate]) -> list[ParamUpdate]:
    """One update per param group the updates use (its first), in group order: the step program
    takes one ``hyper`` operand each."""
    first: dict[int, ParamUpdate] = {}
    for u in updates:
        first.setdefault(u.group, u)
    return [first[g] for g in sorted(first)]


def update_param_types(updates: list[ParamUpdate]) -> list[TensorType]:
    """The step program's trailing parameters for its updates: the step count, then each param
    group's ``hyper`` vector (:func:`update_groups`)."""
    return [STEP_TYPE] + [hyper_type(u.op) for u in update_groups(updates)]


@dataclass
class UpdateArgs:
    """The step program's values of :func:`update_param_types`: the step count, and the ``hyper``
    vector of each param group; ``skip``, the updates' skip flag (:func:`nonfinite_flag`; None:
    never skipped, a constant false)."""

    step: Value
    hyper: dict[int, Value]
    skip: Value | None = None

    @staticmethod
    def of(values: Sequence[Value], updates: list[ParamUpdate]) -> "UpdateArgs":
        """From the program's parameters that :func:`update_param_types` declared."""
        return UpdateArgs(values[0], {u.group: v for u, v in zip(update_groups(updates), values[1:])})


def update_arguments(optimizer, updates: list[ParamUpdate], step: int) -> list[np.ndarray]:
    """The values of :func:`update_param_types` for the next step: the step count ``step`` and the
    param groups' hyperparameters as they are now."""
    return [np.array(step, dtype=np.int64)] + [hyper_values(u, optimizer.param_groups[u.group])
                                                 for u in update_groups(updates)]


def store_contiguous(t, what: str) -> None:
    """Make ``t``, a tensor the step updates in place (a parameter, an optimizer state tensor),
    contiguous, in place: the step's kernels take contiguous tensors, and the VM would otherwise
    update a contiguous copy, leaving ``t`` as it was. A dense ``t`` alone in its storage (a
    transposed or permuted layout, e.g. ``nn.Parameter(w.t().contiguous().t())``) keeps its object,
    values, shape and storage; its bytes are reordered within its storage (as ``ohwi_view`` does for
    channels-last weights). Raises ValueError naming ``what``, its shape and strides when ``t``
    shares its storage with other tensors (a strided view of a larger one): reordering would
    change them."""
    import torch

    if t.is_contiguous():
        return
    st = t.untyped_storage()
    alone = t.storage_offset() == 0 and st.nbytes() == t.numel() * t.element_size()
    if not (alone and _dense(t)):
        raise ValueError(f"{what} (shape {list(t.shape)}, strides {list(t.stride())}, storage offset "
                         f"{t.storage_offset()}, in a storage of {st.nbytes() // max(t.element_size(), 1)} elements) is "
                         "not contiguous and shares its storage with other tensors (a strided view): remat updates it "
                         "in place with kernels that need contiguous tensors and cannot reorder a shared storage. Give "
                         "it a storage of its own before creating the optimizer, e.g. "
                         "`module.weight = nn.Parameter(module.weight.detach().contiguous())`")
    with torch.no_grad():
        values = t.detach().clone()
        t.set_(st, 0, t.shape, torch.empty(t.shape, device="meta").stride())
        t.copy_(values)


def _dense(t) -> bool:
    """``t``'s elements fill a block of its storage without gaps or overlaps (some permutation of
    its dimensions is contiguous)."""
    expect = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def store_params_contiguous(params: list, names: list[str], skip=frozenset()) -> None:
    """:func:`store_contiguous` for each parameter the step updates (but those of ``skip``: the
    OHWI weights, stored channels-last by ``frontend.torch_import.ohwi_view``)."""
    for i, (p, n) in enumerate(zip(params, names)):
        if i not in skip and not p.is_contiguous():  # (checked first: this runs before every fused step)
            store_contiguous(p, f"parameter '{n}'")


def init_state(optimizer, params: list, updates: list[ParamUpdate], known: list[list] | None = None) -> list[list]:
    """The state tensors per parameter as the first compiled step will see them: the optimizer's
    own where it has them, fresh zeros otherwise. The optimizer is not modified (a compile that
    fails must leave it as it was; torch too creates its state at the first step), but for the
    layout of a state tensor the step would otherwise update a copy of (:func:`store_contiguous`:
    one neither contiguous nor laid out as its parameter). ``known``: the state last bound
    (:func:`bind_state`), whose tensors were checked then and are not checked again."""
    import torch

    states = []
    for i, (p, u) in enumerate(zip(params, updates)):
        st = optimizer.state.get(p, {})  # .get: indexing the defaultdict would add an entry
        ts = [st[k] if st.get(k) is not None else torch.zeros_like(p, memory_format=torch.preserve_format)
              for k in u.state_keys]
        if known is None or i >= len(known) or not _same_tensors(ts, known[i]):
            for k, t in zip(u.state_keys, ts):
                if t.stride() != p.stride():
                    store_contiguous(t, f"the optimizer's {k} of parameter {i} (shape {list(p.shape)})")
        states.append(ts)
    return states


def _same_tensors(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def steps_taken(optimizer, params: list, updates: list[ParamUpdate], names: list[str] | None = None) -> int:
    """How many steps the optimizer has already applied to ``params`` (eagerly or compiled).

    Adam/AdamW keep a per-parameter ``step``; SGD keeps none, and its update only depends on
    whether a momentum buffer exists yet (1 stands for "at least one"). Raises ValueError when
    parameters disagree (a layer unfrozen after others trained), naming them (``names``, else by
    index): the compiled step passes one step count to every update.
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

        def named(k: int) -> str:
            return f"parameter '{names[k]}'" if names is not None else f"parameter {k}"

        if updates[lo].op == "adam_step":
            what = (f"the optimizer has taken {counts[lo]} step(s) for {named(lo)} but {counts[hi]} for {named(hi)} "
                    "(a layer unfrozen after others trained?); remat's compiled update applies one step count to "
                    "every parameter (Adam's bias correction reads it)")
        else:
            what = (f"the optimizer holds a {updates[hi].state_keys[0]} for {named(hi)} but none yet for {named(lo)} "
                    "(a layer unfrozen after others trained?); remat's compiled update starts every buffer at the "
                    "same step")
        raise ValueError(f"{what}. Compile without optimizer= and step the optimizer yourself "
                         "(`step = remat.compile(model, batch, loss_fn)`, then `optimizer.step()`: the gradients are in "
                         ".grad), which follows each parameter's own state")
    return next(iter(counts.values()), 0)


def current_state(optimizer, params: list, updates: list[ParamUpdate], known: list[list] | None = None) -> list[list]:
    """The state tensors the next step updates in place: the optimizer's own, and fresh zeros
    for those it has not created yet. Nothing is registered in the optimizer: a step that fails
    must leave ``optimizer.state_dict()`` as it was; :func:`bind_state` registers them after
    the step succeeded (torch too creates its state during the first step). ``known``: as
    :func:`init_state`'s."""
    return init_state(optimizer, params, updates, known)


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


def squared_sum(b: Builder, g: Value) -> Value:
    """The sum of ``g``'s squared elements, summed in ``g``'s dtype, as float32: one gradient's
    term of the global norm (:func:`clip_by_global_norm`)."""
    sq = b.op("reduce_sum", b.op("mul", g, g), axes=tuple(range(g.type.rank)), keepdims=False)
    return sq if sq.type.dtype == DType.f32 else b.op("cast", sq, dtype=DType.f32)


def clip_coefficient(b: Builder, squares: Sequence[Value], max_norm: float) -> Value:
    """``min(1, max_norm / (norm + 1e-6))`` (float32), ``norm`` the square root of the sum of
    ``squares`` (:func:`squared_sum` of each gradient, added in the order given), as
    ``torch.nn.utils.clip_grad_norm_`` computes its ``clip_coef``."""
    f32 = DType.f32
    total = None
    for sq in squares:
        total = sq if total is None else b.op("add", total, sq)
    norm = b.op("add", b.op("sqrt", total), b.op("constant", value=1e-6, shape=(), dtype=f32))
    return b.op("minimum", b.op("div", b.op("constant", value=float(max_norm), shape=(), dtype=f32), norm),
                b.op("constant", value=1.0, shape=(), dtype=f32))


def scaled_by(b: Builder, grads: Sequence[Value], coef: Value, casts: dict | None = None) -> list[Value]:
    """Each gradient times the float32 scalar ``coef`` (cast once per other dtype; ``casts``: those
    cast so far, shared between calls)."""
    casts = {} if casts is None else casts
    casts.setdefault(DType.f32, coef)
    out = []
    for g in grads:
        dt = g.type.dtype
        if dt not in casts:
            casts[dt] = b.op("cast", coef, dtype=dt)
        out.append(b.op("mul", g, casts[dt]))
    return out


def clip_by_global_norm(b: Builder, grads: Sequence[Value], max_norm: float) -> list[Value]:
    """The gradients scaled as ``torch.nn.utils.clip_grad_norm_(..., max_norm)`` scales them: by
    ``min(1, max_norm / (norm + 1e-6))``, ``norm`` the 2-norm of all of them together (each
    gradient's squares summed in its own dtype, the sums in float32)."""
    return scaled_by(b, grads, clip_coefficient(b, [squared_sum(b, g) for g in grads], max_norm))


ON_NONFINITE = ("skip", "raise", None)
"""``remat.compile(on_nonfinite=...)``: "skip" and "raise" guard the fused updates
(:func:`nonfinite_flag`); None (the default) leaves them unguarded, each right after its gradient."""


def nonfinite_flag(b: Builder, loss: Value, grads: Sequence[Value]) -> Value:
    """The updates' ``skip`` operand: true when the loss or any gradient has a NaN or infinite
    element (``torch.amp.GradScaler``'s ``found_inf``: then no update changes anything). Every
    gradient must be complete, so the updates that take it run after the last gradient."""
    return b.op("nonfinite", loss, *grads)


def emit_update(b: Builder, u: ParamUpdate, param: Value, grad: Value, state: list[Value], args: UpdateArgs) -> list[Value]:
    """Emit the in-place update; returns the new SSA values of (param, *state)."""
    hyper = args.hyper[u.group]
    if args.skip is None:
        args.skip = b.op("constant", value=False, shape=(), dtype=DType.bool)
    if u.op == "sgd_step":
        buf = state[0] if state else param  # momentum 0: no buffer; the kernel leaves this operand alone
        p2, buf2 = b.op("sgd_step", param, grad, buf, args.step, hyper, args.skip, **u.attrs)
        return [p2] + ([buf2] if state else [])
    p2, m2, v2 = b.op("adam_step", param, grad, state[0], state[1], args.step, hyper, args.skip, **u.attrs)
    return [p2, m2, v2]

