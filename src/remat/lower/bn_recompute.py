"""A recomputed batch norm output from the statistics its first run saved: one pass over x.

A plan that drops a training-mode batch norm's output ``y`` and recomputes it clones the whole
``batch_norm``: the statistics pass over x (the larger part of the kernel) and the normalisation,
though the first run's mean and invstd are still alive for the backward. Runs on final straight-line
programs (after planning, like :mod:`remat.lower.siblings`): each recomputed training ``batch_norm``
of which only ``y`` is read becomes

    alpha = mul(invstd, weight)        # the first run's invstd: [C]
    one   = constant 1.0               # [C]
    y     = batch_norm(x, alpha, bias, mean, one) {training=false, eps=0}

ATen's CPU batch norm normalises in training and in eval mode with one routine
(``batch_norm_cpu_collect_linear_and_constant_terms`` then ``y = x * alpha + beta``, in
``aten/src/ATen/native/cpu/batch_norm_kernel.cpp``): ``alpha = invstd * weight``,
``beta = bias - mean * alpha``, with eval's ``invstd = 1 / sqrt(running_var + eps)``, which is exactly
1 here, so ``alpha`` is exactly the product above and ``beta`` the same expression: ``y`` is bit for
bit the first run's (every dtype, the mixed bf16/f16 kernels, NCHW and channels-last;
``tests/lower/test_bn_recompute.py``). The eval kernel makes one pass over x: zoo U-Net bf16,
[4, 16, 64, 64] channels-last, 2 threads, 81 µs for the training kernel against 27 µs.

Only where that holds: the torch dialect on the CPU (another kernel may normalise otherwise), and an
affine batch norm with float32 or float64 statistics (ATen multiplies invstd and weight in float32
for half-precision ones too, which a half-precision ``mul`` would round) whose x reaches ATen dense (channel axis 1, or 3 of a rank-4 channels-last x; other
layouts reach its element-wise fallback, which computes in another order). Where the backward reads
the recomputation's statistics too (a chain plan recomputes whole blocks), it reads the first run's
instead, the same values, which then live to their last read: a few [C] vectors longer. The
recomputation's running averages are never read. The rewritten program's peak stays within the
budget (without one, within the program's own peak), and a rewrite whose span holds an instruction
``judge`` rejects is undone.
"""
from __future__ import annotations

from ..ir import Builder, DType, Function, Instruction, Module
from ..ir.build import clone_into
from .fuse import Judge, keep_accepted, within_peak
from .small_values import read_first_runs


def _dense_for_aten(ins: Instruction) -> bool:
    """Whether the torch kernel hands ATen x dense: channels on axis 1 (contiguous), or on axis 3 of a
    rank-4 x (permuted to channels-last)."""
    rank, axis = ins.operands[0].type.rank, ins.attrs.get("axis", 1)
    return axis == 1 or (rank == 4 and axis == 3)


def find_recomputed(fn: Function, dialect_of) -> list[Instruction]:
    """The recomputed training batch norms of ``fn``'s single block that the rewrite applies to;
    ``dialect_of(ins)``: the dialect that would run ``ins``."""
    src = fn.entry.instrs
    pos = {ins: i for i, ins in enumerate(src)}
    used = {v for ins in src if ins.op.name != "free" for v in ins.operands}
    out = []
    for ins in src:
        if ins.op.name != "batch_norm" or ins.recomputes is None or not ins.attrs.get("training", True):
            continue
        first = ins.recomputes.instr
        if (first.op.name == "batch_norm" and first in pos and pos[first] < pos[ins] and ins.attrs.get("affine", True)
                and first.results[2].type.dtype in (DType.f32, DType.f64)
                and not any(r in used for r in ins.results[3:]) and _dense_for_aten(ins)
                and dialect_of(ins) == "torch"):
            out.append(ins)
    return out


def _rewrite(fn: Function, items: list[Instruction]) -> tuple[Function, dict[int, tuple[int, int]]]:
    """``fn`` with each of ``items`` normalising from its first run's statistics, which replace its own
    wherever they are read (their frees in between dropped: they live to their last read), and per
    item (by ``id``) the span of new indices where it changed what is live: from its first run to the
    last read of the statistics."""
    chosen = set(items)
    stats_of = {ins.results[k]: ins.recomputes.instr.results[k] for ins in items for k in (1, 2)}
    normalised: dict[Instruction, int] = {}  # each item's new index

    def emit(b: Builder, ins: Instruction, vmap: dict) -> None:
        if ins not in chosen:
            clone_into(b, ins, vmap)
            return
        first = ins.recomputes.instr
        x, weight, bias = (vmap[v] for v in ins.operands[:3])
        mean, invstd = vmap[first.results[1]], vmap[first.results[2]]
        alpha = b.create("mul", [invstd, weight], {}, loc=ins.loc).results[0]
        one = b.create("constant", [], {"value": 1.0, "shape": invstd.type.shape, "dtype": invstd.type.dtype},
                       loc=ins.loc).results[0]
        y = b.create("batch_norm", [x, alpha, bias, mean, one],
                     {**ins.attrs, "training": False, "eps": 0.0}, loc=ins.loc)
        y.recomputes = vmap.get(ins.recomputes)
        vmap[ins.results[0]] = y.results[0]
        normalised[ins] = len(b.block.instrs) - 1

    out, new_at, last_read = read_first_runs(fn, stats_of, set(), emit)
    spans = {}
    for ins in items:
        first = ins.recomputes.instr
        hi = max([last_read.get(first.results[k], 0) for k in (1, 2)] + [normalised[ins]])
        spans[id(ins)] = (new_at[first], max(hi, new_at[ins] + 2))
    return out, spans


def recompute_from_stats(fn: Function, dialects, judge: Judge | None = None, limit: int | None = None) -> Function:
    """``fn`` with its recomputed batch norm outputs normalised from the saved statistics (single-block
    functions without calls; others are returned unchanged); ``dialects``: those the program runs
    with (resolved, in priority order). Its VM peak stays within ``limit`` (the budget; None: ``fn``'s
    own peak), and rewrites whose span holds an instruction ``judge`` objects to are left out."""
    from .. import backends

    if fn.is_declaration or len(fn.blocks) != 1 or any(i.op.name == "call" for i in fn.entry.instrs):
        return fn
    items = find_recomputed(fn, lambda ins: ins.dialect or backends.select(ins, dialects).dialect)
    if not items:
        return fn
    return keep_accepted(fn, items, _rewrite, within_peak(fn, judge, limit))[0]


def recompute_from_stats_pass(module: Module) -> Module:
    """Pass: recomputed batch norm outputs normalised from the saved statistics (torch dialect)."""
    from .. import backends

    return Module([recompute_from_stats(f, backends.resolve()) for f in module])


__all__ = ["find_recomputed", "recompute_from_stats", "recompute_from_stats_pass"]
