"""Data parallelism on ``torch.distributed`` (RAF §3.1.3): DDP and ZeRO stages 1 and 2 as passes
over the training IR, with collectives as IR ops (``remat.ir.ops.collective``).

* ``group``: the modes, this rank's place in the process group, shard layout, consistency check.
* ``passes``: ``data_parallel_step``, the pass that inserts bucketed collectives and sharded updates.
* ``memory``: per-rank bytes by kind (parameters, gradients, optimizer state, activations, ...).
* ``checkpoint``: sharded ``state_dict`` / ``load_state_dict`` and reassembling full optimizer state.

Use it through ``remat.compile(..., data_parallel="ddp" | "zero1" | "zero2")`` inside an
initialised process group.
"""
from .group import DEFAULT_BUCKET_BYTES, MODES, DataParallel, Shard, setup

__all__ = ["DEFAULT_BUCKET_BYTES", "MODES", "DataParallel", "Shard", "setup"]
