"""Sibling kernels (horizontal fusion, RAF §3.2.2): a convolution's two gradients become one call.

The VJP of ``conv2d`` emits ``conv2d_input_grad(gy, w)`` and ``conv2d_weight_grad(x, gy)``: two
instructions, so the planner may schedule, free and recompute around each. ATen's
``convolution_backward`` computes both from one preparation of ``gy``; called twice, each call
prepares it again (on the zoo ResNet's 16×16 feature maps the pair costs ~1.4× the single call). Runs
on final straight-line programs (after autodiff and planning, like :mod:`remat.lower.fuse`): each
pair with the same ``gy`` and attributes becomes one ``conv2d_grads(gy, x, w)`` at one of the two
positions:

* at the later one when the earlier's result is not read in between and none of its operands is
  updated in place in between; frees in between of the earlier's own operands move to just after
  the merged instruction;
* else at the earlier one when the later's operands all exist there, or can be made there: the
  instructions between the two that make them (a weight's low-precision cast, a recomputed input
  and the batch norm and ReLU before it, as plans place them just before the later member) move to
  just before the merged call, when none reads the earlier member's result or a value updated in
  place before its own position, and none is in place, an effect or random.

Values are bit-identical (the same oneDNN algorithms; ``tests/lower/test_siblings.py``). A merged
instruction allocates both gradients at once and holds the three operands until it ends, so
merging can raise the peak: pairs whose span holds a peak above the unmerged program's are left
apart, as :mod:`remat.lower.fuse` does for fused groups.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Builder, Function, Instruction, Module, OpResult, Value
from ..ir.build import clone_into
from ..ir.ops.nn import CONV_KEYS  # the attributes a convolution and its gradients share
from .fuse import Judge, inplace_updates, keep_accepted, within_peak


MAX_HOISTED = 16
"""At most this many instructions move before an early-merged pair (a longer chain is a recomputation
the plan placed late on purpose)."""


@dataclass(frozen=True)
class Pair:
    """``input_grad`` and ``weight_grad`` of one convolution; ``at`` is where the merged call goes;
    ``hoisted``: instructions (in program order) that move to just before it, making the later
    member's operands there."""

    input_grad: Instruction
    weight_grad: Instruction
    at: Instruction
    hoisted: tuple[Instruction, ...] = ()


def _defined_at(v: Value, pos: dict[Instruction, int]) -> int:
    return pos[v.instr] if isinstance(v, OpResult) else -1


def _hoistable(second: Instruction, p1: int, pos: dict[Instruction, int], clobbers: dict[Value, list[int]],
               taken: set[Instruction]) -> tuple[Instruction, ...] | None:
    """The instructions after position ``p1`` that make ``second``'s operands, in program order, if
    they can all move to just before ``p1`` (see the module's doc); None if not."""
    need: dict[Instruction, None] = {}
    todo = [v for v in second.operands if _defined_at(v, pos) >= p1]
    while todo:
        v = todo.pop()
        ins = v.instr
        if ins in need:
            continue
        at = pos[ins]
        if (at == p1 or ins in taken or len(need) == MAX_HOISTED or ins.op.name.startswith("conv2d_")
                and ins.recomputes is None or any(ins.op.has(t) for t in ("inplace", "effect", "random", "control"))
                or any(p1 <= u < at for o in ins.operands for u in clobbers.get(o, ()))):
            return None
        need[ins] = None
        todo += [o for o in ins.operands if _defined_at(o, pos) >= p1]
    return tuple(sorted(need, key=pos.__getitem__))


def find_pairs(fn: Function) -> list[Pair]:
    """The mergeable (input gradient, weight gradient) pairs of ``fn``'s single block."""
    src = fn.entry.instrs
    pos = {ins: i for i, ins in enumerate(src)}
    reads: dict[Value, list[int]] = {}
    for i, ins in enumerate(src):
        if ins.op.name != "free":
            for v in ins.operands:
                reads.setdefault(v, []).append(i)
    clobbers = inplace_updates(src)
    waiting: dict[tuple, list[Instruction]] = {}  # input grads by (gy, attributes, input shape, weight)
    for ins in src:
        if ins.op.name == "conv2d_input_grad" and ins.recomputes is None:
            key = (ins.operands[0], tuple(ins.attrs[k] for k in CONV_KEYS), tuple(ins.attrs["input_shape"]))
            waiting.setdefault(key, []).append(ins)
    pairs: list[Pair] = []
    taken: set[Instruction] = set()  # hoisted by a pair found before
    for wg in src:
        if wg.op.name != "conv2d_weight_grad" or wg.recomputes is not None or wg.attrs["input_layout"]:
            continue  # (an input read in another layout than the gradients has no input gradient to pair)
        x, gy = wg.operands
        cands = [ig for ig in waiting.get((gy, tuple(wg.attrs[k] for k in CONV_KEYS), x.type.shape), ())
                 if ig.operands[1].type.shape == tuple(wg.attrs["weight_shape"])]
        for ig in sorted(cands, key=lambda c: abs(pos[c] - pos[wg])):
            first, second = (ig, wg) if pos[ig] < pos[wg] else (wg, ig)
            p1, p2 = pos[first], pos[second]
            hoisted: tuple[Instruction, ...] | None = ()
            if not any(p1 < i < p2 for i in reads.get(first.result, ())) and not any(
                    p1 < u < p2 for v in first.operands for u in clobbers.get(v, ())):
                at = second  # (the first's operands must not be updated in place before it runs there)
            else:
                at = first
                hoisted = _hoistable(second, p1, pos, clobbers, taken)
                if hoisted is None:
                    continue
            taken.update(hoisted)
            pairs.append(Pair(ig, wg, at, hoisted))
            waiting[(gy, tuple(wg.attrs[k] for k in CONV_KEYS), x.type.shape)].remove(ig)
            break
    return pairs


def _rewrite(fn: Function, pairs: list[Pair]) -> tuple[Function, dict[int, tuple[int, int]]]:
    """``fn`` with each pair merged at its ``at``, and per pair (by ``id``) the span of new indices
    between its two members' positions."""
    src = fn.entry.instrs
    pos = {ins: i for i, ins in enumerate(src)}
    by_member = {m: p for p in pairs for m in (p.input_grad, p.weight_grad)}
    # Frees of a late-merged pair's operands between its members move after the merged call.
    moved: dict[Instruction, set[Value]] = {}
    deferred: dict[int, list[Value]] = {}
    for p in pairs:
        first = p.input_grad if p.at is p.weight_grad else p.weight_grad
        if pos[first] > pos[p.at]:
            continue  # merged early: nothing of the later member's is freed before it
        ops = set(p.input_grad.operands) | set(p.weight_grad.operands) | {first.result}
        for ins in src[pos[first] + 1:pos[p.at]]:
            if ins.op.name == "free":
                for v in ins.operands:
                    if v in ops:
                        moved.setdefault(ins, set()).add(v)
                        deferred.setdefault(id(p), []).append(v)
    # A value several late merges read (two convolutions of one input, CvT's key and value
    # projections) is freed once, after the last of them: not after each.
    last: dict[Value, Pair] = {}
    for p in pairs:
        for v in deferred.get(id(p), ()):
            if v not in last or pos[p.at] > pos[last[v].at]:
                last[v] = p
    deferred = {k: [v for v in vs if id(last[v]) == k] for k, vs in deferred.items()}
    moving = {h for p in pairs for h in p.hoisted}
    # A freed value that only a pair's moved instructions read after its merged call's place is freed
    # with them, not where it was.
    readers: dict[Value, list[Instruction]] = {}
    for ins in src:
        if ins.op.name != "free":
            for v in ins.operands:
                readers.setdefault(v, []).append(ins)
    freed = {v for ins in src if ins.op.name == "free" for v in ins.operands}
    early_frees: dict[int, list[Value]] = {}
    for p in pairs:
        here = set(p.hoisted)
        early_frees[id(p)] = [v for v in dict.fromkeys(v for h in p.hoisted for v in h.operands) if v in freed
                              and all(r in here or pos[r] < pos[p.at] for r in readers[v])]
    freed_early = {v for vs in early_frees.values() for v in vs}
    out = Function(fn.name, fn.param_types, fn.result_types)
    vmap: dict[Value, Value] = dict(zip(fn.params, out.params))
    b = Builder(out.entry)
    new_at: dict[Instruction, int] = {}
    for ins in src:
        new_at[ins] = len(out.entry.instrs)
        if ins in moving:
            continue  # made before its pair's merged call
        p = by_member.get(ins)
        if p is not None:
            if ins is not p.at:
                continue
            for h in p.hoisted:
                clone_into(b, h, vmap)
            if early_frees[id(p)]:
                b.free(*(vmap[v] for v in early_frees[id(p)]))
            ig, wg = p.input_grad, p.weight_grad
            gy, w = ig.operands
            x = wg.operands[0]
            m = b.create("conv2d_grads", [vmap[gy], vmap[x], vmap[w]], {k: ig.attrs[k] for k in CONV_KEYS},
                         loc=ig.loc)
            vmap[ig.result], vmap[wg.result] = m.results
            later = [vmap[v] for v in deferred.get(id(p), ())]
            if later:
                b.free(*dict.fromkeys(later))
            continue
        if ins.op.name == "free":
            keep = [vmap[v] for v in ins.operands if v not in moved.get(ins, ()) and v not in freed_early]
            if keep:
                b.free(*keep)
            continue
        clone_into(b, ins, vmap)
    spans = {}
    for p in pairs:
        lo, hi = sorted((new_at[p.input_grad], new_at[p.weight_grad]))
        spans[id(p)] = (lo, hi + 1)
    return out, spans


def merge_conv_grads(fn: Function, judge: Judge | None = None) -> Function:
    """``fn`` with sibling convolution gradients merged (single-block functions without calls;
    others are returned unchanged), never raising its peak; pairs whose span holds an instruction
    ``judge`` objects to are left apart too."""
    if fn.is_declaration or len(fn.blocks) != 1 or any(i.op.name == "call" for i in fn.entry.instrs):
        return fn
    pairs = find_pairs(fn)
    if not pairs:
        return fn
    return keep_accepted(fn, pairs, _rewrite, within_peak(fn, judge))[0]


def merge_conv_grads_pass(module: Module) -> Module:
    """Pass: each convolution's input and weight gradients become one ``conv2d_grads`` (peak never rises)."""
    return Module([merge_conv_grads(f) for f in module])


__all__ = ["Pair", "find_pairs", "merge_conv_grads", "merge_conv_grads_pass"]
