"""Micro-batching as IR: one training step over ``k`` micro-batches with gradient accumulation.

The step program takes the whole batch, slices micro-batch ``i`` out of every input (axis 0),
runs a copy of the (possibly rematerialised) micro-batch joint on it, adds its gradients into one
accumulator per parameter as soon as each gradient exists, and after the last micro-batch scales
the accumulated gradients and the summed loss (``1/k`` for a loss that is a mean over the batch's
samples, ``1`` for a sum) and applies the optimizer updates, each right after its accumulated
gradient is complete (as in :func:`.program.step_program`). It is one straight-line function, so
``predict_peak`` and the VM count the whole step, accumulators included, exactly.

Gradients equal the full batch's up to summation order: the batch's sum is split into ``k`` partial
sums added in micro-batch order (and, for ``k`` a power of two, the ``1/k`` scaling is exact).
Random ops get an independent seed per micro-batch (``fold_seed``), so dropout masks differ from
the full batch's (same distribution, other draws).
"""
from __future__ import annotations

from ..ir import Builder, Function, Module, TensorType, Value, verify
from ..ir.build import clone_into
from ..ir.ops.optim import SKIP
from .optim import ParamUpdate, UpdateArgs, emit_update, nonfinite_flag, update_param_types
from .program import Layout, update_points

MICRO_SEED_SALT = 0x5EED_0000
"""``fold_seed`` salt of micro-batch 0 (micro-batch ``i`` uses ``MICRO_SEED_SALT + i``): far from
the small salts the importer gives each dropout."""

REDUCTIONS = ("mean", "sum")


def batch_dependent(fn: Function, layout: Layout) -> list[str]:
    """Why ``fn`` (a forward or joint) would compute something else on micro-batches than on the
    whole batch: ops that mix samples (batch norm with batch statistics) and buffers updated by the
    step (running statistics would be updated once per micro-batch). Empty when none."""
    why: list[str] = []
    for ins in fn.instructions():
        if ins.op.name == "batch_norm" and ins.attrs.get("training", True):
            where = f" ({ins.loc.path or 'top level'})" if ins.loc is not None else ""
            why.append(f"batch_norm in training mode{where} normalises with the batch's statistics")
            break
    if layout.n_buffers_out:
        why.append(f"the step updates {layout.n_buffers_out} buffer(s) (e.g. running statistics) once per call")
    return why


def micro_input_types(full: list[TensorType], k: int) -> list[TensorType]:
    """The types of one micro-batch's inputs: axis 0 divided by ``k`` (each input's batch axis)."""
    out = []
    for t in full:
        if t.rank == 0 or t.shape[0] % k:
            raise ValueError(f"micro-batching into {k}: every input needs a batch axis 0 divisible by {k}, got {t}")
        out.append(t.with_shape((t.shape[0] // k,) + tuple(t.shape[1:])))
    return out


def microbatch_step(joint: Function, layout: Layout, updates: list[ParamUpdate] | None,
                    state_types: list[list[TensorType]], keep_grads: bool, k: int, reduction: str = "mean",
                    name: str = "train_step", check: bool = True, guard: bool = False) -> Function:
    """The step over ``k`` micro-batches of ``joint`` (a straight-line micro-batch joint, possibly
    rematerialised): ``(state..., whole-batch inputs...[, seed], optimizer state..., step) ->
    (loss[, grads...][, skipped])``, the same signature as :func:`.program.step_program` of the whole batch.

    ``reduction``: "mean" (the loss is a mean over the batch's samples: micro-batch losses and
    gradients are weighted by ``1/k``) or "sum" (weight 1). ``guard``: the non-finite guard of
    :func:`.program.step_program`, on the summed loss and the accumulated gradients; every update
    then follows the last micro-batch."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if layout.n_buffers_out:
        raise ValueError("micro-batching a step that updates buffers (running statistics) would update them once "
                         "per micro-batch; it is refused")
    n_s, n_in = layout.n_state, layout.n_inputs
    micro_in = list(joint.param_types[n_s:n_s + n_in])
    full_in = [t.with_shape((t.shape[0] * k,) + tuple(t.shape[1:])) for t in micro_in]
    ptypes = list(joint.param_types[:n_s]) + full_in + list(joint.param_types[n_s + n_in:])
    flat_state = [t for ts in state_types for t in ts] if updates else []
    ptypes += flat_state + (update_param_types(updates) if updates else [])
    grad_types = list(joint.result_types[1:])
    guard = bool(updates) and guard and not keep_grads  # (keep_grads: this step applies no update)
    fn = Function(name, ptypes, [joint.result_types[0]] + (grad_types if keep_grads else []) + ([SKIP] if guard else []))
    b = Builder(fn.entry)
    state_args, in_args = fn.params[:n_s], fn.params[n_s:n_s + n_in]
    seed_arg = fn.params[n_s + n_in] if layout.has_seed else None
    body, ret = joint.entry.instrs[:-1], joint.entry.instrs[-1]
    loss_v, grads = ret.operands[0], ret.operands[1:]
    pos_of: dict[Value, int] = {r: i for i, ins in enumerate(body) for r in ins.results}
    # Each gradient is added to its accumulator right after the instruction defining it (-1: before the body).
    acc_at: dict[int, list[int]] = {}
    for j, g in enumerate(grads):
        acc_at.setdefault(pos_of.get(g, -1), []).append(j)
    upd_at: dict[int, list[int]] = {}
    if updates and not keep_grads:
        if not guard:
            for j, w in enumerate(update_points(joint, layout)):
                upd_at.setdefault(w, []).append(j)
        state_vals, off = [], n_s + n_in + int(layout.has_seed)
        for ts in state_types:
            state_vals.append(fn.params[off:off + len(ts)])
            off += len(ts)
        uargs = UpdateArgs.of(fn.params[off:], updates)
    weight = 1.0 / k if reduction == "mean" else 1.0
    scales: dict[object, Value] = {}

    def scaled(v: Value) -> Value:
        if weight == 1.0:
            return v
        dt = v.type.dtype
        if dt not in scales:
            scales[dt] = b.op("constant", value=weight, shape=(), dtype=dt)
        return b.op("mul", v, scales[dt])

    acc: list[Value | None] = [None] * len(grads)
    loss_acc: Value | None = None
    for i in range(k):
        last = i == k - 1
        vmap: dict[Value, Value] = dict(zip(joint.params[:n_s], state_args))
        for p, x, t in zip(joint.params[n_s:n_s + n_in], in_args, micro_in):
            lo = i * t.shape[0]
            vmap[p] = b.op("slice", x, start=(lo,) + (0,) * (t.rank - 1),
                           stop=(lo + t.shape[0],) + tuple(t.shape[1:]), step=(1,) * t.rank)
        if seed_arg is not None:
            vmap[joint.params[n_s + n_in]] = b.op("fold_seed", seed_arg, salt=MICRO_SEED_SALT + i)

        def at(pos: int) -> None:
            for j in acc_at.get(pos, []):
                g = vmap.get(grads[j], grads[j])
                acc[j] = g if acc[j] is None else b.op("add", acc[j], g)
            if last:
                for j in upd_at.get(pos, []):
                    emit_update(b, updates[j], state_args[j], scaled(acc[j]), list(state_vals[j]), uargs)

        at(-1)
        for pos, ins in enumerate(body):
            clone_into(b, ins, vmap)
            at(pos)
        loss_i = vmap.get(loss_v, loss_v)
        loss_acc = loss_i if loss_acc is None else b.op("add", loss_acc, loss_i)
    skip = None
    if guard:  # every update after the last micro-batch, once the flag is known
        uargs.skip = skip = nonfinite_flag(b, loss_acc, acc)
        for j in range(len(grads)):
            emit_update(b, updates[j], state_args[j], scaled(acc[j]), list(state_vals[j]), uargs)
    outs = [scaled(loss_acc)] + ([scaled(a) for a in acc] if keep_grads else []) + ([skip] if guard else [])
    b.ret(*outs)
    if check:
        verify(Module([fn]))
    return fn

