"""What planning a training step needs, as IR (:class:`StepProblem`), and the peak its plans are judged by.

The planners (:mod:`.portfolio`), the plan cache (:mod:`.frontier`) and the algorithm chooser
(:mod:`.algorithms`) all read it; it depends on none of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir import Function, Instruction
from .costmodel import MeasuredSignatures
from .simulator import predict_peak
from .workspace import allocator_bound


@dataclass
class StepProblem:
    """What planning a training step needs, as IR. Bytes and seconds."""

    forward: Function           # the imported forward: (state..., inputs...[, seed]) -> (loss, others...)
    n_state: int                # parameters and buffers leading the forward's arguments
    n_params: int
    joint: Function             # forward + backward: -> (loss, others..., grads...)
    unconstrained: Function     # the step program without recomputation
    budget: int | None
    # A joint-shaped program -> the step program (adds the updates). The planners hand it programs
    # built for it and dropped after, so it may take their instructions over.
    finish: Callable[[Function], Function]
    extra_bytes: int            # what the step adds to the joint: optimizer state and step counter
    costs: dict[Instruction, float]  # per-instruction seconds (estimated or measured)
    solver: str = "auto"
    milp_time_limit: float = 10.0
    dialects: tuple[str, ...] | None = None
    workspaces: dict[Instruction, int] | None = None  # kernels' own bytes per joint instruction (graph solvers)
    # Kernels' own bytes of any function's instructions (remat.runtime.allocator.workspaces). When
    # set, a plan fits when its allocator bound (VM high-water marks + workspaces) is within the
    # budget, and the chain DP's per-stage transient terms include the stages' workspaces.
    workspace_fn: Callable[[Function], dict[Instruction, int]] | None = None
    # The joint's training batch-norm backwards are split (remat.passes.batchnorm.split_batch_norm_grad,
    # a memory-lean algorithm): the chain planner's blocks are differentiated the same way.
    split_bn_grad: bool = False
    # Indices of the joint's results that ``finish`` consumes as soon as they are computed: the
    # gradients, when each one's update follows it (one process, an optimizer, gradients not kept).
    # The graph model then counts each as its node's workspace rather than holding it to the end.
    consumed: tuple[int, ...] = ()
    # A profiled compile's measured seconds by signature (remat.plan.costmodel.MeasuredSignatures):
    # the cost model prices instructions ``costs`` lacks by them (measured alone once each), not by
    # the static estimate. None: static.
    measured: MeasuredSignatures | None = None


def fit_peak(p: StepProblem, program: Function) -> int:
    """The peak (bytes) a program of ``p`` must keep within the budget: the VM's exact peak, or with
    workspaces counted its allocator bound (:func:`~.workspace.allocator_bound`)."""
    if p.workspace_fn is None:
        return predict_peak(program)
    return allocator_bound(program, p.workspace_fn(program))


__all__ = ["StepProblem", "fit_peak"]
