"""Data parallelism as a pass over the training IR (RAF §3.1.3).

``data_parallel_step`` turns a (possibly rematerialised) joint ``(args...) -> (loss, buffers...,
grads...)`` into one rank's training step, like ``remat.step.program.step_program`` but with the
collectives of the chosen mode inserted:

* ``ddp``: gradients are grouped into buckets in the order they become complete; as soon as a
  bucket is complete, one ``all_reduce`` (mean over ranks) averages it, and that bucket's
  optimizer updates follow at once, so reduced gradients are freed bucket by bucket.
* ``zero1``: as ``ddp``, but each rank updates only its shard of every parameter (a flat slice,
  padded to ``world * size``) with its shard of the optimizer state; one ``all_gather`` per
  bucket collects the updated shards and ``assign`` writes them back into the parameters.
* ``zero2``: the buckets are ``reduce_scatter``-ed instead, so a rank only ever receives the
  reduced gradient of its own shards.

Every rank runs the same sequence of collectives; only the slice offsets differ. Mean over
ranks: averaging the ranks' mean-loss gradients equals the gradient of the mean loss over the
concatenated batch only when every rank's shard of the batch has the same size.
"""
from __future__ import annotations

from ..ir import Builder, DType, Function, Module, TensorType, Value, verify
from ..ir.ops.optim import SKIP
from ..step.optim import ParamUpdate, UpdateArgs, emit_update, nonfinite_flag, update_param_types
from ..step.program import Layout, update_points
from .group import DataParallel, Shard


def shard_type(t: TensorType, dp: DataParallel) -> TensorType:
    """The type of this rank's shard of a parameter (or of its optimizer state) of type ``t``."""
    return TensorType(t.dtype, (dp.shard(t.numel).size,))


def _flat(b: Builder, v: Value) -> Value:
    return v if v.type.rank == 1 else b.op("reshape", v, shape=(v.type.numel,))


def _padded(b: Builder, flat: Value, sh: Shard, world: int) -> Value:
    """``flat`` padded with zeros to ``world * sh.size`` elements."""
    extra = world * sh.size - sh.numel
    return flat if extra == 0 else b.op("pad", flat, low=(0,), high=(extra,))


def _my_shard(b: Builder, v: Value, sh: Shard) -> Value:
    """This rank's shard of ``v`` as a fresh flat buffer of ``sh.size`` elements (zeros past the end)."""
    flat = _flat(b, v)
    start = min(sh.offset, sh.numel)
    part = b.op("slice", flat, start=(start,), stop=(start + sh.valid,))
    return part if sh.valid == sh.size else b.op("pad", part, low=(0,), high=(sh.size - sh.valid,))


def _agreed_flag(b: Builder, local: Value, world: int) -> Value:
    """True on every rank when ``local`` is true on any: one all_reduce of a scalar that is NaN where
    the flag is set (0 elsewhere), so every rank skips the same steps."""
    f32 = DType.f32
    mark = b.op("select", local, b.op("constant", value=float("nan"), shape=(), dtype=f32),
                b.op("constant", value=0.0, shape=(), dtype=f32))
    return b.op("nonfinite", b.op("all_reduce", mark, world=world, op="sum"))


def data_parallel_step(joint: Function, layout: Layout, updates: list[ParamUpdate],
                       state_types: list[list[TensorType]], dp: DataParallel, name: str = "train_step",
                       check: bool = True, guard: str | None = None) -> Function:
    """One rank's step: ``(joint args..., optimizer state (sharded under ZeRO)..., step, hyper...) -> (loss,
    buffers...[, skipped])``.

    ``guard``: the non-finite guard (``step.program.step_program``), one flag agreed by all ranks (one
    scalar all_reduce): "loss", true when a rank's loss is not finite, agreed before the first
    bucket's updates, which still follow their buckets; "all", true when a rank's loss or any reduced
    gradient (its shards under ZeRO-2) is not finite: the buckets are communicated as they complete,
    but every update waits for the flag, so every reduced gradient is kept until the last bucket."""
    n_out = layout.first_grad
    flat_state = [t for ts in state_types for t in ts]
    fn = Function(name, list(joint.param_types) + flat_state + update_param_types(updates),
                  list(joint.result_types[:n_out]) + ([SKIP] if guard else []))
    b = Builder(fn.entry)
    vmap: dict[Value, Value] = dict(zip(joint.params, fn.params))
    body, ret = joint.entry.instrs[:-1], joint.entry.instrs[-1]
    grads = ret.operands[n_out:]
    state_vals, off = [], len(joint.params)
    for ts in state_types:
        state_vals.append(list(fn.params[off:off + len(ts)]))
        off += len(ts)
    uargs = UpdateArgs.of(fn.params[off:], updates)
    shards = [dp.shard(p.type.numel) for p in joint.params[:layout.n_params]]

    at: dict[int, list[int]] = {}
    for k, w in enumerate(update_points(joint, layout, after_loss=guard == "loss")):  # the guard: no bucket before the loss
        at.setdefault(w, []).append(k)

    pending: list[tuple[list[int], list[Value], list[Value]]] = []  # guard: reduced buckets awaiting the flag

    def flush(bucket: list[int]) -> None:
        """Communicate one complete bucket, then run its updates (and, under ZeRO, gather them back);
        with the guard, the updates wait for :func:`apply`."""
        if not bucket:
            return
        gs = [vmap[grads[k]] for k in bucket]
        params = [vmap[joint.params[k]] for k in bucket]
        if dp.mode == "zero2":
            padded = [_padded(b, _flat(b, g), shards[k], dp.world) for g, k in zip(gs, bucket)]
            reduced = b.op("reduce_scatter", *padded, world=dp.world)
        else:
            reduced = b.op("all_reduce", *gs, world=dp.world)
        reduced = [reduced] if isinstance(reduced, Value) else list(reduced)
        if guard == "all":
            pending.append((bucket, params, reduced))
            return
        if guard == "loss" and uargs.skip is None:
            uargs.skip = _agreed_flag(b, nonfinite_flag(b, vmap[ret.operands[0]], []), dp.world)
        apply(bucket, params, reduced)

    def apply(bucket: list[int], params: list[Value], reduced: list[Value]) -> None:
        if dp.mode == "ddp":
            for k, p, g in zip(bucket, params, reduced):
                emit_update(b, updates[k], p, g, state_vals[k], uargs)
            return
        new_shards = []
        for k, p, g in zip(bucket, params, reduced):
            g_sh = g if dp.mode == "zero2" else _my_shard(b, g, shards[k])
            new_shards.append(emit_update(b, updates[k], _my_shard(b, p, shards[k]), g_sh, state_vals[k], uargs)[0])
        gathered = b.op("all_gather", *new_shards, world=dp.world)
        gathered = [gathered] if isinstance(gathered, Value) else list(gathered)
        for p, full in zip(params, gathered):
            b.op("assign", p, full)

    bucket: list[int] = []
    size = 0

    def ready(ks: list[int]) -> None:
        nonlocal bucket, size
        for k in ks:
            bucket.append(k)
            size += grads[k].type.nbytes
            if size >= dp.bucket_bytes:
                flush(bucket)
                bucket, size = [], 0

    ready(at.get(-1, []))
    for i, ins in enumerate(body):
        new = b.create(ins.op.name, [vmap[o] for o in ins.operands], ins.attrs,
                       result_types=[r.type for r in ins.results], dialect=ins.dialect)
        for r, nr in zip(ins.results, new.results):
            vmap[r] = nr
        ready(at.get(i, []))
    flush(bucket)
    outs = [vmap[v] for v in ret.operands[:n_out]]
    if guard == "all":
        local = nonfinite_flag(b, vmap[ret.operands[0]], [g for _, _, gs in pending for g in gs])
        uargs.skip = _agreed_flag(b, local, dp.world)
        for item in pending:
            apply(*item)
    if guard:
        outs.append(uargs.skip)
    b.ret(*outs)
    if check:
        verify(Module([fn]))
    return fn
