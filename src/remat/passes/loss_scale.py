"""Loss scaling for fp16 training (``remat.compile(precision="fp16")``).

Gradients computed in float16 underflow where they are small; ``torch.amp.GradScaler`` multiplies
the loss by a scale ``S`` (a power of two) before the backward, so every gradient is ``S`` times
larger, divides them by ``S`` again before the update, and skips the update (halving ``S``) when
one overflowed. :func:`with_loss_scale` is the first half as a rewrite of the captured forward: a
new ``f32[]`` input after the model's inputs and targets, the scale, multiplies the loss it returns.
Differentiating that forward seeds the backward with ``S``; the step program unscales each gradient
before its update (``remat.step.program.step_program``). The scale is a run-time value, so the
scaler's growth and backoff never recompile anything.
"""
from __future__ import annotations

from dataclasses import replace

from ..ir import Builder, DType, Function, Module, TensorType
from ..ir.build import clone_into

SCALE_TYPE = TensorType(DType.f32, ())


def scale_loss(fn: Function, at: int) -> Function:
    """``fn`` with a new ``f32[]`` parameter at position ``at`` that multiplies its first result (the
    loss, cast to f32 and back when it is not f32)."""
    if any(b is not fn.entry for b in fn.blocks):
        raise ValueError(f"@{fn.name}: loss scaling rewrites straight-line forwards; this one branches")
    loss_t = fn.result_types[0]
    if loss_t.rank != 0 or not loss_t.dtype.is_float:
        raise ValueError(f"@{fn.name}: the loss must be a floating-point scalar to be scaled, got {loss_t}")
    types = list(fn.param_types)
    types.insert(at, SCALE_TYPE)
    out = Function(fn.name, types, list(fn.result_types))
    params = list(out.params)
    scale = params.pop(at)
    vmap = dict(zip(fn.params, params))
    b = Builder(out.entry)
    body, ret = fn.entry.instrs[:-1], fn.entry.instrs[-1]
    for ins in body:
        clone_into(b, ins, vmap)
    results = [vmap[v] for v in ret.operands]
    loss = results[0]
    if loss_t.dtype == DType.f32:
        results[0] = b.op("mul", loss, scale)
    else:
        results[0] = b.op("cast", b.op("mul", b.op("cast", loss, dtype=DType.f32), scale), dtype=loss_t.dtype)
    b.ret(*results)
    return out


def with_loss_scale(imported):
    """An imported model (``remat.frontend.torch_import.ImportedModel``) whose forward takes the loss
    scale as its last input (after the model's inputs and targets, before the random seed) and returns
    the scaled loss."""
    fn = imported.function
    at = imported.state_count + imported.input_count
    scaled = scale_loss(fn, at)
    module = Module([scaled if f is fn else f for f in imported.module.functions.values()])
    return replace(imported, module=module, function=module[fn.name], input_count=imported.input_count + 1)
