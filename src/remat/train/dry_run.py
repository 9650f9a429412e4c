"""Planning without running: ``remat.compile(..., dry_run=True)``.

A dry run takes a model, optimizer and inputs on the ``meta`` device (or fake tensors): nothing
of their size is allocated, and nothing is executed. It runs the compile's stages that need no
data (capture, differentiation, planning, lowering: :data:`remat.train.compilation.STAGES`) and
skips those that do (measured costs, kernel compilation, the VM, the capture cache's check), so its
plan is the plan ``remat.compile`` makes with real tensors under the static cost model, and its
predicted peak the peak the VM would measure, to the byte (``tests/train/test_dry_run.py``).

What cannot be known without running is said in the report's notes: kernel workspaces never
measured on this machine (or on another device than this CPU) count as 0 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from ..errors import BudgetTooSmall, format_bytes
from ..ir import Function, Instruction

if TYPE_CHECKING:
    from .compilation import Compilation, CompileOptions


class DryRunStep(RuntimeError):
    """A step planned by a dry run was called (or asked for what only a run gives)."""


def check_dry_run_options(o: CompileOptions) -> None:
    """ValueError for options a dry run cannot honour, saying what would."""
    if o.cost_model == "profiled":
        raise ValueError("dry_run=True runs nothing, so it cannot measure costs (cost_model='profiled'): use the "
                         "static cost model (the default), priced on a device with device=")
    if o.data_parallel is not None:
        raise ValueError("dry_run=True plans one process's step; data_parallel is not supported in a dry run")
    if o.micro_batches != 1:
        raise ValueError("dry_run=True plans the whole batch (micro_batches=1): micro-batching checks the loss's "
                         "reduction by running the model")


def _fake_cpu(t, mode):
    """A fake tensor on the CPU of ``t``'s shape, strides and dtype (no data)."""
    import torch

    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def capture_without_data(c: Compilation):
    """The capture of a dry run. A model or inputs on ``meta`` are captured as a copy whose tensors
    are fake CPU tensors (``FakeTensorMode``: no data), so that the trace takes the paths a CPU
    compile takes: CPU autocast (``precision="bf16"``) skips meta tensors, and torch.export lifts a
    constant made in the forward (T5's ``shifted[..., 0] = start_id``) on the CPU but inlines it on
    meta. Not cached (a capture cache entry keeps lifted constants, here fake). The capture's
    tensors are then the model's own again, so the binding sees the user's tensors."""
    import copy

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..frontend.torch_import import import_module

    model, example = c.model, c.capture_example
    ours = list(model.parameters()) + list(model.buffers())
    if not any(isinstance(t, torch.Tensor) and t.is_meta for t in [*ours, *example]):
        return import_module(model, c.signature.keywords(example), c.loss_fn, train=None,
                             num_targets=c.num_targets, autocast=c.options.autocast)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    twin = copy.deepcopy(model)
    made: dict[int, torch.Tensor] = {}  # tied weights stay tied
    for mod in twin.modules():
        for table, wrap in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    f = _fake_cpu(t, mode) if t.is_meta else t
                    made[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) if wrap and t.is_meta else f
                table[name] = made[id(t)]
    example = tuple(_fake_cpu(t, mode) if isinstance(t, torch.Tensor) and t.is_meta else t for t in example)
    imported = import_module(twin, c.signature.keywords(example), c.loss_fn, train=None,
                             num_targets=c.num_targets, autocast=c.options.autocast, cache=False)
    own = {"param": {f"model.{n}": p for n, p in model.named_parameters()},
           "buffer": {f"model.{n}": b for n, b in model.named_buffers()}}
    imported._tensors = [own.get(kind, {}).get(target, t) for (kind, target), t in zip(imported._state, imported._tensors)]
    return imported


def dry_workspaces(c: Compilation, fn: Function) -> dict[Instruction, int]:
    """A dry run's kernel workspaces: those measured before on this machine (the workspace cache),
    0 for the others; all 0 for a device other than this CPU (its kernels cannot be measured here)."""
    device = c.options.device_spec
    if device is not None and device.name != "cpu":
        return {}
    from ..runtime.allocator import cached_workspaces

    return cached_workspaces(fn, c.dialects)[0]


def workspace_note(c: Compilation) -> str | None:
    """What the dry run's plan assumed about kernel workspaces, when it counted them."""
    if c.budget is None or not c.options.count_workspaces:
        return None
    device = c.options.device_spec
    if device is not None and device.name != "cpu":
        return (f"kernel workspaces: {device.name}'s kernels cannot be measured here; counted as 0 bytes (keep a "
                f"margin for cuBLAS and attention workspaces)")
    from ..runtime.allocator import cached_workspaces

    _, missing = cached_workspaces(c.program, c.dialects)
    if not missing:
        return "kernel workspaces: every kernel's measured on this machine before (the workspace cache)"
    return (f"kernel workspaces: {missing} kernel(s) never measured on this machine (a dry run runs nothing): "
            "counted as 0 bytes; a compile with real tensors measures them")


@dataclass(frozen=True)
class CurvePoint:
    """One budget of a dry run's trade-off curve. Bytes and seconds; overhead a fraction (0.1 = +10%)."""

    budget: int
    fits: bool
    predicted_peak: int | None       # None when nothing fits
    predicted_overhead: float | None
    predicted_seconds: float | None  # the planned step on the cost model
    solver: str                      # or, when nothing fits, the minimum it needs


def refuse(what: str):
    """The error a step planned by a dry run raises for what only a run gives."""
    raise DryRunStep(f"this step was planned by a dry run (dry_run=True, on meta or fake tensors): it cannot "
                     f"{what}; compile the model with real tensors (the same options, dry_run=False) to train")


def curve(c: Compilation, minimum: int, budgets: Sequence[int] | None = None, n_points: int = 10) -> list[CurvePoint]:
    """The trade-off of budgets of a planned step: each budget planned as a compile at it plans
    (its algorithm choice, workspaces and, with ``max_grad_norm``, clipping strategy; nothing run),
    smallest first; by default ``n_points`` budgets from ``minimum`` to the unconstrained peak, so
    the first point is the minimum a refusal names, and it fits."""
    import numpy as np

    from ..plan.costmodel import priced_on

    if budgets is None:
        budgets = sorted({int(round(x)) for x in np.linspace(minimum, c.unconstrained_peak, n_points)})
    out = []
    with priced_on(c.options.device_spec):
        for b in sorted(int(b) for b in budgets):
            try:
                at = c.planned_at(b)
            except BudgetTooSmall as e:
                out.append(CurvePoint(b, False, None, None, None, f"needs {format_bytes(e.minimum)}"))
                continue
            solver = f"{at.plan.solver} ({at.clip_strategy})" if c.clipped else at.plan.solver
            out.append(CurvePoint(b, True, at.plan.peak, at.plan.overhead, at.predicted_seconds, solver))
    return out


def dry_report(report, c: Compilation, minimum: int):
    """``report`` (a :class:`~remat.train.report.Report`) completed for a dry run: nothing measured;
    the minimum budget, the device, the peak at the allocator's rounding and what was assumed of
    workspaces."""
    from ..plan.simulator import simulate

    device = c.options.device_spec
    note = workspace_note(c)
    return replace(report, dry_run=True, device=None if device is None else device.name, minimum_budget=minimum,
                   device_peak=simulate(c.program, granularity=1 if device is None else device.granularity).peak_bytes,
                   solver_notes=report.solver_notes + ([note] if note else []))


__all__ = ["CurvePoint", "DryRunStep", "capture_without_data", "check_dry_run_options", "curve", "dry_report",
           "dry_workspaces", "refuse"]
