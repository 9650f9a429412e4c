"""Collective communication ops (RAF §3.1.3): data parallelism as IR.

The data-parallel passes (``remat.distributed``) insert these into a rank's training step. Each
op is *bucketed*: it takes several tensors (one bucket of gradients or parameter shards) and
communicates them as one collective, like PyTorch DDP's buckets and RAF's fused collectives.
Results are fresh buffers, so the VM counts the communication buffers like any other value and
the planner's per-rank budget includes them.

``world`` is the number of ranks the program was compiled for: the type rules of
``reduce_scatter`` and ``all_gather`` depend on it, and the torch kernels check it against the
process group. The numpy reference kernels give the semantics of a group of one rank (where
every collective is a copy); the torch kernels call ``torch.distributed``. The ops carry
``effect``: every rank must issue the same collectives in the same order, so passes never drop,
merge or recompute them.
"""
from __future__ import annotations

from ..opdef import Attr, OpDef, Sample, declare
from ..types import TensorType
from ._util import expect_float, rand

REDUCE_OPS = ("mean", "sum")
COLLECTIVES = frozenset({"all_reduce", "reduce_scatter", "all_gather"})
"""The names of the collective ops declared here."""


def _check_common(name: str, types, attrs) -> int:
    world = attrs["world"]
    if world < 1:
        raise TypeError(f"'{name}': world (the number of ranks) must be >= 1, got {world}")
    if "op" in attrs and attrs["op"] not in REDUCE_OPS:
        raise TypeError(f"'{name}': op must be one of {', '.join(REDUCE_OPS)}, got {attrs['op']!r}")
    for t in types:
        expect_float(name, t)
    return world


def _all_reduce_infer(types, attrs):
    _check_common("all_reduce", types, attrs)
    return tuple(types)


def _reduce_scatter_infer(types, attrs):
    world = _check_common("reduce_scatter", types, attrs)
    out = []
    for k, t in enumerate(types):
        if t.rank != 1 or t.shape[0] % world:
            raise TypeError(f"'reduce_scatter': operand {k} must be a flat tensor whose length divides by world={world} "
                            f"(pad it first), got {t}")
        out.append(TensorType(t.dtype, (t.shape[0] // world,)))
    return tuple(out)


def _all_gather_infer(types, attrs):
    world = _check_common("all_gather", types, attrs)
    out = []
    for k, t in enumerate(types):
        if t.rank != 1:
            raise TypeError(f"'all_gather': operand {k} must be a flat shard (rank 1), got {t}")
        out.append(TensorType(t.dtype, (t.shape[0] * world,)))
    return tuple(out)


def _comm_flops(ins, outs, attrs) -> float:
    """One add per element reduced or moved: a stand-in for transfer time in the static cost model."""
    return float(sum(t.numel for t in ins) + sum(t.numel for t in outs))


_WORLD = Attr("world", "int")
_OP = Attr("op", "str", "mean")

declare(OpDef(
    "all_reduce", None, (_WORLD, _OP), _all_reduce_infer, frozenset({"effect"}), num_results=-1, nondiff=True,
    flops=_comm_flops,
    doc="sum or mean of each operand over all ranks (one bucket, one collective); fresh result buffers",
    sample=lambda r: [Sample([rand(r, 3, 4), rand(r, 5)], {"world": 1}),
                      Sample([rand(r, 2, 2)], {"world": 1, "op": "sum"})]))
declare(OpDef(
    "reduce_scatter", None, (_WORLD, _OP), _reduce_scatter_infer, frozenset({"effect"}), num_results=-1,
    nondiff=True, flops=_comm_flops,
    doc="each flat operand [world*s] reduced over ranks; this rank keeps its slice [rank*s, (rank+1)*s)",
    sample=lambda r: [Sample([rand(r, 6), rand(r, 4)], {"world": 1})]))
declare(OpDef(
    "all_gather", None, (_WORLD,), _all_gather_infer, frozenset({"effect"}), num_results=-1, nondiff=True,
    flops=_comm_flops,
    doc="each flat shard [s] from every rank, concatenated in rank order: [world*s]",
    sample=lambda r: [Sample([rand(r, 5), rand(r, 2)], {"world": 1})]))

__all__ = ["REDUCE_OPS"]
