"""``split-concat-conv``: a convolution over a channel concatenation as one convolution per
concatenated input, summed (issue 10: a memory-lean algorithm for U-Net-style skip connections).

The pattern::

    c = concat(a, b, ...) {axis = channels}     # no other user
    y = conv2d(c, w) {groups = 1}

becomes ``y = conv2d(a, w[:, :Ca]) + conv2d(b, w[:, Ca:Ca+Cb]) + ...`` (the weight sliced along its
input channels). The concatenated activation is never built, and the backward gives each input its
own gradient instead of slices of one concatenated gradient, which stays alive, whole, as long as
either half is needed (a U-Net's skip gradient waits for the whole lower backward). It costs one
convolution call per input and the sum, and the values differ from the reference by summation order
(the channels are summed in parts), so the rewrite is not in a default pipeline: the planner applies
it as an algorithm choice it reports (``remat.plan.algorithms``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Builder, Function, Instruction, Module, Value
from ..ir.ops.nn import nchw
from ._rewrite import rewrite_matches


@dataclass
class Site:
    """One convolution rewritten: where, how many inputs, and the concatenation's bytes."""

    where: str
    inputs: int
    concat_bytes: int


def _channel_axis(conv: Instruction) -> int:
    return 1 if conv.attrs.get("layout", "NCHW") == "NCHW" else 3


def _match(conv: Instruction, uses: dict[Value, int]) -> Instruction | None:
    """The ``concat`` feeding ``conv`` along its channels (only user, float operands), or None."""
    x = conv.operands[0]
    cat = getattr(x, "instr", None)
    if cat is None or cat.op.name != "concat" or uses.get(x, 0) != 1 or len(cat.operands) < 2:
        return None
    if conv.attrs.get("groups", 1) != 1 or conv.attrs.get("input_layout", "") not in ("", conv.attrs.get("layout", "NCHW")):
        return None
    if conv.attrs.get("weight_layout", "OIHW") != "OIHW":  # the weight is sliced along its axis 1
        return None
    rank = x.type.rank
    if cat.attrs["axis"] % rank != _channel_axis(conv):
        return None
    return cat


def split_concat_conv(f: Function) -> tuple[Function, list[Site]]:
    """A copy of ``f`` with every matching ``concat -> conv2d`` replaced (see the module's doc), and
    one :class:`Site` per rewritten convolution (none when nothing matched)."""
    def match(ins: Instruction, uses: dict[Value, int]):
        cat = _match(ins, uses) if ins.op.name == "conv2d" else None
        return None if cat is None else ([cat], cat)

    pos = {ins: k for k, ins in enumerate(f.entry.instrs)}

    def emit(b: Builder, ins: Instruction, cat: Instruction) -> tuple[Value, Site]:
        w = ins.operands[1]
        b.loc = ins.loc
        starts = [0]
        for a in cat.operands:
            starts.append(starts[-1] + nchw("conv2d", a.type, ins.attrs)[1])

        def part(k: int) -> Value:
            wa = b.op("slice", w, start=(0, starts[k], 0, 0), stop=(w.type.shape[0], starts[k + 1]) + w.type.shape[2:])
            return b.op("conv2d", cat.operands[k], wa, **ins.attrs)

        # The input computed last (a U-Net's upsampled activation, next to a skip kept from long
        # before) is convolved first: where the step recomputes it, it dies before the other
        # convolutions run. The sum keeps the inputs' order, so the values do not depend on this.
        first = max(range(len(cat.operands)), key=lambda k: (pos.get(getattr(cat.operands[k], "instr", None), -1), k))
        early = part(first)
        y = None
        for k in range(len(cat.operands)):
            p = early if k == first else part(k)
            y = p if y is None else b.op("add", y, p)
        return y, Site("(unknown)" if ins.loc is None else (ins.loc.path or "(top level)"), len(cat.operands),
                       cat.results[0].type.nbytes)

    return rewrite_matches(f, match, emit)


def split_concat_conv_pass(module: Module) -> Module:
    """Replace each convolution over a channel concatenation by one convolution per input, summed."""
    return Module([split_concat_conv(f)[0] for f in module])


__all__ = ["Site", "split_concat_conv", "split_concat_conv_pass"]
