"""``remat.compile`` as a flat list of named stages over one record.

A :class:`Compilation` holds everything a compile knows so far: the user's model, inputs, loss and
optimizer with the checked :class:`CompileOptions`; then the captured module, the training graph,
the planning problem, the plan, the program and the VM that runs it. Each stage is a plain
function ``Compilation -> Compilation`` that fills the fields it owns (``dataclasses.replace``);
:data:`STAGES` lists them in the order they run, and :func:`compile_step` runs them with the
runner that runs passes (:func:`remat.passes.pipeline.run_passes`: timing, ``print_after``, the
IR verified after each stage in tests)::

    capture -> layout -> bind -> training graph -> prepare -> [profile] -> plan -> lower -> fuse
            -> [compile kernels] -> prepare VM | predict

``profile`` runs with ``cost_model="profiled"`` only, ``compile kernels`` when the numba dialect is
enabled. A dry run (``dry_run=True``: meta or fake tensors, nothing executed) skips both and the
VM: its last stage, ``predict``, only predicts the program's peak (:mod:`remat.train.dry_run`). Micro-batching (``micro_batches=k``) and data parallelism (``data_parallel=``) are options
of the stages that build the step program (:meth:`Compilation.step_program`); so is clipping by the
global norm (``max_grad_norm``), whose strategy ``plan`` chooses (:func:`plan_clipping`). The result becomes a
:class:`remat.train.api.TrainStep`, the run-time object.
"""
from __future__ import annotations


import time
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any, Callable, Mapping, Sequence

from .. import backends
from .._gc import cyclic_gc_paused, cyclic_gc_relaxed
from ..budget import Budget
from ..errors import BudgetTooSmall, format_bytes
from ..ir import Function, Instruction, Module
from ..passes.pipeline import run_passes
from ..plan.algorithms import plan_choosing_algorithms
from ..plan.costmodel import CostModel, MeasuredSignatures, priced_on, program_overhead, static_costs
from ..plan.portfolio import SOLVER_OPTIONS, plan_step
from ..plan.problem import StepProblem
from ..plan.record import Plan
from ..plan.simulator import predict_peak
from ..runtime.hardware import precision_note, warn_outside_remat
from ..step.microbatch import microbatch_step
from ..step.optim import ON_NONFINITE
from ..step.program import prepare_joint, step_program, training_forward, training_graph
from .binding import Binding
from .microbatch import check_micro_batches, micro_batch_semantics, whole_batch_peak
from .report import recomputed_layers
from .signature import Signature
from .variants import lean_variants

ALGORITHM_OPTIONS = ("auto", "reference")
"""``algorithms=``: "auto" lets the planner choose memory-lean algorithms (chunked cross-entropy,
attention with dropout without its score matrix, convolutions over a concatenation without it,
batch norm backwards without ATen's unused buffer) when the reference step does not fit the budget
and they are faster or the only feasible choice; "reference" keeps every op's reference algorithm
(gradients bit-identical to the unconstrained step under any budget)."""

LAYOUT_OPTIONS = ("auto", "NCHW")
"""``layout``: "auto" computes a convolutional model channels-last (``remat.passes.layout``), "NCHW" as
captured."""


CLIP_STRATEGIES = ("keep gradients", "second backward")
"""How a step clipping by the global norm (``max_grad_norm``) gets the norm before any update: every
gradient kept until it is known, or a norm pass first, the gradients recomputed by a second backward
(:func:`plan_clipping` chooses, unless the ``clip_strategy`` option names one; ``Report.clip_strategy``
says which)."""


PRECISIONS = ("fp32", "bf16", "fp16")
"""``precision=``: "fp32" computes in the parameters' dtype; "bf16" captures the forward and the loss
under ``torch.autocast`` in bfloat16 (matmuls, convolutions and attention in bf16, reductions, norms
and losses in fp32, as torch.autocast's op lists decide; parameters stay fp32 master weights and the
casts are instructions the planner sees). "fp16": the same in float16, with dynamic loss scaling as
``torch.amp.GradScaler`` does it (:mod:`remat.passes.loss_scale`; fused optimizer mode only)."""

_AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class CompileOptions:
    """The options of ``remat.compile`` (documented there), checked before the seconds-long capture."""

    num_targets: int | None = None
    solver: str = "auto"
    dialects: Sequence[str] | None = None
    seed: int | None = None
    keep_grads: bool | None = None
    profile_repeats: int = 2
    cost_model: str = "static"
    milp_time_limit: float = 10.0
    progress: Callable[[str], None] | None = None
    print_after: str | Sequence[str] | None = None
    data_parallel: str | None = None
    bucket_bytes: int | None = None
    count_workspaces: bool = True
    measure_allocator: bool = True
    algorithms: str = "auto"
    micro_batches: int | str = 1
    loss_reduction: str | None = None
    layout: str = "auto"
    max_grad_norm: float | None = None
    clip_strategy: str = "auto"   # "auto" or one of CLIP_STRATEGIES (plan_clipping)
    on_nonfinite: str | None = "skip"
    check_gradients: bool | None = None
    atomic: bool = False
    precision: str = "fp32"
    dry_run: bool = False         # plan without running anything (remat.train.dry_run)
    device: Any = None            # a device name, DeviceSpec or dict: the cost model prices it (remat.plan.device)
    full_batch_peak: int | None = None  # the whole batch's unconstrained peak, when known (micro-batching)

    @staticmethod
    def of(options: Mapping[str, Any]) -> "CompileOptions":
        """The options named in ``options``; a TypeError naming unknown ones and the valid ones."""
        valid = [f.name for f in fields(CompileOptions) if f.name != "full_batch_peak"]
        unknown = sorted(set(options) - set(valid) - {"full_batch_peak"})
        if unknown:
            raise TypeError(f"remat.compile: unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
        return CompileOptions(**options)

    def check(self) -> None:
        """ValueError naming the first invalid option and what would be valid."""
        if self.cost_model not in ("static", "profiled"):
            raise ValueError(f"cost_model must be 'static' (deterministic estimates) or 'profiled' (measured), "
                             f"got {self.cost_model!r}")
        if self.algorithms not in ALGORITHM_OPTIONS:
            raise ValueError(f"algorithms must be one of {', '.join(map(repr, ALGORITHM_OPTIONS))}, "
                             f"got {self.algorithms!r}")
        if self.layout not in LAYOUT_OPTIONS:
            raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUT_OPTIONS))}, got {self.layout!r}")
        if self.solver not in SOLVER_OPTIONS:
            raise ValueError(f"unknown solver {self.solver!r}; valid: {', '.join(SOLVER_OPTIONS)}")
        if self.max_grad_norm is not None and not (isinstance(self.max_grad_norm, (int, float))
                                                   and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number (or None), got {self.max_grad_norm!r}")
        if self.clip_strategy not in ("auto",) + CLIP_STRATEGIES:
            raise ValueError(f"clip_strategy must be 'auto' (the planner chooses) or one of "
                             f"{', '.join(map(repr, CLIP_STRATEGIES))}, got {self.clip_strategy!r}")
        if self.clip_strategy != "auto" and self.max_grad_norm is None:
            raise ValueError(f"clip_strategy={self.clip_strategy!r} says how max_grad_norm clips; give max_grad_norm too")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be 'skip' (skip a step whose loss or a gradient is not finite, the default), "
                             f"'raise' (raise instead) or None (no guard), got {self.on_nonfinite!r}")
        if self.check_gradients not in (None, True, False):
            raise ValueError(f"check_gradients must be None (the gradients too where they are all kept anyway), True "
                             f"or False, got {self.check_gradients!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {self.precision!r}")
        self.device_spec  # noqa: B018  a ValueError naming the valid devices
        if self.dry_run:
            from .dry_run import check_dry_run_options

            check_dry_run_options(self)
        unknown = self.shown - set(STAGE_NAMES)
        if unknown:
            raise ValueError(f"print_after: unknown stage(s) {sorted(unknown)}; stages: {', '.join(STAGE_NAMES)}")

    @property
    def autocast(self):
        """The torch dtype the capture runs ``torch.autocast`` in (``precision``), None for fp32."""
        import torch

        name = _AUTOCAST.get(self.precision)
        return None if name is None else getattr(torch, name)

    @property
    def device_spec(self):
        """The :class:`remat.plan.device.DeviceSpec` the ``device`` option names, or None."""
        from ..plan.device import device_spec

        return device_spec(self.device)

    @property
    def shown(self) -> set[str]:
        """The stages whose IR ``print_after`` asks to print."""
        return {self.print_after} if isinstance(self.print_after, str) else set(self.print_after or ())


@dataclass(frozen=True)
class Compilation:
    """What a compile knows after each stage (fields in the order the stages fill them). Bytes, seconds."""

    # ---- given (before the first stage)
    model: Any
    optimizer: Any
    loss_fn: Callable | None
    options: CompileOptions
    budget_spec: Budget | None    # the budget as given; ``budget`` resolves it (``prepare``)
    signature: Signature          # the example's tensors, their keywords and compiled keyword options
    dp: Any                       # remat.distributed's setup, None in one process
    keep_grads: bool
    num_targets: int | None
    micro_batches: int            # k > 1: the batch runs as k micro-batches (remat.step.microbatch)
    capture_example: tuple        # what is captured: the example, or its first micro-batch
    started: float                # time.perf_counter() when the compile started
    placement: Any = None         # the torch.device the step runs on (its model's), None: the CPU
    precision_note: str | None = None  # its processor lacks native bf16/fp16 (remat.runtime.hardware)
    # ---- capture, layout
    imported: Any = None          # remat.frontend.torch_import.ImportedModel (after ``layout``: its layout)
    channels_last: bool = False   # ``layout`` made the convolutions NHWC
    # ---- bind
    binding: Binding | None = None
    loss_reduction: str | None = None  # micro-batching's "mean" or "sum"
    # ---- training graph
    forward: Function | None = None    # the forward every planner differentiates (training_forward)
    graph: Module | None = None        # forward + loss + backward
    # ---- prepare, profile
    joint: Function | None = None      # the training joint, prepared for the chosen dialects
    unconstrained: Function | None = None  # the step program without recomputation
    unconstrained_peak: int = 0        # of the whole batch (also when micro-batched)
    budget: int | None = None
    costs: dict | None = None          # per-instruction seconds of the joint (static or measured)
    unconstrained_step_seconds: float | None = None  # measured ("profiled" only)
    unconstrained_program: Function | None = None    # the unconstrained step as it runs, fused ("profiled" only)
    measured: MeasuredSignatures | None = None       # measured seconds by signature ("profiled" only)
    # ---- plan
    problem: StepProblem | None = None
    plan: Plan | None = None
    workspace_bytes: int = 0                       # the largest kernel workspace (budgeted steps)
    predicted_allocator_peak: int | None = None    # VM high-water marks + kernel workspaces
    predicted_seconds: float = 0.0                 # the cost model's seconds for the planned step (every micro-batch;
                                                   # "profiled": the program as it runs, after ``fuse``)
    unconstrained_predicted_seconds: float = 0.0   # and for the unconstrained step (the reference algorithms')
    # ---- lower, fuse
    program: Function | None = None
    instructions: int = 0                          # of the lowered program (control flow not counted)
    recomputed: int = 0                            # instructions it has beyond the unconstrained step
    recomputed_layers: dict[str, int] = field(default_factory=dict)
    recomputes: bool = False                       # the program is not the unconstrained step's
    notes: tuple[str, ...] = ()                    # the plan's notes, and the later stages'
    clip_strategy: str | None = None               # max_grad_norm: one of CLIP_STRATEGIES (``plan`` chooses)
    # ---- prepare VM
    vm: Any = None
    kinds: Any = None                              # the kind of every program value (parameters, ...)
    predicted_peak: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def dialects(self) -> tuple[str, ...] | None:
        if self.placement is not None:  # off the CPU: the torch dialect alone (checked by ``start``)
            return ("torch",)
        return tuple(self.options.dialects) if self.options.dialects else None

    @property
    def ir(self) -> Module | None:
        """The newest IR: the program, the plan's program, the joint, the training graph or the capture."""
        for fn in (self.program, self.plan.program if self.plan is not None else None, self.joint):
            if fn is not None:
                return Module([fn])
        if self.graph is not None:
            return self.graph
        return None if self.imported is None else self.imported.module

    @property
    def guard(self) -> str | None:
        """What the non-finite guard (``on_nonfinite``; its flag is the program's last result)
        checks before any update: "loss" (the loss, known before the first gradient: no update
        waits), "all" (the loss and every gradient: every update waits for the last gradient; the
        choice where the gradients are all kept anyway, with ``max_grad_norm`` or micro-batches, or
        asked with ``check_gradients=True``) or None (no update, or ``on_nonfinite=None``)."""
        o = self.options
        if self.binding.updates and self.binding.loss_scaled:  # an overflowed gradient must skip the update
            return "all"
        if not self.binding.updates or o.on_nonfinite is None or (self.keep_grads and self.micro_batches > 1):
            return None
        every = o.check_gradients
        if every is None:
            every = o.max_grad_norm is not None or self.micro_batches > 1 or self.keep_grads
        return "all" if every else "loss"

    @property
    def clipped(self) -> bool:
        """The step clips its gradients by their global norm inside the fused update (``max_grad_norm``)."""
        return bool(self.binding.updates) and self.options.max_grad_norm is not None

    def planned_at(self, budget: int) -> "Compilation":
        """This compile's ``plan`` stage at another budget (with ``max_grad_norm``, the clipping
        strategy chosen for it: :func:`plan_clipping`); BudgetTooSmall when nothing fits."""
        return plan(replace(self, budget=budget))

    @property
    def guarded(self) -> bool:
        """The step has a non-finite guard (:attr:`guard`)."""
        return self.guard is not None

    def step_program(self, joint: Function, check: bool, take_joint: bool = False) -> Function:
        """The step program of a joint: one process (micro-batched or not), or this rank's
        (``remat.distributed.passes``). ``take_joint``: ``joint`` is a planner's candidate, built
        for this and dropped after, whose instructions a single process's program may take over
        (:func:`~remat.step.program.step_program`)."""
        b = self.binding
        guard = self.guard
        if self.micro_batches > 1:
            return microbatch_step(joint, b.layout, b.updates, b.state_types, self.keep_grads, self.micro_batches,
                                   self.loss_reduction, check=check, guard=guard)
        if self.dp is None:
            return step_program(joint, b.layout, b.updates, b.state_types, self.keep_grads, check=check,
                                max_grad_norm=self.options.max_grad_norm, guard=guard, loss_scaled=b.loss_scaled,
                                atomic=self.options.atomic, norm_pass=self.clip_strategy == CLIP_STRATEGIES[1],
                                take_joint=take_joint)
        from ..distributed.passes import data_parallel_step

        return data_parallel_step(joint, b.layout, b.updates, b.state_types, self.dp, check=check, guard=guard)

    def workspaces(self, fn: Function) -> dict[Instruction, int]:
        """Kernels' own bytes per instruction of ``fn`` (measured once per kernel and shape, cached;
        a dry run measures nothing: :func:`remat.train.dry_run.dry_workspaces`)."""
        from ..runtime.allocator import workspaces

        if self.options.dry_run:
            from .dry_run import dry_workspaces

            return dry_workspaces(self, fn)

        return workspaces(fn, self.dialects, self.placement)

    def measured_costs(self, joint: Function) -> dict[Instruction, float]:
        """Measured per-instruction seconds of a joint (on copies of the example's arguments), also
        recorded by signature in :attr:`measured` (a lean variant's joint's, for the cost models of
        the whole compile)."""
        from ..runtime.vm import VM

        costs = _fastest_instr_costs(VM(Module([joint]), dialects=self.dialects, device=self.placement), joint,
                                    self.binding.joint_args(self.capture_example, copy=True),
                                    self.options.profile_repeats)[0]
        if self.measured is not None:
            self.measured.record(costs)
        return costs

    @property
    def runs_unconstrained(self) -> bool:
        """The step runs the unconstrained step's program: nothing recomputed, the reference algorithms."""
        return not self.recomputes and self.plan.unconstrained is None

    def predicted_recompute(self) -> tuple[float, float]:
        """The planned step's predicted seconds beyond the unconstrained step's (recomputation, and a
        lean algorithm's own cost; never below 0, and 0 when it runs the unconstrained step's program),
        and that over the unconstrained step's predicted seconds: the overhead, as the measured one is
        (:class:`~remat.train.report.Report`)."""
        if self.runs_unconstrained or self.unconstrained_predicted_seconds <= 0:
            return 0.0, 0.0
        extra = max(0.0, self.predicted_seconds - self.unconstrained_predicted_seconds)
        return extra, extra / self.unconstrained_predicted_seconds

    def cost_model(self) -> CostModel:
        """The cost model of this compile's programs: the joint's costs, and with ``cost_model="profiled"``
        every other instruction measured (:class:`~remat.plan.costmodel.MeasuredSignatures`)."""
        return CostModel(self.costs, self.measured)


# ---------------------------------------------------------------------------------------------- stages
def capture(c: Compilation) -> Compilation:
    """The model (with its loss) captured by torch.export and translated to IR (``remat.frontend``)."""
    from ..frontend.torch_import import import_module
    from .against import refuse_backward_hooks

    refuse_backward_hooks(c.model)
    if c.options.dry_run:
        from .dry_run import capture_without_data

        return replace(c, imported=capture_without_data(c))
    return replace(c, imported=import_module(c.model, c.signature.keywords(c.capture_example), c.loss_fn,
                                             train=None, num_targets=c.num_targets,
                                             autocast=c.options.autocast))


def layout(c: Compilation) -> Compilation:
    """The forward in the layout the ``layout`` option asks for (``remat.passes.layout``); every path
    that differentiates the step starts from it, so all plans share it."""
    from ..passes.layout import with_layout

    imported = with_layout(c.imported, c.options.layout)
    return replace(c, imported=imported, channels_last=imported is not c.imported)


def scale_loss(c: Compilation) -> Compilation:
    """fp16: the loss scale as the forward's last input, multiplying the loss it returns
    (:mod:`remat.passes.loss_scale`); the step program unscales the gradients."""
    from ..passes.loss_scale import with_loss_scale

    return replace(c, imported=with_loss_scale(c.imported))


def bind(c: Compilation) -> Compilation:
    """The model's parameters, buffers and optimizer state bound to the program's arguments; with
    micro-batches, the loss's reduction (micro-batching refuses steps it would change)."""
    binding = Binding(c.model, c.optimizer, c.imported, c.dp, c.options.seed,
                      loss_scaled=c.options.precision == "fp16", atomic=c.options.atomic)
    c = replace(c, binding=binding)
    if c.micro_batches > 1:
        c = replace(c, loss_reduction=micro_batch_semantics(c, c.options.loss_reduction))
    return c


def differentiate(c: Compilation) -> Compilation:
    """The training graph: forward + loss + backward (``remat.step.program``), from the forward
    every planner differentiates (the whole step's and the chain planner's blocks)."""
    forward = training_forward(c.imported.function)
    return replace(c, forward=forward, graph=training_graph(forward, len(c.imported.param_names)))


def prepare(c: Compilation) -> Compilation:
    """The joint as it will run (training batch norms split into statistics and element-wise
    normalisation, composites no chosen dialect has a kernel for expanded: ``prepare_joint``), the
    unconstrained step program, its peak (the whole batch's, also when micro-batched: the reference
    of relative budgets), the budget in bytes, and static per-instruction costs (``profile`` measures them instead)."""
    joint = prepare_joint(c.graph, c.dialects)
    unconstrained = c.step_program(joint, check=True)
    peak = predict_peak(unconstrained)
    if c.micro_batches > 1:
        peak = c.options.full_batch_peak if c.options.full_batch_peak is not None else whole_batch_peak(c)
    budget = None if c.budget_spec is None else c.budget_spec.resolve(peak)
    return replace(c, joint=joint, unconstrained=unconstrained, unconstrained_peak=peak, budget=budget,
                   costs=None if _profiled(c) else static_costs(joint))  # measured by ``profile`` instead


def profile(c: Compilation) -> Compilation:
    """Measured seconds: each instruction of the joint (on copies of the example), and the
    unconstrained step program as an unconstrained compile runs it (fused: :func:`fused_program`),
    each of its instructions (the updates, fused kernels) and its fastest run as steps run (recording
    the peak only); an instruction of both, the faster of its two times. All are recorded by
    signature in the compile's :class:`~remat.plan.costmodel.MeasuredSignatures` (with the VM's
    dispatch per instruction), which measures any other instruction a cost model prices (a lean
    algorithm's, a fused kernel of a plan) alone, once per signature
    (:func:`remat.runtime.kernel_timing.kernel_seconds`)."""
    from ..runtime.kernel_timing import kernel_seconds
    from ..runtime.vm import VM

    c = replace(c, measured=MeasuredSignatures(partial(kernel_seconds, dialects=c.dialects, device=c.placement)))
    costs = c.measured_costs(c.joint)
    program = fused_program(c.unconstrained, _numba(c))
    if _kernels(c):
        from ..backends import numba_kernels

        numba_kernels.prepare(Module([program]))
    vm = VM(Module([program]), dialects=c.dialects, device=c.placement)
    args = c.binding.step_args(c.signature.example, copy=True, step=2)
    step_costs, timed = _fastest_instr_costs(vm, program, args, c.options.profile_repeats)
    # The step's time as steps run, recording the peak only (timing each instruction costs ~1 µs
    # more); the fastest of all runs, so that a burst of load in the few runs taken is not its time.
    seconds = min([timed] + [vm.run(program.name, *args, record="peak")[1].total_seconds
                             for _ in range(c.options.profile_repeats)])
    c.measured.record(step_costs)
    c.measured.set_dispatch(program, step_costs, seconds)
    # The joint's instructions run in the step too: each priced by the faster of its two measurements
    # (the joint's first runs in a process pay for fresh memory; ResNet's batch_norm_grad 1.9 ms there, 1.2 ms in the step).
    return replace(c, costs=c.measured.fastest(costs), unconstrained_step_seconds=seconds, unconstrained_program=program)


def plan(c: Compilation) -> Compilation:
    """The cheapest plan whose peak fits the budget (``remat.plan``): with workspaces counted
    (the default), PyTorch's allocator peak, not only the VM's exact count of IR values. Each
    kernel's workspace is measured once per kernel and shape (``runtime.allocator``, cached on
    disk) and enters the solvers as the node's workspace; a plan fits when its allocator bound (the
    VM's high-water mark at each instruction plus that kernel's workspace) is within the budget.
    With ``max_grad_norm``, the clipping strategy too (:func:`plan_clipping`).
    Raises ``BudgetTooSmall`` with the minimum feasible budget and the unconstrained peak."""
    if c.clipped:
        return plan_clipping(c)
    return _plan(c)


def plan_clipping(c: Compilation) -> Compilation:
    """``max_grad_norm``: the norm needs every gradient before any update, so two strategies
    (:data:`CLIP_STRATEGIES`): keep every gradient until the norm is known (the step program's
    updates all follow the last gradient), or a second backward (``step_program(norm_pass=True)``:
    a norm pass that drops each gradient once its squares are summed, then the fused step, each
    update right after its gradient: no gradient is kept, at the price of a forward and backward
    more). Without a budget the first (no recomputation); under one, each strategy is planned and the
    one that fits with the lower predicted step time wins (the second is not planned when the
    first fits at a predicted time below the second's unconstrained step). Neither fitting:
    ``BudgetTooSmall`` with the smaller of their minimums. The report's notes say which and what
    it cost. The ``clip_strategy`` option may name one: then only that one is planned."""
    KEEP, SECOND = CLIP_STRATEGIES
    keep, two = replace(c, clip_strategy=KEEP), replace(c, clip_strategy=SECOND)
    forced = c.options.clip_strategy
    grad_bytes = sum(v.type.nbytes for v in c.joint.entry.instrs[-1].operands[c.binding.layout.first_grad:])
    mn = c.options.max_grad_norm
    asked = f"as asked (clip_strategy={forced!r})"

    def keeping(chosen: Compilation, why: str) -> Compilation:
        return replace(chosen, notes=chosen.notes + (
            f"gradient clipping (max_grad_norm={mn:g}): every gradient ({format_bytes(grad_bytes)}) is kept until "
            f"their global norm is known, then each update runs; {why}",))

    if forced == KEEP or (forced == "auto" and c.budget is None):
        return keeping(_plan(keep), asked if forced == KEEP else
                       "no budget: a second backward (recomputing them) is not considered")
    cost = c.cost_model()
    planned: dict[str, Compilation] = {}
    refused: dict[str, BudgetTooSmall] = {}

    def attempt(cs: Compilation) -> None:
        try:
            planned[cs.clip_strategy] = _plan(cs)
        except BudgetTooSmall as e:
            refused[cs.clip_strategy] = e

    if forced == "auto":
        attempt(keep)
    two_floor = cost.program_cost(two.step_program(c.joint, check=False))  # no plan of it runs faster
    if KEEP not in planned or planned[KEEP].predicted_seconds > two_floor:
        attempt(two)
    if not planned:
        if forced == SECOND:
            raise refused[SECOND]
        least = min(refused.values(), key=lambda e: e.minimum)
        raise BudgetTooSmall(c.budget, least.minimum, "this training step, keeping the gradients for clipping or "
                             "recomputing them in a second backward",
                             detail=f"clipping by the global norm (max_grad_norm={mn:g}) keeping every gradient needs "
                             f"at least {format_bytes(refused[KEEP].minimum)}, with a second backward at least "
                             f"{format_bytes(refused[SECOND].minimum)}",
                             unconstrained_peak=c.unconstrained_peak) from least
    chosen = min(planned.values(), key=lambda x: x.predicted_seconds)  # a tie: keeping them (planned first)
    if chosen.clip_strategy == KEEP:
        other = planned.get(SECOND)
        why = (f"a second backward needs at least {format_bytes(refused[SECOND].minimum)}" if SECOND in refused else
               "a second backward was not planned: keeping them is predicted faster than even its unconstrained "
               f"step ({two_floor * 1e3:.2f} ms)" if other is None else
               f"a second backward fits too (peak {format_bytes(other.plan.peak)}) but is predicted slower: "
               f"{other.predicted_seconds * 1e3:.2f} ms a step against {chosen.predicted_seconds * 1e3:.2f} ms")
        return keeping(chosen, why)
    base = cost.program_cost(c.unconstrained)
    overhead = program_overhead(cost, chosen.plan.program, base)
    other = planned.get(KEEP)
    why = (asked if forced == SECOND else
           f"keeping every gradient needs at least {format_bytes(refused[KEEP].minimum)}, over the budget"
           if other is None else
           f"keeping every gradient fits too but is predicted slower: {other.predicted_seconds * 1e3:.2f} ms a step "
           f"against {chosen.predicted_seconds * 1e3:.2f} ms")
    note = (f"gradient clipping (max_grad_norm={mn:g}) by a second backward: a norm pass runs the forward and backward, "
            f"summing each gradient's squares as it is produced and dropping it, then the step runs them again, "
            f"updating each parameter right after its gradient, scaled by the clip coefficient; no gradient is kept "
            f"({format_bytes(grad_bytes)} in all), at a predicted {overhead:+.1%} over the step without recomputation "
            f"({chosen.predicted_seconds * 1e3:.2f} ms against {base * 1e3:.2f} ms a step); {why}")
    return replace(chosen, plan=replace(chosen.plan, overhead=overhead), notes=chosen.notes + (note,))


def _plan(c: Compilation) -> Compilation:
    """The plan of ``c``'s step (its clipping strategy chosen: :attr:`Compilation.clip_strategy`)."""
    from ..plan.workspace import allocator_bound, workspace_margin

    o = c.options
    problem = _problem(c)
    counted = c.budget is not None and o.count_workspaces
    margin = bound = None
    if counted:
        problem = _counting_workspaces(c, problem)
    try:
        chosen = _plan_on_ranks(c, problem)
    except BudgetTooSmall as e:
        e.unconstrained_peak = c.unconstrained_peak  # of the whole batch: resolves relative budgets
        raise
    if counted:  # the step's own kernels (a lean algorithm's, not the unconstrained step's)
        ws = c.workspaces(chosen.program)
        bound, margin = allocator_bound(chosen.program, ws), workspace_margin(chosen.program, ws)
    cost = c.cost_model()
    notes = tuple(chosen.notes)
    grad_bytes = sum(v.type.nbytes for v in c.joint.entry.instrs[-1].operands[c.binding.layout.first_grad:])
    if c.guard == "all" and not c.keep_grads and not c.clipped and c.micro_batches == 1:
        notes += (f"non-finite guard (on_nonfinite={o.on_nonfinite!r}, check_gradients=True): every gradient "
                  f"({format_bytes(grad_bytes)}) is kept until the loss and all gradients are known finite, then "
                  f"each update runs (a step with a NaN or infinity changes nothing); check_gradients=None checks "
                  f"the loss only and updates each parameter right after its gradient",)
    # The problem is kept so that other budgets can be planned on the same capture (remat.train.curve).
    return replace(c, problem=problem, plan=chosen, workspace_bytes=margin or 0, predicted_allocator_peak=bound,
                   predicted_seconds=cost.program_cost(chosen.program),
                   unconstrained_predicted_seconds=cost.program_cost(c.unconstrained), notes=notes)


def _problem(c: Compilation) -> StepProblem:
    """The planning problem of ``c``'s step: its joint, its step program (``finish``) and, where
    each gradient's update follows it, the gradients the step consumes as soon as they exist."""
    o = c.options
    unconstrained = c.unconstrained
    if c.clip_strategy == CLIP_STRATEGIES[1]:
        unconstrained = c.step_program(c.joint, check=True)
    problem = StepProblem(c.forward, c.imported.state_count, len(c.imported.param_names), c.joint, unconstrained,
                          c.budget, partial(c.step_program, check=False, take_joint=True), c.binding.extra_bytes(),
                          c.costs, o.solver,
                          o.milp_time_limit,
                          c.binding.joint_args(c.capture_example, copy=True) if o.cost_model == "profiled" else None,
                          c.dialects, measured=c.measured)
    kept = c.clip_strategy != CLIP_STRATEGIES[1] and (c.clipped or c.guard == "all")  # until the norm or the flag
    if c.binding.updates and not c.keep_grads and c.dp is None and c.micro_batches == 1 and not kept:
        g0 = c.binding.layout.first_grad  # each gradient's update follows it (step.program.update_points)
        problem = replace(problem, consumed=tuple(range(g0, g0 + c.binding.layout.n_params)))
    return problem


def _plan_on_ranks(c: Compilation, problem: StepProblem) -> Plan:
    """The plan; under ``data_parallel="ddp"`` made on rank 0 only, every rank receiving it
    (``remat.distributed.group.plan_on_rank0``), so that all ranks run the same program. ZeRO's
    step programs differ between ranks (each slices its own shards), so there every rank plans on
    its own and ``check_same_collectives`` compares what they issue."""
    if c.options.algorithms == "reference":
        run = partial(plan_step, problem)
    else:
        run = partial(plan_choosing_algorithms, problem, lean_variants(c))
    if c.dp is None or c.dp.shards_state:
        return run()
    from ..distributed.group import plan_on_rank0

    return plan_on_rank0(run, c.dp, problem.budget)


def minimum_budget(c: Compilation) -> int:
    """The smallest budget (bytes) a plan of the compiled step fits: the bounded search a refusal
    (``BudgetTooSmall.minimum``) reports, over every solver and algorithm choice (and with
    ``max_grad_norm`` both clipping strategies), priced as the compile was."""
    if c.clipped:
        return min(clip_minimums(c).values())
    return _minimum(c, _counting_workspaces(c, c.problem))


def _counting_workspaces(c: Compilation, problem: StepProblem) -> StepProblem:
    """``problem`` as a budgeted compile plans it: with ``count_workspaces``, kernels' workspaces
    counted (a step compiled without a budget planned without them, and its minimum must be one
    that a compile at that budget accepts)."""
    if not c.options.count_workspaces or problem.workspace_fn is not None:
        return problem
    return replace(problem, workspaces=c.workspaces(problem.joint), workspace_fn=c.workspaces)


def clip_minimums(c: Compilation) -> dict[str, int]:
    """``max_grad_norm``: the minimum budget (bytes) of each clipping strategy (:data:`CLIP_STRATEGIES`;
    the one the ``clip_strategy`` option names) of the compiled step, as :func:`minimum_budget` finds it."""
    out = {}
    for s in CLIP_STRATEGIES if c.options.clip_strategy == "auto" else (c.options.clip_strategy,):
        cs = replace(c, clip_strategy=s)
        out[s] = _minimum(cs, _counting_workspaces(cs, _problem(cs)))
    return out


def _minimum(c: Compilation, problem: StepProblem) -> int:
    try:
        with priced_on(c.options.device_spec):
            _plan_on_ranks(c, replace(problem, budget=1))
    except BudgetTooSmall as e:
        return int(e.minimum)
    return 1


def lower(c: Compilation) -> Compilation:
    """The plan's step program (rematerialised, its updates and frees placed), its small
    recomputations read from their first runs where the budget has room (:mod:`remat.lower.small_values`;
    with workspaces counted, a drop whose span holds an allocator high-water mark above the budget is
    undone), and what it recomputes: counted here, since fusion merges instructions but recomputes
    nothing. The predicted seconds stay the plan's (the planners compare plans before this rewrite,
    which only removes work: a larger budget's prediction is never above a smaller one's)."""
    from ..lower.small_values import reuse_small

    program = c.plan.program
    unconstrained = c.plan.unconstrained or c.unconstrained  # a lean algorithm won: against its own step
    if program is not unconstrained:
        program = reuse_small(program, _budget_judge(c), c.budget)
    n = _count(program)
    return replace(c, program=program, instructions=n, recomputed=_count(program, views=False) - _count(unconstrained, views=False),
                   recomputed_layers=recomputed_layers(program), recomputes=program is not unconstrained)


def fuse(c: Compilation) -> Compilation:
    """Recomputed batch norm outputs normalised from the saved statistics on the CPU
    (:mod:`remat.lower.bn_recompute`), sibling convolution gradients as one call
    (:mod:`remat.lower.siblings`) and, with the numba dialect, element-wise DAGs as fused kernels
    (:mod:`remat.lower.fuse`): :func:`fused_program`. None raises the VM's peak above the budget (the
    first may keep a few per-channel statistics alive longer; the others never raise it), but they
    move high-water marks; with workspaces counted, a rewrite whose span holds an allocator high-water
    mark above the budget is undone (the others are kept), and the fused program is kept only if its
    allocator bound stays within the budget (else the planned program runs unfused). The rewritten,
    merged and fused kernels are bit-identical to the ops they replace, so the plan's promises carry
    over. With ``cost_model="profiled"`` the predicted seconds are the programs' as they run: this
    one, and the unconstrained step's as ``profile`` fused it."""
    from ..plan.workspace import allocator_bound

    counted = c.budget is not None and c.options.count_workspaces
    judge = _budget_judge(c)
    cpu_dialects = None if c.placement is not None else backends.resolve(c.dialects)
    fused = fused_program(c.program, _numba(c), judge, cpu_dialects, c.budget)
    if counted:
        bound = allocator_bound(fused, c.workspaces(fused))
        if bound > c.budget >= (c.predicted_allocator_peak or 0):
            return _priced_as_run(replace(c, notes=c.notes + (f"fusion left out: the fused program's allocator bound "
                                                              f"{format_bytes(bound)} exceeds the budget",)))
        c = replace(c, predicted_allocator_peak=bound)
    return _priced_as_run(replace(c, program=fused))


def fused_program(program: Function, numba: bool, judge: Callable | None = None,
                  cpu_dialects: Sequence[str] | None = None, budget: int | None = None) -> Function:
    """``program`` with its recomputed batch norm outputs normalised from the saved statistics when it
    runs on the CPU with ``cpu_dialects`` (:mod:`remat.lower.bn_recompute`; its peak within ``budget``),
    sibling convolution gradients merged into one call and, with ``numba``, element-wise DAGs fused
    into generated kernels; ``judge`` (an excess of a rewritten program, None for none) undoes
    rewrites breaking the budget (:func:`fuse`)."""
    from ..lower.bn_recompute import recompute_from_stats
    from ..lower.fuse import fuse_function
    from ..lower.siblings import merge_conv_grads

    if cpu_dialects is not None:
        program = recompute_from_stats(program, cpu_dialects, judge, budget)
    fused = merge_conv_grads(program, judge)
    return fuse_function(fused, judge=judge) if numba else fused


def _priced_as_run(c: Compilation) -> Compilation:
    """With ``cost_model="profiled"``, the predicted seconds of the step and of the unconstrained step
    priced on the programs that run (fused; the unconstrained one measured by ``profile``); the
    static cost model keeps the plan's."""
    if c.unconstrained_program is None:
        return c
    cost = c.cost_model()
    return replace(c, predicted_seconds=cost.program_cost(c.program),
                   unconstrained_predicted_seconds=cost.program_cost(c.unconstrained_program))


def _excess(workspaces: Callable, budget: int, excess: Callable, out: Function) -> int | None:
    return excess(out, workspaces(out), budget)


def _budget_judge(c: Compilation) -> Callable | None:
    """With workspaces counted and the plan's allocator bound within the budget, the judge that undoes
    a lowering rewrite whose program's allocator bound breaks the budget (None: no such judge)."""
    from ..plan.workspace import allocator_excess

    if c.budget is None or not c.options.count_workspaces or (c.predicted_allocator_peak or 0) > c.budget:
        return None
    return partial(_excess, c.workspaces, c.budget, allocator_excess)


def compile_kernels(c: Compilation) -> Compilation:
    """The numba dialect's kernels of the program, compiled (cached on disk: a second compile of the
    same model compiles nothing)."""
    from ..backends import numba_kernels

    numba_kernels.prepare(Module([c.program]))
    return c


def prepare_vm(c: Compilation) -> Compilation:
    """The program's exact predicted peak, the VM that runs it, and the kind of each of its values
    (parameters, gradients, optimizer state, ...) for the report's split of the peak."""
    from ..runtime.vm import VM

    if c.dp is not None:
        from ..distributed.group import check_same_collectives

        check_same_collectives(c.program, c.dp)
    vm = VM(Module([c.program]), dialects=c.dialects, device=c.placement)
    value_kinds = _value_kinds(c)
    vm.set_kinds(c.program, value_kinds)
    return replace(c, vm=vm, kinds=value_kinds, predicted_peak=predict_peak(c.program))


def predict(c: Compilation) -> Compilation:
    """A dry run's last stage: the program's exact predicted peak and the kind of each of its values,
    without a VM (nothing will run)."""
    return replace(c, kinds=_value_kinds(c), predicted_peak=predict_peak(c.program))


def _value_kinds(c: Compilation) -> dict:
    """The kind of every value of the program (parameters, gradients, optimizer state, ...)."""
    from ..distributed.memory import kinds

    b = c.binding
    n_state = sum(len(ts) for ts in b.state_types) if b.updates else 0
    first = b.layout.n_args
    n_params = b.layout.n_params + len(c.imported.frozen_names)  # frozen ones are parameters too
    return kinds(c.program, n_params, range(first, first + n_state))


@dataclass(frozen=True)
class Stage:
    """One stage of ``remat.compile``: its name, its function, whether it runs for a compilation
    (``when``), and whether Python's cyclic garbage collector is paused while it builds the
    program's many long-lived objects (:mod:`remat._gc`) or relaxed (``capture`` pauses it around its
    own translation only, not around torch.export; ``plan`` builds and drops many candidate
    programs)."""

    name: str
    run: Callable[[Compilation], Compilation]
    gc_paused: bool = True
    when: Callable[[Compilation], bool] | None = None


def _profiled(c: Compilation) -> bool:
    return c.options.cost_model == "profiled"


def _fp16(c: Compilation) -> bool:
    return c.options.precision == "fp16"


def _numba(c: Compilation) -> bool:
    return "numba" in backends.resolve(c.dialects)


def _kernels(c: Compilation) -> bool:
    return _numba(c) and not c.options.dry_run


def _runs(c: Compilation) -> bool:
    return not c.options.dry_run


def _dry(c: Compilation) -> bool:
    return c.options.dry_run


STAGES: list[Stage] = [
    Stage("capture", capture, gc_paused=False),
    Stage("layout", layout),
    Stage("scale loss", scale_loss, when=_fp16),
    Stage("bind", bind, gc_paused=False),
    Stage("training graph", differentiate),
    Stage("prepare", prepare),
    Stage("profile", profile, gc_paused=False, when=_profiled),
    Stage("plan", plan, gc_paused=False),
    Stage("lower", lower),
    Stage("fuse", fuse),
    Stage("compile kernels", compile_kernels, when=_kernels),
    Stage("prepare VM", prepare_vm, when=_runs),
    Stage("predict", predict, when=_dry),
]
"""The stages of ``remat.compile``, in the order they run."""

STAGE_NAMES = tuple(s.name for s in STAGES)


def start(model, example_inputs: Sequence | Mapping, loss_fn: Callable | None, optimizer, budget,
          options: CompileOptions) -> Compilation:
    """The record before the first stage: options checked (before the seconds-long capture), the
    example's keyword inputs made positional, the data-parallel group set up."""
    from ..distributed import setup  # imported on use (torch.distributed)
    from ..frontend.torch_import import keyword_inputs, keyword_options

    started = time.perf_counter()
    spec = None if budget is None else Budget.of(budget)
    options.check()
    if spec is None and options.device_spec is not None:  # a named device: its memory is the budget
        spec = Budget(nbytes=options.device_spec.memory_bytes)
    elif spec is not None and spec.nbytes is not None and options.device_spec is not None \
            and spec.nbytes > options.device_spec.memory_bytes:
        d = options.device_spec
        warnings.warn(f"budget {format_bytes(spec.nbytes)} ({spec.nbytes} bytes) is more than {d.name}'s memory, "
                      f"{format_bytes(d.memory_bytes)} ({d.memory_bytes} bytes): a plan within the budget may not fit "
                      "the device; give a budget of at most its memory (or no budget: then its memory is the budget)",
                      stacklevel=3)
    o = options
    dp = setup(o.data_parallel) if o.bucket_bytes is None else setup(o.data_parallel, o.bucket_bytes)
    if dp is not None and (optimizer is None or o.keep_grads):
        raise ValueError(f"data_parallel={o.data_parallel!r} needs an optimizer and keep_grads off: the reduced "
                         "gradients are consumed by the (sharded) optimizer updates inside the step")
    if o.max_grad_norm is not None and (optimizer is None or o.keep_grads or dp is not None
                                        or o.micro_batches not in (1, "auto")):
        raise ValueError("max_grad_norm clips the gradients inside the step's optimizer update: it needs optimizer=, "
                         "keep_grads off, one process and micro_batches=1 (without optimizer=, the step leaves the "
                         "gradients in .grad: call torch.nn.utils.clip_grad_norm_ on them as usual)")
    if o.precision == "fp16" and (optimizer is None or o.keep_grads or dp is not None
                                  or o.micro_batches not in (1, "auto")):
        raise NotImplementedError("precision='fp16' scales the loss and unscales the gradients inside the step's "
                                  "optimizer update (GradScaler's semantics): it needs optimizer=, keep_grads off, one "
                                  "process and micro_batches=1 for now; precision='bf16' needs no loss scaling")
    if o.atomic and (dp is not None or o.micro_batches not in (1, "auto")):
        raise NotImplementedError("atomic=True keeps a backup of each parameter and its optimizer state from just "
                                  "before its update; it is implemented for one process without micro-batches")
    compiled_options = keyword_options(example_inputs)  # non-tensor keyword inputs, compiled in
    names, example, num_targets = keyword_inputs(example_inputs, loss_fn, o.num_targets)
    placement = None if o.dry_run else execution_device(model, optimizer, example, o.dialects)
    note = None if o.dry_run else precision_note(o.precision, placement)
    if note is not None:
        warn_outside_remat(f"remat: precision={o.precision!r}: {note}")
    k = check_micro_batches(o.micro_batches, example, dp is not None)
    return Compilation(
        model=model, optimizer=optimizer, loss_fn=loss_fn, options=o, budget_spec=spec,
        signature=Signature(example, names, compiled_options), dp=dp,
        keep_grads=(optimizer is None) if o.keep_grads is None else o.keep_grads, num_targets=num_targets,
        micro_batches=k, capture_example=example if k == 1 else tuple(t[: t.shape[0] // k] for t in example),
        started=started, placement=placement, precision_note=note)


def execution_device(model, optimizer, example: Sequence, dialects: Sequence[str] | None):
    """The device the step runs on: where the model's parameters and buffers, the optimizer's
    state and the example's tensors all are (None: the CPU). A ValueError names two tensors on
    different devices, and dialects that cannot run off the CPU (:func:`remat.runtime.vm.device_dialects`)."""
    import torch

    from ..runtime.vm import device_dialects

    where: dict = {}
    for n, t in model.named_parameters():
        where.setdefault(t.device, f"parameter {n!r}")
    for n, t in model.named_buffers():
        where.setdefault(t.device, f"buffer {n!r}")
    for k, t in enumerate(example):
        if isinstance(t, torch.Tensor):
            where.setdefault(t.device, f"input {k}")
    if optimizer is not None:
        for st in optimizer.state.values():
            for key, t in st.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0:  # (Adam's step count stays on the CPU)
                    where.setdefault(t.device, f"optimizer state {key!r}")
    if len(where) > 1:
        (d1, w1), (d2, w2) = list(where.items())[:2]
        raise ValueError(f"remat runs a step on one device, but {w1} is on {d1} and {w2} is on {d2}: move the model, "
                         f"its optimizer state and the example batch to one device first (model.to(device), x.to(device))")
    device = next(iter(where), None)
    if device is None or device.type == "cpu":
        return None
    if device.type == "meta":
        raise ValueError("the model and inputs are on the meta device, which holds no data to run: plan it with "
                         "remat.compile(..., dry_run=True)")
    device_dialects(device, dialects)  # dialects that cannot run there: refused now, before the capture
    return device


def compile_step(model, example_inputs: Sequence | Mapping, loss_fn: Callable | None, optimizer, budget,
                 options: CompileOptions) -> Compilation:
    """Every stage of :data:`STAGES` that applies, in order, on the record :func:`start` makes."""
    c = start(model, example_inputs, loss_fn, optimizer, budget, options)
    stages = [s for s in STAGES if s.when is None or s.when(c)]
    shown = options.shown
    progress = options.progress or (lambda name: None)

    def around(name: str) -> AbstractContextManager:
        progress(name)
        return cyclic_gc_paused() if by_name[name].gc_paused else cyclic_gc_relaxed()

    def after(record, out: Compilation) -> None:  # print_after
        if record.name in shown:
            from ..ir import print_module

            print(f"// ---- after {record.name} ({record.seconds:.2f} s)")
            print(print_module(out.ir))

    by_name = {s.name: s for s in stages}
    with priced_on(options.device_spec), _on_device(c.placement):  # kernels chosen and run for the model's device
        result = run_passes(c, [(s.name, s.run) for s in stages], around=around, after=after, ir=_ir)
    return replace(result.module, stage_seconds={r.name: r.seconds for r in result.records})


def _on_device(placement) -> AbstractContextManager:
    """The torch kernels' device for the compile's stages (None, the CPU: nothing to set)."""
    if placement is None:
        return nullcontext()
    from ..backends.torch_kernels import on_device

    return on_device(placement)


def _ir(c: Compilation) -> Module | None:
    return c.ir


def _count(fn: Function, views: bool = True) -> int:
    """Instructions of ``fn`` (control flow not counted; views not either with ``views=False``: the
    rematerialiser makes a view again for each recomputed consumer, which recomputes nothing)."""
    return sum(1 for i in fn.entry.instrs if not i.op.has("control") and (views or not i.op.has("view")))


def _fastest_instr_costs(vm, fn: Function, args: list, repeats: int) -> tuple[dict, float]:
    """Per-instruction fastest seconds of ``fn`` on the VM over ``repeats`` runs after an untimed one
    (kernels compile or load on their first call), and the fastest total. The fastest, not the
    median: another process on the machine only ever adds time (on a 2-core machine, two intra-op
    threads sharing a core with it made single runs of ResNet's joint 40x slower), and of two runs
    the median is their mean."""
    per: list[list[float]] = [[] for _ in fn.entry.instrs]
    totals = []
    vm.run(fn.name, *args)
    for _ in range(repeats):
        _, st = vm.run(fn.name, *args)
        totals.append(st.total_seconds)
        for idx, _op, sec in st.instr_times:
            if idx < len(per):
                per[idx].append(sec)
    return {ins: min(ts) for ins, ts in zip(fn.entry.instrs, per) if ts}, min(totals)
