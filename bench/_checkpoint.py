"""The √N checkpointing baseline: ``torch.utils.checkpoint`` applied generically to a model.

How the segments are chosen (documented in bench/README.md):

* **Sequential body.** Among the model's direct children, the ``nn.Sequential`` holding the most
  leaf modules (layers) is its body (so a ResNet's stages win over its 4-layer stem); a body whose elements are all ``nn.Sequential`` (ResNet stages) is flattened
  one level into its blocks. Its ``N`` blocks are split into ``k = round(√N)`` (at least 2, at most ``N``) contiguous
  segments and run with ``torch.utils.checkpoint.checkpoint_sequential(body, k, x,
  use_reentrant=False)``: only segment inputs are kept during the forward; each segment is
  recomputed in the backward. As in PyTorch's helper, the last segment is not checkpointed (its
  activations are needed first by the backward, so recomputing it would save nothing at the peak).
* **Non-sequential body** (U-Net: its forward has long skips, so blocks cannot be regrouped
  without rewriting it). The blocks are the composite modules (modules with children) held in the
  model's ``nn.ModuleList`` children; each block is one checkpointed segment. For the U-Net, 7
  double-conv blocks of 6 layers each: 7 segments for ≈42 layers, i.e. ≈√N segments of ≈√N layers.

The model is changed in place (children replaced by wrappers that share the same parameters).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


@dataclass(frozen=True)
class CheckpointPlan:
    """What :func:`apply_sqrt_checkpointing` did: which child, how many blocks and segments."""

    kind: str                # "sequential" | "per-block"
    target: str              # the child's name (comma-separated for per-block)
    blocks: int              # N
    segments: int            # segments checkpointed or run (k)
    segment_sizes: tuple[int, ...]

    def describe(self) -> str:
        """One line for the results table."""
        return f"{self.kind} {self.target}: {self.blocks} blocks in {self.segments} segments {list(self.segment_sizes)}"


class CheckpointedSequential(nn.Module):
    """Runs ``blocks`` as ``segments`` checkpointed segments (``use_reentrant=False``)."""

    def __init__(self, blocks: nn.Sequential, segments: int):
        super().__init__()
        self.blocks = blocks
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.blocks(x)
        return checkpoint_sequential(self.blocks, self.segments, x, use_reentrant=False)


class CheckpointedBlock(nn.Module):
    """Runs one block under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.block(*args)
        return checkpoint(self.block, *args, use_reentrant=False)


def _flatten(seq: nn.Sequential) -> nn.Sequential:
    kids = list(seq)
    if len(kids) > 0 and all(isinstance(k, nn.Sequential) for k in kids):
        return nn.Sequential(*[b for k in kids for b in k])
    return seq


def _leaf_count(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if len(list(m.children())) == 0)


def _segment_sizes(n: int, k: int) -> tuple[int, ...]:
    # checkpoint_sequential's split: k-1 segments of n // k blocks, the rest in the last one
    size = n // k
    return tuple([size] * (k - 1) + [n - size * (k - 1)])


def sqrt_segments(n: int) -> int:
    """Number of segments for ``n`` blocks: ``round(√n)``, at least 2 (one checkpointed segment
    plus the last, kept one) and at most ``n``."""
    if n < 1:
        raise ValueError(f"need at least one block to checkpoint, got {n}")
    return min(n, max(2, round(math.sqrt(n))))


def apply_sqrt_checkpointing(model: nn.Module) -> CheckpointPlan:
    """Wrap ``model``'s body in √N-segment checkpointing in place; see the module docstring.

    Raises ValueError when the model has neither a sequential body nor blocks in a ModuleList.
    """
    best: tuple[str, nn.Sequential, int] | None = None
    for name, child in model.named_children():
        if isinstance(child, nn.Sequential):
            flat = _flatten(child)
            leaves = _leaf_count(child)
            if len(flat) >= 2 and (best is None or leaves > best[2]):
                best = (name, flat, leaves)
    if best is not None:
        name, flat, _ = best
        k = sqrt_segments(len(flat))
        setattr(model, name, CheckpointedSequential(flat, k))
        return CheckpointPlan("sequential", name, len(flat), k, _segment_sizes(len(flat), k))
    lists = [(n, c) for n, c in model.named_children() if isinstance(c, nn.ModuleList)]
    names, count = [], 0
    for name, ml in lists:
        wrapped = False
        for i, block in enumerate(ml):
            if len(list(block.children())) > 0:
                ml[i] = CheckpointedBlock(block)
                count += 1
                wrapped = True
        if wrapped:
            names.append(name)
    if count == 0:
        raise ValueError(f"{type(model).__name__} has no nn.Sequential child with >= 2 blocks and no composite "
                         "blocks in an nn.ModuleList child; the √N checkpointing wrapper cannot segment it")
    return CheckpointPlan("per-block", ",".join(names), count, count, (1,) * count)
