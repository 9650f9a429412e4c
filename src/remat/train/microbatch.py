"""Micro-batching as a planning dimension of ``remat.compile``.

``micro_batches=k`` runs the batch as ``k`` micro-batches with gradient accumulation: the step
captures one micro-batch, plans its joint under the budget minus what accumulation keeps (the
step program built by :func:`remat.step.microbatch.microbatch_step` holds the accumulated
gradients, parameters, optimizer state and the whole batch's inputs, and its exact peak is what
every planner fits), and the VM runs the whole step as one program, so predicted == measured.
``micro_batches="auto"`` chooses ``k`` jointly with recomputation: for each ``k`` dividing the
batch, in increasing order, the cheapest plan that fits is found and its whole-step time
predicted (the cost model over all micro-batches); the cheapest feasible ``k`` wins
(:func:`remat.train.api.compile_auto`).

Semantics are kept, or micro-batching is refused (:class:`MicroBatchingRefused`): models whose
forward mixes samples (batch norm with batch statistics) or updates buffers are refused; the loss
must be a mean or a sum over the batch's samples, which is checked on the example batch by
evaluating the loss eagerly (a float64 copy of the model, eval mode, no gradients) on each
micro-batch and on the whole batch (a later batch whose samples weigh differently, e.g. other
counts of ignored tokens, is not checked again).
"""
from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Sequence

from ..step.microbatch import REDUCTIONS, batch_dependent

if TYPE_CHECKING:
    from .compilation import Compilation


class MicroBatchingRefused(ValueError):
    """Micro-batching would change what the step computes (batch statistics, buffer updates, a loss
    that is neither a mean nor a sum over samples), or the inputs cannot be split."""


def batch_size(inputs: Sequence) -> int | None:
    """The batch size shared by every input's axis 0, or None when they disagree (or one is 0-d)."""
    sizes = {t.shape[0] if len(getattr(t, "shape", ())) else None for t in inputs}
    return sizes.pop() if len(sizes) == 1 else None


def check_micro_batches(k, inputs: Sequence, data_parallel: bool) -> int:
    """``k`` validated against the example inputs: a positive divisor of their common batch size."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"micro_batches must be a positive int (or 'auto' in remat.compile), got {k!r}")
    if k == 1:
        return 1
    if data_parallel:
        raise MicroBatchingRefused("micro_batches > 1 with data_parallel is not supported yet: each rank's shard is "
                                   "one micro-batch; use micro_batches=1")
    n = batch_size(inputs)
    if n is None:
        raise MicroBatchingRefused("micro-batching splits every input along axis 0, but the inputs' axis 0 sizes "
                                   f"differ: {[list(getattr(t, 'shape', ())) for t in inputs]}")
    if n % k:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise MicroBatchingRefused(f"micro_batches={k} does not divide the batch of {n}; valid: {divisors}")
    return k


def _keep_float64():
    """A ``TorchFunctionMode`` under which a float64 tensor cast to another floating dtype
    (``.float()``, ``.to(torch.float32)``, ``.type(torch.float32)``) stays float64:
    ``transformers``' losses cast their logits with ``.float()``, which would evaluate the float64
    check's loss in float32 and let its rounding fail the check (Llama, Mistral: refused or not
    by the seed)."""
    import torch
    from torch.overrides import TorchFunctionMode

    narrowing = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}

    class KeepFloat64(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
                if func in narrowing:
                    return x
                if func in (torch.Tensor.to, torch.Tensor.type):
                    dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
                    if dtype is not None and dtype.is_floating_point:
                        kwargs = {**kwargs, "dtype": torch.float64} if "dtype" in kwargs else kwargs
                        args = tuple(torch.float64 if isinstance(a, torch.dtype) else a for a in args)
            return func(*args, **kwargs)

    return KeepFloat64()


def micro_batch_semantics(c: "Compilation", loss_reduction: str | None) -> str:
    """The loss reduction micro-batching must apply ("mean" or "sum"), after refusing models whose
    forward depends on the batch. ``loss_reduction`` given: trusted; None: checked eagerly on the
    example's micro-batches and the whole batch (a float64 copy of the model in eval mode)."""
    why = batch_dependent(c.imported.function, c.binding.layout)
    if why:
        raise MicroBatchingRefused("micro-batching would change what this step computes: " + "; ".join(why)
                                   + ". Use micro_batches=1 (a smaller batch, or a larger budget)")
    if loss_reduction is not None:
        if loss_reduction not in REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {REDUCTIONS} or None (checked), got {loss_reduction!r}")
        return loss_reduction
    import torch

    from ..frontend.torch_import import loss_module

    k, b = c.micro_batches, c.capture_example[0].shape[0]
    try:  # in float64, so that a mean over unequal counts cannot hide in float32 rounding
        model, in_float64 = copy.deepcopy(c.model).double(), True
        example = tuple(t.double() if t.is_floating_point() else t for t in c.signature.example)
    except (RuntimeError, TypeError):
        model, in_float64, example = c.model, False, c.signature.example
    wrapper, tensors = loss_module(model, c.signature.keywords(example), c.loss_fn, c.num_targets)
    modes = [m.training for m in model.modules()]
    wrapper.eval()
    try:
        with torch.no_grad(), _keep_float64() if in_float64 else contextlib.nullcontext():
            losses = [wrapper(*[t[i * b:(i + 1) * b] for t in tensors]) for i in range(k)] + [wrapper(*tensors)]
    finally:
        for m, t in zip(model.modules(), modes):
            m.training = t
    # A loss computed in float32 after all (or a model with no float64 copy): its rounding, not a
    # count, may differ.
    in_float64 = in_float64 and not any(torch.is_tensor(v) and v.dtype != torch.float64 for v in losses)
    tol = 1e-9 if in_float64 else 1e-5
    *parts, both = [float(v) for v in losses]
    mean, total = sum(parts) / k, sum(parts)
    scale = max(abs(both), abs(total), 1e-30)
    if abs(both - mean) <= tol * scale and abs(mean - total) > tol * scale:
        return "mean"
    if abs(both - total) <= tol * scale:
        return "sum"
    raise MicroBatchingRefused(
        f"micro-batching needs a loss that is a mean or a sum over the batch's samples: on the example's {k} "
        f"micro-batches of {b} the loss is {', '.join(f'{v:.10g}' for v in parts)}, on the whole batch {both:.10g} "
        f"(neither their mean {mean:.10g} nor their sum {total:.10g}; e.g. a mean over non-ignored tokens whose "
        f"count differs between micro-batches). "
        f"Pass loss_reduction='mean' or 'sum' if the difference is intended, or use micro_batches=1")


def whole_batch_peak(c: "Compilation") -> int:
    """The unconstrained peak of the whole batch's step (no micro-batching): the reference of
    relative budgets for a micro-batched step. Captures the whole batch (no planning, no VM)."""
    from ..frontend.torch_import import import_module
    from ..passes.layout import with_layout
    from ..plan.simulator import predict_peak
    from ..step.program import prepare_joint, step_program, training_forward, training_graph

    imp = with_layout(import_module(c.model, c.signature.keywords(c.signature.example), c.loss_fn,
                                    train=None, num_targets=c.num_targets, autocast=c.options.autocast),
                      c.options.layout)
    joint = prepare_joint(training_graph(training_forward(imp.function), len(imp.param_names)), c.dialects)
    b = c.binding
    return predict_peak(step_program(joint, b.layout, b.updates, b.state_types, c.keep_grads,
                                     guard=c.options.on_nonfinite is not None))
