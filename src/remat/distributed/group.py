"""The process-group glue: which data-parallel mode, on which rank of how many.

remat does not run its own communication engine: a program compiled with ``data_parallel`` runs
its collectives through ``torch.distributed`` on the default process group, which the user
initialises (``torch.distributed.init_process_group``; ``torchrun`` sets the environment).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

from ..ir.core import Function
from ..plan.record import Plan

MODES = ("ddp", "zero1", "zero2")
"""``ddp``: gradients averaged by bucketed ``all_reduce``; ``zero1``: optimizer state sharded, each
rank updates its shard of every parameter and the parameters are all-gathered; ``zero2``: the
gradients are reduce-scattered too, so no rank holds all reduced gradients."""

DEFAULT_BUCKET_BYTES = 1 << 20
"""Gradients are communicated in buckets of about this many bytes (PyTorch DDP's first bucket is
1 MiB, its others 25 MiB; remat keeps buckets small because a complete bucket is what lets its
optimizer updates run and its gradients be freed)."""


@dataclass(frozen=True)
class Shard:
    """This rank's slice of one parameter, flattened and padded to ``world * size`` elements."""

    numel: int   # elements of the parameter
    size: int    # elements per shard: ceil(numel / world)
    offset: int  # rank * size (may pass numel on the last ranks: those elements are padding)

    @property
    def valid(self) -> int:
        """Elements of the parameter in this shard (the rest is padding)."""
        return max(0, min(self.size, self.numel - self.offset))


@dataclass
class DataParallel:
    """A data-parallel setting for one rank. ``steps``: optimizer steps taken under ZeRO (whose
    sharded state remat keeps itself, not in ``optimizer.state``)."""

    mode: str
    rank: int
    world: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    steps: int = 0

    @property
    def shards_state(self) -> bool:
        return self.mode in ("zero1", "zero2")

    def shard(self, numel: int) -> Shard:
        size = max(1, math.ceil(numel / self.world))
        return Shard(numel, size, self.rank * size)


def setup(mode: str | None, bucket_bytes: int | None = None) -> DataParallel | None:
    """The setting for ``remat.compile(..., data_parallel=mode)`` on this rank, or None
    (``bucket_bytes=None``: :data:`DEFAULT_BUCKET_BYTES`).

    Raises ValueError for an unknown mode and RuntimeError outside an initialised process group.
    """
    if mode is None:
        return None
    if mode not in MODES:
        raise ValueError(f"data_parallel must be None or one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if bucket_bytes is None:
        bucket_bytes = DEFAULT_BUCKET_BYTES
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"data_parallel={mode!r} needs an initialised torch.distributed process group; call "
                           "torch.distributed.init_process_group (e.g. backend='gloo' on CPU, 'nccl' on GPU) "
                           "before remat.compile, or launch with torchrun")
    return DataParallel(mode, dist.get_rank(), dist.get_world_size(), bucket_bytes)


def collective_signature(fn) -> str:
    """A digest of the collectives ``fn`` issues, in order (op, attributes, operand types)."""
    from ..ir.ops.collective import COLLECTIVES

    h = hashlib.sha256()
    for ins in fn.instructions():
        if ins.op.name in COLLECTIVES:
            h.update(f"{ins.op.name}{sorted(ins.attrs.items())}{[str(v.type) for v in ins.operands]};".encode())
    return h.hexdigest()


def check_same_collectives(fn, dp: DataParallel) -> None:
    """Every rank must issue the same collectives in the same order; raise RuntimeError if not
    (e.g. a planner with a time limit chose different plans on different ranks)."""
    import torch.distributed as dist

    mine = collective_signature(fn)
    sigs: list = [None] * dp.world
    dist.all_gather_object(sigs, mine)
    if len(set(sigs)) != 1:
        bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
        raise RuntimeError(f"ranks {bad} compiled a step whose collectives differ from rank 0's; every rank must "
                           "compile the same model with the same options and budget (use a deterministic solver: "
                           "solver='greedy' or the default chain planner, not a time-limited MILP)")


def plan_on_rank0(plan: Callable[[], Plan], dp: DataParallel, budget: int | None) -> Plan:
    """Plan once, on rank 0, and give every rank that plan (as canonical IR text).

    Ranks that planned independently could choose different plans (a time-limited MILP under
    different load, kernel workspaces measured a little differently), and then issue different
    collectives. Rank 0 runs ``plan``; its program (and a lean algorithm's unconstrained step) travel
    as IR text with the solver's notes, so every rank runs the same program. A refusal on rank 0
    (``BudgetTooSmall`` or any other error) is raised on every rank, with rank 0's message. Ranks must
    pass the same budget: a rank whose budget differs from rank 0's raises ValueError naming both.
    """
    import pickle

    import torch.distributed as dist

    from ..ir.parser import parse
    from ..ir.printer import print_function

    budgets: list = [None] * dp.world
    dist.all_gather_object(budgets, budget)
    if len(set(budgets)) != 1:
        raise ValueError(f"data-parallel ranks must compile with the same budget; got {budgets} (bytes, by rank): "
                         "pass the same budget on every rank (it is per rank)")
    payload: list = [None]
    if dp.rank == 0:
        try:
            c = plan()
            payload[0] = ("ok", print_function(c.program),
                          None if c.unconstrained is None else print_function(c.unconstrained),
                          c.solver, list(c.notes), c.overhead, c.peak, list(c.algorithms))
        except Exception as e:  # every rank must learn of it, or the others wait forever
            try:
                pickle.loads(blob := pickle.dumps(e))  # it must also load on the other ranks
                payload[0] = ("error", blob)
            except Exception:
                payload[0] = ("error", pickle.dumps(RuntimeError(f"rank 0 could not plan: {type(e).__name__}: {e}")))
            dist.broadcast_object_list(payload, src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    if payload[0][0] == "error":
        raise pickle.loads(payload[0][1])
    if dp.rank == 0:
        return c
    _, program, unconstrained, solver, notes, overhead, peak, algorithms = payload[0]

    def fn(text: str) -> Function:
        return next(iter(parse(text).functions.values()))

    return Plan(solver, notes + ["planned on rank 0 and received as IR text"], fn(program), overhead, peak=peak,
                budget=budget, algorithms=algorithms, unconstrained=None if unconstrained is None else fn(unconstrained))
