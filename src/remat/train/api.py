"""``remat.compile``: a vanilla PyTorch model, a loss and an optimizer in; a training step whose
measured peak memory stays within a byte budget out (RAF's 2–3 line change).

    step = remat.compile(model, (x, y), loss_fn, optimizer=torch.optim.AdamW(model.parameters()),
                         budget="1.5GiB")
    for x, y in loader:
        loss = step(x, y)
    print(step.report())
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .._gc import cyclic_gc_paused, cyclic_gc_relaxed
from ..budget import parse_budget
from .. import backends
from ..errors import BudgetTooSmall, format_bytes  # noqa: F401  (remat.train.api.BudgetTooSmall)
from ..ir import Function, Instruction, Module
from ..plan.costmodel import CostModel, static_costs
from ..plan.liveness import predict_peak
from ..plan.algorithms import Variant, plan_choosing_algorithms
from ..plan.portfolio import SOLVER_OPTIONS, plan_step
from ..plan.problem import StepProblem
from ..plan.record import Plan
from ..step.optim import advance_steps, bind_state, current_state, init_state, steps_taken, updates_from_torch
from ..step.microbatch import microbatch_step
from ..step.program import Layout, prepare_joint, step_program, training_forward, training_graph
from .microbatch import check_micro_batches, micro_batch_semantics, whole_batch_peak


ALGORITHM_OPTIONS = ("auto", "reference")
LAYOUT_OPTIONS = ("auto", "NCHW")
"""``layout``: "auto" computes a convolutional model channels-last (``remat.passes.layout``), "NCHW" as
captured."""


def apply_layout(imp, layout: str):
    """The imported model ``imp`` with its forward in the layout ``layout`` asks for (itself when
    nothing changes): every path that differentiates the step starts from it, so all plans share it."""
    if layout == "NCHW":
        return imp
    from ..passes.layout import channels_last, ohwi_params

    module = channels_last(imp.module)
    if module is imp.module:
        return imp
    function = module[imp.function.name]
    return replace(imp, module=module, function=function, ohwi=ohwi_params(function))
"""``algorithms=``: "auto" lets the planner choose memory-lean algorithms (chunked cross-entropy, attention with
dropout without its score matrix, convolutions over a concatenation without it, batch norm backwards without
ATen's unused buffer) when
the reference step does not fit the budget and they are faster or the only feasible choice;
"reference" keeps every op's reference algorithm (gradients bit-identical to the unconstrained step
under any budget)."""

STAGES = ("capture", "training graph", "passes", "profile", "plan", "lower", "fuse", "kernel compilation",
          "prepare VM")
"""The stages of ``remat.compile``, in order. Each takes IR and gives IR (or a plan); ``profile``
runs only with ``cost_model="profiled"``. ``fuse`` runs on the lowered program: merged sibling kernels
(a convolution's two gradients) and fused element-wise kernels are bit-identical to the ops they
replace and the pass never raises the peak, so the plan's promises (peak within the budget,
gradients identical across budgets) carry over unchanged. Element-wise fusion and ``kernel
compilation`` run when the ``numba`` dialect is enabled; compiled kernels are cached on disk, so a
second compile of the same model compiles nothing."""


GC_PAUSED_STAGES = ("training graph", "passes", "lower", "fuse", "kernel compilation", "prepare VM")
"""Stages run with Python's cyclic garbage collector paused (:mod:`remat._gc`: they build the
program's many long-lived objects). ``capture`` pauses it around its own translation only (not
around torch.export); ``plan`` builds and drops many candidate programs, so it runs with the collector
on, with a larger young-generation threshold (:func:`remat._gc.cyclic_gc_relaxed`)."""


def recomputed_layers(fn: Function) -> dict[str, int]:
    """Module path -> number of instructions of ``fn`` that recompute a value (their provenance),
    in program order; instructions without a location count under "(unknown)"."""
    out: dict[str, int] = {}
    for ins in fn.instructions():
        if ins.recomputes is not None:
            path = "(unknown)" if ins.loc is None else ins.loc.path
            out[path] = out.get(path, 0) + 1
    return out


@dataclass
class Report:
    """What a compiled step planned and measured. Bytes and seconds.

    Overheads are fractions of the unconstrained step (0.1 = +10%). ``predicted_overhead``: the
    plan's recompute cost over the unconstrained compute cost, from the cost model. ``overhead``
    (measured): the last step's time over the unconstrained step program's measured time, minus
    1; exactly 0 when nothing is recomputed (the program is the unconstrained one), and None when
    there is no unconstrained measurement (the static cost model runs nothing at compile time)."""

    budget: int | None
    predicted_peak: int
    measured_peak: int | None
    unconstrained_peak: int
    overhead: float | None
    predicted_overhead: float
    solver: str
    solver_notes: list[str] = field(default_factory=list)
    plan_seconds: float = 0.0
    setup_seconds: float = 0.0
    step_seconds: float | None = None
    unconstrained_step_seconds: float | None = None  # measured ("profiled" cost model only)
    instructions: int = 0
    recomputed_instructions: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    data_parallel: str | None = None  # "ddp" | "zero1" | "zero2": the numbers are this rank's
    memory: dict[str, int] | None = None  # bytes by kind live at the peak: measured (first step), else predicted
    recomputed_layers: dict[str, int] = field(default_factory=dict)  # module path ("" = top level) -> recomputed instructions
    workspace_bytes: int = 0                       # the largest kernel workspace (budgeted steps)
    predicted_allocator_peak: int | None = None    # the allocator bound: VM high-water marks + kernel workspaces
    measured_allocator_peak: int | None = None     # PyTorch's allocator (budgeted steps: the first step, or
                                                   # step.measure_allocator_peak on copies)
    shapes_cached: int = 1  # input shapes with a compiled plan; the other fields are of the example's shapes
    algorithms: list[str] = field(default_factory=list)  # per-operator algorithm choices considered, and why
    micro_batches: int = 1  # k: the batch runs as k micro-batches with gradient accumulation (remat.train.microbatch)
    batch_size: int | None = None  # the whole batch (axis 0 of the inputs), when micro-batched
    predicted_step_seconds: float | None = None  # the cost model's seconds for the whole step (all micro-batches)
    micro_batch_choice: list[str] = field(default_factory=list)  # each micro-batch count tried and why one won
    capture_cached: bool = False  # the capture came from the on-disk capture cache (no torch.export ran)
    channels_last: bool = False  # the convolutions run channels-last (NHWC; the ``layout`` option)

    def __str__(self) -> str:
        def b(v):
            return "-" if v is None else f"{format_bytes(v)} ({v:,} B)"

        rows = [
            ("budget", b(self.budget)),
            ("predicted peak", b(self.predicted_peak)),
            ("measured peak (last step)", b(self.measured_peak)),
            ("unconstrained peak", b(self.unconstrained_peak)),
            ("largest kernel workspace", b(self.workspace_bytes)),
            ("allocator peak: predicted", b(self.predicted_allocator_peak)),
            ("allocator peak: measured", b(self.measured_allocator_peak)),
            ("peak / unconstrained", f"{self.predicted_peak / self.unconstrained_peak:.1%}"),
            ("solver", self.solver),
            ("layout", "channels-last (NHWC)" if self.channels_last else "as captured"),
            ("recomputed instructions", f"{self.recomputed_instructions} of {self.instructions}"),
            ("recomputed layers", ", ".join(f"{p or '(top level)'} ({n})" for p, n in self.recomputed_layers.items())
             or "-"),
            ("predicted recompute overhead", f"{self.predicted_overhead:+.1%}"),
            ("measured step overhead", "- (no unconstrained measurement)" if self.overhead is None
             else f"{self.overhead:+.1%}"),
            ("step time (last)", "-" if self.step_seconds is None else f"{self.step_seconds * 1e3:.1f} ms"),
            ("unconstrained step time (profiled)", "-" if self.unconstrained_step_seconds is None
             else f"{self.unconstrained_step_seconds * 1e3:.1f} ms"),
            ("setup time", f"{self.setup_seconds:.2f} s: " + ", ".join(
                f"{k} {v:.2f} s" + (" (capture cache)" if k == "capture" and self.capture_cached else "")
                for k, v in self.stage_seconds.items())),
        ]
        w = max(len(k) for k, _ in rows)
        lines = ["remat training step", "-" * (w + 40)] + [f"{k:<{w}}  {v}" for k, v in rows]
        if self.micro_batches > 1 or self.micro_batch_choice:
            mb = ("1 (the whole batch at once)" if self.micro_batches == 1 else
                  f"{self.micro_batches} x {self.batch_size // self.micro_batches} samples, gradients accumulated "
                  f"(equal to the whole batch's up to summation order)")
            pred = ("" if self.predicted_step_seconds is None
                    else f"; predicted step {self.predicted_step_seconds * 1e3:.1f} ms (static cost model)")
            lines.insert(2, f"{'micro-batches':<{w}}  {mb}{pred}")
            lines += [f"  micro-batching: {c}" for c in self.micro_batch_choice]
        if self.shapes_cached > 1:
            lines.insert(2, f"{'input shapes cached':<{w}}  {self.shapes_cached} (this report: the example's shapes)")
        if self.data_parallel is not None:
            lines.insert(2, f"{'data parallel':<{w}}  {self.data_parallel} (bytes are per rank)")
        if self.memory is not None:
            lines += [f"{'at peak: ' + k:<{w}}  {b(v)}" for k, v in self.memory.items() if v]
        lines += [f"  algorithm: {a}" for a in self.algorithms]
        lines += [f"  note: {n}" for n in self.solver_notes if not n.startswith("algorithm choice: ")]
        return "\n".join(lines)


def _median_instr_costs(vm, fn: Function, args: list, repeats: int) -> tuple[dict, float]:
    """Per-instruction median seconds of ``fn`` on the VM over ``repeats`` runs after an untimed one
    (kernels compile or load on their first call), and the fastest total."""
    per: list[list[float]] = [[] for _ in fn.entry.instrs]
    totals = []
    vm.run(fn.name, *args)
    for _ in range(repeats):
        _, st = vm.run(fn.name, *args)
        totals.append(st.total_seconds)
        for idx, _op, sec in st.instr_times:
            if idx < len(per):
                per[idx].append(sec)
    # The step time is the fastest run.
    return ({ins: statistics.median(ts) for ins, ts in zip(fn.entry.instrs, per) if ts}, min(totals))


def _printable(x) -> str:
    """The IR a stage produced, as text."""
    from ..ir import print_function, print_module

    if isinstance(x, tuple):  # "training graph": (the forward it differentiated, the graph)
        return _printable(x[-1])
    if isinstance(x, Module):
        return print_module(x)
    if isinstance(x, Function):
        return print_function(x)
    if isinstance(x, Plan):
        return print_function(x.program)
    return print_function(x.function)  # an imported model


class TrainStep:
    """A compiled training step. Call it with the inputs and targets; it runs forward, backward
    and the optimizer update on the model's own tensors and returns the loss."""

    def __init__(self, model, example_inputs: Sequence | Mapping, loss_fn: Callable | None, optimizer=None, budget=None, *,
                 num_targets: int | None = None, solver: str = "auto", dialects: Sequence[str] | None = None,
                 seed: int = 0, keep_grads: bool | None = None, profile_repeats: int = 2,
                 cost_model: str = "static", milp_time_limit: float = 10.0,
                 progress: Callable[[str], None] | None = None,
                 print_after: str | Sequence[str] | None = None, data_parallel: str | None = None,
                 bucket_bytes: int | None = None, count_workspaces: bool = True, measure_allocator: bool = True,
                 algorithms: str = "auto", micro_batches: int = 1, loss_reduction: str | None = None,
                 layout: str = "auto", full_batch_peak: int | None = None):
        # The options, to compile this step again for other input shapes (``_call_other_shapes``).
        self._options = {k: v for k, v in locals().items()
                         if k not in ("self", "model", "example_inputs", "loss_fn", "optimizer", "budget",
                                      "full_batch_peak")}
        import torch

        from ..distributed import setup  # imported on use (torch.distributed)
        from ..frontend.torch_import import import_module, keyword_inputs, keyword_options
        from ..runtime.vm import VM

        t_setup = time.perf_counter()
        # Reject bad options before the (seconds-long) capture.
        if budget is not None:
            parse_budget(budget, reference=1)  # fractions resolve later, against the unconstrained peak
        if cost_model not in ("static", "profiled"):
            raise ValueError(f"cost_model must be 'static' (deterministic estimates) or 'profiled' (measured), got {cost_model!r}")
        if algorithms not in ALGORITHM_OPTIONS:
            raise ValueError(f"algorithms must be one of {', '.join(map(repr, ALGORITHM_OPTIONS))}, got {algorithms!r}")
        self._algorithms = algorithms
        if layout not in LAYOUT_OPTIONS:
            raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUT_OPTIONS))}, got {layout!r}")
        self.layout_option = layout
        self._variants: list[Variant] | None = None  # the lean-algorithm variants, built on first need
        if solver not in SOLVER_OPTIONS:
            raise ValueError(f"unknown solver {solver!r}; valid: {', '.join(SOLVER_OPTIONS)}")
        shown = {print_after} if isinstance(print_after, str) else set(print_after or ())
        if shown - set(STAGES):
            raise ValueError(f"print_after: unknown stage(s) {sorted(shown - set(STAGES))}; stages: {', '.join(STAGES)}")
        self._progress, self._shown = progress or (lambda msg: None), shown
        self.dp = setup(data_parallel) if bucket_bytes is None else setup(data_parallel, bucket_bytes)  # None: one process
        if self.dp is not None and (optimizer is None or keep_grads):
            raise ValueError(f"data_parallel={data_parallel!r} needs an optimizer and keep_grads off: the reduced "
                             "gradients are consumed by the (sharded) optimizer updates inside the step")
        self.stage_seconds: dict[str, float] = {}
        self.model, self.optimizer, self._loss_fn = model, optimizer, loss_fn
        self._shape_steps: dict[tuple, TrainStep] = {}  # steps compiled for other input shapes
        self._announce = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.dialects = tuple(dialects) if dialects else None
        self.keep_grads = (optimizer is None) if keep_grads is None else keep_grads
        # Keyword inputs (Hugging Face style) become positional, in the order of their names.
        self._options = keyword_options(example_inputs)  # non-tensor keyword inputs, compiled in
        self._input_names, example_inputs, num_targets = keyword_inputs(example_inputs, loss_fn, num_targets)
        self._example = example_inputs
        # Micro-batching (remat.step.microbatch): capture one micro-batch; the step takes the whole batch.
        self.micro_batches = k = check_micro_batches(micro_batches, example_inputs, self.dp is not None)
        self._capture_example = example_inputs if k == 1 else tuple(t[: t.shape[0] // k] for t in example_inputs)
        self.loss_reduction = None
        self.micro_batch_choice: list[str] = []
        self.cost_model = cost_model
        self._profile_repeats = profile_repeats
        self._step = 0
        self._seed = seed
        self._count_workspaces = count_workspaces
        self._measure_allocator = measure_allocator  # budgeted steps: the first step runs under the profiler
        self.workspace_bytes = 0                      # the largest kernel workspace (budgeted steps)
        self.predicted_allocator_peak: int | None = None  # VM high-water marks + kernel workspaces
        self.measured_allocator_peak: int | None = None   # profiler memory events of the first step (or on copies)

        # ---- the stages, in order (STAGES)
        captured = self._stage("capture", lambda: import_module(
            model, self._keywords(self._capture_example), loss_fn, train=model.training, num_targets=num_targets))
        self.imported = imp = apply_layout(captured, layout)
        self.channels_last = imp is not captured  # the convolutions run NHWC (remat.passes.layout)
        self._bind_torch(imp)
        if k > 1:
            self.loss_reduction = micro_batch_semantics(self, loss_reduction, num_targets)
        n_params = len(imp.param_names)
        # The forward every planner differentiates (the whole step's and the chain planner's blocks).
        def differentiate() -> tuple[Function, Module]:
            fwd = training_forward(imp.function)
            return fwd, training_graph(fwd, n_params)
        forward, graph = self._stage("training graph", differentiate)
        # Forward + backward, before planning; composites no chosen dialect has a kernel for are
        # expanded into their decompositions first (so the plan is made for the program that runs).
        # Training batch norms split into statistics + element-wise normalisation (a recomputed
        # output costs one pass over its input), unclaimed composites expanded (step.prepare_joint).
        self.joint = joint = self._stage("passes", lambda: prepare_joint(graph, self.dialects))
        # (the "fuse" stage goes here: IR -> IR on the joint)
        unconstrained = self._make_step(joint, check=True)
        # The whole batch's unconstrained peak: the reference of relative budgets and of the report,
        # also when the step runs as micro-batches (then captured once more, at the whole batch).
        self.step_unconstrained_peak = predict_peak(unconstrained)  # this step's own program, no recomputation
        self.unconstrained_peak = self.step_unconstrained_peak if k == 1 else (
            full_batch_peak if full_batch_peak is not None else whole_batch_peak(self, num_targets))
        self.budget = None if budget is None else parse_budget(budget, reference=self.unconstrained_peak)
        self.unconstrained_step_seconds = None
        if cost_model == "profiled":
            self.costs = self._stage("profile", lambda: self._profile(joint, unconstrained))
        else:
            self.costs = static_costs(joint)
        problem = StepProblem(forward, imp.state_count, n_params, joint, unconstrained, self.budget,
                              self._finish, self._extra_bytes(), self.costs, solver, milp_time_limit,
                              self._joint_args(self._capture_example, copy=True) if cost_model == "profiled" else None,
                              self.dialects)
        if self.updates and not self.keep_grads and self.dp is None and k == 1:
            g0 = self.layout.first_grad  # each gradient's update follows it (step.program.update_points)
            problem = replace(problem, consumed=tuple(range(g0, g0 + self.layout.n_params)))
        self.problem = problem  # kept so other budgets can be planned on the same capture (remat.train.curve)
        try:
            self.plan = self._stage("plan", lambda: self._plan_within_allocator(problem, unconstrained))
        except BudgetTooSmall as e:
            e.unconstrained_peak = self.unconstrained_peak  # of the whole batch: resolves relative budgets
            raise
        cost = CostModel(self.costs)
        self.predicted_seconds = cost.program_cost(self.plan.program)  # the whole step, every micro-batch
        self.unconstrained_predicted_seconds = cost.program_cost(unconstrained)
        self.solver, self.notes = self.plan.solver, self.plan.notes
        self.algorithm_choices = list(self.plan.algorithms)
        if self.plan.unconstrained is not None:  # a lean algorithm won: counts are against its own step
            unconstrained = self.plan.unconstrained
        self.predicted_overhead = self.plan.overhead
        self.program = self._stage("lower", lambda: self.plan.program)

        def count(fn: Function) -> int:
            return sum(1 for i in fn.entry.instrs if not i.op.has("control"))

        # Counted on the lowered program: fusion merges instructions but recomputes nothing.
        self.instructions = count(self.program)
        self.recomputed = self.instructions - count(unconstrained)
        self._recomputes = self.program is not unconstrained
        self.recomputed_layers = recomputed_layers(self.program)
        numba = "numba" in backends.resolve(self.dialects)
        self.program = self._stage("fuse", lambda: self._fuse_within_allocator(self.program, numba))
        if numba:
            from ..backends import numba_kernels

            self._stage("kernel compilation", lambda: numba_kernels.prepare(Module([self.program])))
        self.predicted_peak = predict_peak(self.program)
        if self.dp is not None:
            from ..distributed.group import check_same_collectives

            check_same_collectives(self.program, self.dp)
        self._vm = self._stage("prepare VM", lambda: VM(Module([self.program]), dialects=self.dialects))
        self._kinds = self._value_kinds()
        self._vm.set_kinds(self.program, self._kinds)
        self.plan_seconds = self.stage_seconds["plan"]
        self.setup_seconds = time.perf_counter() - t_setup
        self.last_stats = None
        # Bytes by kind (parameters, gradients, optimizer state, ...) as the VM measured them on
        # this step's first run (RunStats.by_kind; later runs record the peak only, to stay lean:
        # the program and so the split are the same at every step).
        self.kind_stats = None
        self.last_seconds = None
        self.torch = torch

    # ------------------------------------------------------------------ stages
    def _stage(self, name: str, run: Callable[[], Any]) -> Any:
        """Run one stage: report progress, time it, print its IR when asked (``print_after``)."""
        self._progress(name)
        t0 = time.perf_counter()
        with cyclic_gc_paused() if name in GC_PAUSED_STAGES else cyclic_gc_relaxed():
            out = run()
        self.stage_seconds[name] = time.perf_counter() - t0
        if name in self._shown:
            print(f"// ---- after {name} ({self.stage_seconds[name]:.2f} s)")
            print(_printable(out if name not in ("prepare VM", "kernel compilation") else self.program))
        return out

    def _bind_torch(self, imp) -> None:
        """The model's parameters, buffers and optimizer state, in the order of the captured IR."""
        optimizer, model = self.optimizer, self.model
        self._example_types = [(tuple(t.shape), t.dtype) for t in self._example]
        named = dict(model.named_parameters())
        self._params = [named[n] for n in imp.param_names]
        # The trainable weights the step takes OHWI (channels-last weights; remat.passes.layout).
        self._ohwi = frozenset(i for i in imp.ohwi if i < len(self._params) and self._params[i] is imp._tensors[i])
        named_b = dict(model.named_buffers())
        self._buffers_out = [named_b[n.split(":", 1)[-1]] for n in imp.output_names[1:]] if len(imp.output_names) > 1 else []
        self.layout = Layout(len(imp.param_names), imp.state_count, imp.input_count, imp.has_seed,
                             len(imp.output_names) - 1)
        self.updates = updates_from_torch(optimizer, self._params) if optimizer is not None else None
        self._state = init_state(optimizer, self._params, self.updates) if self.updates else []
        if self.updates:
            steps_taken(optimizer, self._params, self.updates)  # parameters stepped unequally: fail now
        if self.dp is not None and self.dp.shards_state:
            self._state = self._sharded_state()
        self._state_types = [[self._ttype(t.permute(0, 2, 3, 1) if i in self._ohwi else t) for t in ts]
                             for i, ts in enumerate(self._state)]

    def _finish(self, joint: Function) -> Function:
        """A (rematerialised) joint -> the whole step program (updates placed after each gradient)."""
        return self._make_step(joint, check=False)

    def _make_step(self, joint: Function, check: bool) -> Function:
        """The step program of a joint: one process, or this rank's (``remat.distributed.passes``)."""
        if self.micro_batches > 1:
            return microbatch_step(joint, self.layout, self.updates, self._state_types, self.keep_grads,
                                   self.micro_batches, self.loss_reduction, check=check)
        if self.dp is None:
            return step_program(joint, self.layout, self.updates, self._state_types, self.keep_grads, check=check)
        from ..distributed.passes import data_parallel_step

        return data_parallel_step(joint, self.layout, self.updates, self._state_types, self.dp, check=check)

    def _sharded_state(self) -> list[list]:
        """ZeRO: zeros for this rank's shard of every state tensor, kept by the step (not in
        ``optimizer.state``: it holds no full-size state); ``state_dict()`` saves them."""
        import torch

        if any(self.optimizer.state.get(p) for p in self._params):
            raise ValueError(f"data_parallel={self.dp.mode!r} shards the optimizer state, but this optimizer already "
                             "has state; compile with a fresh optimizer and restore a run with step.load_state_dict()")
        return [[torch.zeros(self.dp.shard(p.numel()).size, dtype=p.dtype) for _ in u.state_keys]
                for p, u in zip(self._params, self.updates)]

    def _optimizer_steps(self) -> int:
        """Optimizer steps taken so far (the count the next step's update continues from)."""
        if self.dp is not None and self.dp.shards_state:
            return self.dp.steps
        return steps_taken(self.optimizer, self._params, self.updates) if self.updates else 0

    def _plan_within_allocator(self, problem: StepProblem, unconstrained: Function) -> Plan:
        """Plan so that PyTorch's allocator, not only the VM's count of IR values, stays within the
        budget. The VM counts IR values exactly; kernels allocate workspaces beside them. Each
        kernel's workspace is measured once per kernel and shape (``runtime.allocator``, cached on
        disk) and enters the graph solvers as the node's workspace and the chain DP as part of each
        stage's transient bytes; a plan fits when its allocator bound (``plan.workspace``: the VM's
        high-water mark at each instruction plus that kernel's workspace) is within the budget.
        Without a budget, or with ``count_workspaces=False``, this is ``plan_step`` unchanged (the
        budget then bounds the VM's count only)."""
        from ..plan.workspace import allocator_bound, workspace_margin

        if self.budget is None or not self._count_workspaces:
            return self._plan_once(problem)
        ws_of = self._workspaces
        self.workspace_bytes = workspace_margin(unconstrained, ws_of(unconstrained))
        problem = replace(problem, workspaces=ws_of(problem.joint), workspace_fn=ws_of)
        plan = self._plan_once(problem)
        self.predicted_allocator_peak = allocator_bound(plan.program, ws_of(plan.program))
        return plan

    def _workspaces(self, fn: Function) -> dict[Instruction, int]:
        """Kernels' own bytes per instruction of ``fn`` (measured once per kernel and shape, cached)."""
        from ..runtime.allocator import workspaces

        return workspaces(fn, self.dialects)

    def _fuse_within_allocator(self, program: Function, elementwise: bool) -> Function:
        """The ``fuse`` stage: sibling convolution gradients become one call
        (:mod:`remat.lower.siblings`) and, with ``elementwise`` (the numba dialect), element-wise
        DAGs fused kernels (:mod:`remat.lower.fuse`). Neither raises the VM's peak, but they move
        high-water marks; with workspaces counted, a rewrite whose span holds an allocator
        high-water mark above the budget is undone (the others are kept), and the fused program
        is kept only if its allocator bound stays within the budget (else the planned program
        runs unfused)."""
        from ..lower.fuse import fuse_function
        from ..lower.siblings import merge_conv_grads
        from ..plan.workspace import allocator_bound, allocator_excess

        judge = None
        if self.budget is not None and self._count_workspaces and (self.predicted_allocator_peak or 0) <= self.budget:
            budget = self.budget

            def judge(out: Function) -> int | None:  # rewrites whose span breaks the budget are undone
                return allocator_excess(out, self._workspaces(out), budget)

        fused = merge_conv_grads(program, judge)
        if elementwise:
            fused = fuse_function(fused, judge=judge)
        if self.budget is None or not self._count_workspaces:
            return fused
        bound = allocator_bound(fused, self._workspaces(fused))
        if bound > self.budget >= (self.predicted_allocator_peak or 0):
            self.notes = self.notes + [f"fusion left out: the fused program's allocator bound {format_bytes(bound)} "
                                       f"exceeds the budget"]
            return program
        self.predicted_allocator_peak = bound
        return fused

    def _plan_once(self, problem: StepProblem) -> Plan:
        """:meth:`_plan`; under ``data_parallel="ddp"`` on rank 0 only, every rank receiving its plan
        (``remat.distributed.group.plan_on_rank0``), so that all ranks run the same program. ZeRO's
        step programs differ between ranks (each slices its own shards), so there every rank plans
        on its own and ``check_same_collectives`` compares what they issue."""
        if self.dp is None or self.dp.shards_state:
            return self._plan(problem)
        from ..distributed.group import plan_on_rank0

        return plan_on_rank0(lambda: self._plan(problem), self.dp, problem.budget)

    def _plan(self, problem: StepProblem) -> Plan:
        """Plan ``problem``, choosing per operator between the reference and memory-lean algorithms
        (``remat.plan.algorithms``) unless ``algorithms="reference"``."""
        if self._algorithms == "reference":
            return plan_step(problem)
        return plan_choosing_algorithms(problem, self._lean_variants)

    def _lean_variants(self, p: StepProblem) -> list[Variant]:
        """The step with each language-model head's cross-entropy chunked (``linear_cross_entropy``),
        each attention with dropout memory-efficient (``dropout_attention``), each convolution over a
        channel concatenation split per input (``split-concat-conv``), each convolution -> batch norm ->
        ReLU -> max pool chain tiled over the batch (``tile-conv-bn-pool``) and each training batch
        norm's backward split (``split-batch-norm-grad``): built once (capture reused, each
        differentiated again on first use), then given ``p``'s budget and workspaces. With a tiled
        chain, two variants: tiles of at least ``MIN_TILE_BYTES`` (faster), then tiles of 1/``TILES``
        of the batch (leaner)."""
        if self._variants is None:
            self._variants = self._build_lean_variants()
        out = []
        for v in self._variants:
            def given_p(v=v) -> StepProblem:  # the variant's problem with p's budget and workspaces
                if p.workspace_fn is None:
                    return replace(v.problem, budget=p.budget)
                return replace(v.problem, budget=p.budget, workspaces=p.workspace_fn(v.problem.joint),
                               workspace_fn=p.workspace_fn)

            out.append(Variant(v.sites, given_p))
        return out

    def _build_lean_variants(self) -> list[Variant]:
        from ..passes.attention import recognise_dropout_attention
        from ..passes.concatconv import split_concat_conv
        from ..passes.convblock import MIN_TILE_BYTES, tile_conv_bn_pool
        from ..passes.crossentropy import fuse_cross_entropy

        n_params = len(self.imported.param_names)
        base, sites = fuse_cross_entropy(self.imported.function)
        base, att_sites = recognise_dropout_attention(base)
        base, cat_sites = split_concat_conv(base)
        tilings = []  # (forward, its tiled chains), faster tiles first
        for min_tile in (MIN_TILE_BYTES, 0):
            forward, stem_sites = tile_conv_bn_pool(base, n_params, min_tile_bytes=min_tile)
            if not tilings or [s.tile for s in stem_sites] != [s.tile for s in tilings[0][1]]:
                tilings.append((forward, stem_sites))
        bns = sum(1 for ins in tilings[0][0].instructions() if ins.op.name == "batch_norm" and ins.attrs["training"])
        if not sites and not att_sites and not cat_sites and not tilings[0][1] and not bns:
            return []
        lines = [f"linear_cross_entropy at {s.where} ({s.rows} rows x {s.vocab} classes in chunks of {s.chunk}; "
                 + (f"the reference holds 3 x {format_bytes(s.logits_bytes)} of logits, log-probabilities "
                    f"and their gradient)" if s.held == 3 else
                    f"the reference holds the {format_bytes(s.logits_bytes)} logits, then their gradient over them)")
                 for s in sites]
        if att_sites:
            a = att_sites[0]
            lines.append(f"dropout_attention at {len(att_sites)} attention(s) (scores {list(a.shape)}, dropout "
                         f"p={a.p:g}; one [T, S] matrix at a time, where the explicit form holds "
                         f"{format_bytes(a.scores_bytes)} tensors of scores, probabilities and their gradients)")
        if cat_sites:
            lines.append(f"conv2d over concat at {len(cat_sites)} convolution(s) ({', '.join(s.where for s in cat_sites)}) "
                         f"as one convolution per concatenated input, summed (never the concatenated "
                         f"activations, {format_bytes(sum(s.concat_bytes for s in cat_sites))} in all, or one "
                         f"gradient for them; values differ by summation order)")
        bn_line = ([f"batch_norm_grad at {bns} batch norm(s) as a reduction and an element-wise grad_x "
                    f"(ATen's backward allocates an input-sized buffer it does not use; grad_x may "
                    f"differ in the last bit)"] if bns else [])
        variants = []
        for forward, stem_sites in tilings:
            def make(forward=forward) -> StepProblem:  # differentiated on first use only
                fwd = training_forward(forward)
                joint = prepare_joint(training_graph(fwd, n_params), self.dialects, split_bn_grad=bns > 0)
                unconstrained = self._make_step(joint, check=True)
                # costed as the reference is: a variant's candidates are compared with the reference's
                profiled = self.cost_model == "profiled"
                return replace(self.problem, forward=fwd, joint=joint, unconstrained=unconstrained,
                               costs=self._measured_costs(joint) if profiled else static_costs(joint),
                               example_args=self._joint_args(self._capture_example, copy=True) if profiled else None,
                               workspaces=None, split_bn_grad=bns > 0)

            stems = [f"conv_bn_relu_pool at {s.where} (convolution, batch norm, ReLU and max pool over "
                     f"{s.batch} samples, {s.tile} at a time in two passes; the reference holds "
                     f"{format_bytes(s.activation_bytes)} full-resolution activations and their gradients; "
                     f"the convolution runs 4x; statistics and gradients differ by summation order)" for s in stem_sites]
            variants.append(Variant(lines + stems + bn_line, make))
        return variants

    def _extra_bytes(self) -> int:
        """Bytes the step adds to the joint: optimizer state and the step counter."""
        return sum(t.nbytes for ts in self._state_types for t in ts) + (8 if self.updates else 0)

    def _measured_costs(self, joint: Function) -> dict[Instruction, float]:
        """Measured per-instruction seconds of a joint (on copies of the example's arguments)."""
        from ..runtime.vm import VM

        return _median_instr_costs(VM(Module([joint]), dialects=self.dialects), joint,
                                   self._joint_args(self._capture_example, copy=True), self._profile_repeats)[0]

    def _profile(self, joint: Function, unconstrained: Function) -> dict[Instruction, float]:
        """Measured per-instruction seconds of the joint, and the unconstrained step's time (on copies)."""
        from ..runtime.vm import VM

        measured = self._measured_costs(joint)
        vm = VM(Module([unconstrained]), dialects=self.dialects)
        self.unconstrained_step_seconds = min(
            vm.run(unconstrained.name, *self._step_args(self._example, copy=True, step=1))[1].total_seconds
            for _ in range(self._profile_repeats))
        return measured

    # ------------------------------------------------------------------ arguments
    def _ttype(self, t):
        from ..runtime.vm import tensor_type_of

        return tensor_type_of(t.detach())

    def _joint_args(self, inputs: Sequence, copy: bool) -> list:
        state = self.imported.param_tensors(copy=copy)
        args = state + [t.detach() if hasattr(t, "detach") else t for t in inputs]
        if self.imported.has_seed:
            args.append(np.array(self._seed + self._step, dtype=np.int64))
        return args

    def _step_args(self, inputs: Sequence, copy: bool, step: int, state: list[list] | None = None) -> list:
        args = self._joint_args(inputs, copy)
        if self.updates:
            ohwi = self._ohwi
            if ohwi:
                from ..frontend.torch_import import ohwi_copy, ohwi_view
            for i, ts in enumerate(self._state if state is None else state):
                if i in ohwi:  # the OHWI parameter's state: OHWI views too (ohwi_view)
                    args += [ohwi_copy(t) if copy else ohwi_view(t) for t in ts]
                else:
                    args += [t.detach().clone() if copy else t.detach() for t in ts]
            args.append(np.array(step, dtype=np.int64))
        return args

    def _keywords(self, inputs: tuple) -> tuple | dict[str, Any]:
        """The step's tensors as compiled: positional, or keyword (``self._input_names``, with the
        compiled keyword options)."""
        return inputs if self._input_names is None else {**dict(zip(self._input_names, inputs)), **self._options}

    def _positional(self, inputs: tuple, kwargs: dict[str, Any]) -> tuple:
        """The step's tensors in compiled order: positional as compiled, or by the compiled keywords."""
        names = self._input_names
        if names is None:
            if kwargs:
                raise TypeError(f"the step was compiled with positional inputs; got keywords {sorted(kwargs)}: "
                                "compile with a dict of keyword inputs to call it with keywords")
            return inputs
        for k, v in self._options.items():  # options: as compiled, or left out
            if k in kwargs:
                got = kwargs.pop(k)
                if type(got) is not type(v) or got != v:
                    raise TypeError(f"the step was compiled with {k}={v!r}; got {k}={got!r}: options are compiled in "
                                    f"(compile another step for {k}={got!r})")
        if inputs or set(kwargs) != set(names):
            missing, extra = [n for n in names if n not in kwargs], sorted(set(kwargs) - set(names))
            raise TypeError(f"the step was compiled with keyword inputs {', '.join(names)}; call it with exactly "
                            f"those keywords" + (f" (missing: {', '.join(missing)})" if missing else "")
                            + (f" (unexpected: {', '.join(extra)})" if extra else "")
                            + (f" and no positional inputs (got {len(inputs)})" if inputs else ""))
        return tuple(kwargs[n] for n in names)

    def _arg_name(self, k: int) -> str:
        return f"argument {k}" if self._input_names is None else f"input {self._input_names[k]}="

    def _check_inputs(self, inputs: Sequence) -> None:
        if len(inputs) != len(self._example_types):
            raise TypeError(f"the step takes {len(self._example_types)} tensor(s) (inputs then targets), got {len(inputs)}")
        for k, (t, (shape, dtype)) in enumerate(zip(inputs, self._example_types)):
            if not hasattr(t, "shape") or len(t.shape) != len(shape) or getattr(t, "dtype", None) != dtype:
                got = f"{getattr(t, 'dtype', type(t).__name__)}{list(getattr(t, 'shape', []))}"
                raise TypeError(f"{self._arg_name(k)} of the training step: expected {dtype}{list(shape)} (as "
                                f"compiled; other sizes of the same dtype and rank get a plan of their own), got {got}")

    # ------------------------------------------------------------------ run
    def __call__(self, *inputs, **keyword_inputs):
        """One training step on ``inputs`` (model inputs then targets, or the keywords compiled
        with); returns the loss (a 0-d tensor). Other sizes of the same dtypes and ranks compile
        (once) a plan of their own under the same budget.

        Atomic for bad arguments and out-of-range indices (class targets, token ids): they raise
        before anything is written, so parameters, gradients, buffers and ``optimizer.state_dict()``
        stay exactly as they were, also on the first call (the optimizer's state is registered only
        after a step succeeded). The program places no in-place update before the first check of
        each index value (``step.program.last_new_index_check``); a kernel failing after the first
        update (out of memory in the backward, say) is the one case that leaves updates applied."""
        torch = self.torch
        inputs = self._positional(inputs, keyword_inputs)
        if self._other_shapes(inputs):
            return self._call_other_shapes(inputs)
        self._check_inputs(inputs)
        opt_step, state = self._step, None
        if self.updates:
            self._check_optimizer()
            # The optimizer's own step count and state (it may also have been stepped eagerly).
            opt_step = self._optimizer_steps()
            if self.dp is None or not self.dp.shards_state:
                state = current_state(self.optimizer, self._params, self.updates)
        args = self._step_args(inputs, copy=False, step=opt_step + 1, state=state)
        t0 = time.perf_counter()
        by_kind = self.kind_stats is None
        if (self.measured_allocator_peak is None and self.budget is not None and self._measure_allocator
                and not torch._C._autograd._profiler_enabled()):  # a profiler of the caller's: not nested
            outs, stats = self._run_measuring_allocator(args, by_kind)
        else:
            outs, stats = self._vm.run(self.program.name, *args, outputs="torch", record="peak", by_kind=by_kind)
        if state is not None:  # the step succeeded: now the optimizer owns the state it updated
            self._state = bind_state(self.optimizer, self._params, self.updates, state)
        self.last_seconds = time.perf_counter() - t0
        self.last_stats = stats
        if stats.by_kind is not None:
            self.kind_stats = stats.by_kind
        self._step += 1
        loss = outs[0]
        with torch.no_grad():
            for buf, new in zip(self._buffers_out, outs[1:self.layout.first_grad]):
                buf.copy_(new)
            if self.keep_grads:
                self._set_grads(outs, args)
        if self.dp is not None and self.dp.shards_state:
            self.dp.steps += 1
        elif self.updates:
            advance_steps(self.optimizer, self._params, self.updates)
        return loss

    def _set_grads(self, outs: Sequence, args: Sequence) -> None:
        """Each parameter's ``.grad``: the step's gradient (added to an existing ``.grad``). A gradient
        that owns its storage alone is taken as it is, so the step's measured peak is the VM's (a copy
        of every gradient while the VM's are still referenced would add the gradients' bytes at the
        end of the step); one sharing storage with an argument, the loss, a buffer's new value or
        another gradient (a view, or one value returned twice) is copied."""
        torch = self.torch
        first = self.layout.first_grad
        taken = {t.untyped_storage().data_ptr() for t in [*args, *outs[:first]] if isinstance(t, torch.Tensor)}
        ohwi = self._ohwi
        for i, (p, g) in enumerate(zip(self._params, outs[first:])):
            if p.grad is not None:
                p.grad.add_(g.permute(0, 3, 1, 2) if i in ohwi else g)
                continue
            g = g.to(p.dtype)
            st = g.untyped_storage()
            alone = (g.numel() > 0 and g.is_contiguous() and g.storage_offset() == 0
                     and st.nbytes() == g.numel() * g.element_size() and st.data_ptr() not in taken)
            g = g if alone else g.clone()
            p.grad = g.permute(0, 3, 1, 2) if i in ohwi else g  # an OHWI gradient: the weight's, channels-last
            taken.add(st.data_ptr())

    def _run_measuring_allocator(self, args: list, by_kind: bool = False) -> tuple:
        """One run of the step under torch.profiler's memory events: the allocator's measured
        peak (arguments counted as the VM counts them) for ``report()``. Budgeted steps do this on
        their first call only (``measure_allocator=False``: never), and not inside a profiler the
        caller runs (the next call measures then)."""
        from ..runtime.allocator import allocation_trace, peak_of_trace

        (outs, stats), events = allocation_trace(
            lambda: self._vm.run(self.program.name, *args, outputs="torch", record="peak", by_kind=by_kind))
        self.measured_allocator_peak = sum(p.type.nbytes for p in self.program.params) + peak_of_trace(events)[0]
        return outs, stats

    # ------------------------------------------------------------------ other shapes
    def _other_shapes(self, inputs: Sequence) -> bool:
        """Whether ``inputs`` are the compiled tensors with other shapes (a new batch size or
        sequence length): same count, dtypes and ranks."""
        return (len(inputs) == len(self._example_types)
                and all(hasattr(t, "shape") and getattr(t, "dtype", None) == dtype and len(t.shape) == len(shape)
                        for t, (shape, dtype) in zip(inputs, self._example_types))
                and any(tuple(t.shape) != shape for t, (shape, _) in zip(inputs, self._example_types)))

    def _call_other_shapes(self, inputs: Sequence):
        """One step on inputs of other shapes: with the plan cached for them, compiled on first
        sight under the same byte budget (the model, optimizer and options are this step's)."""
        key = tuple(tuple(t.shape) for t in inputs)
        sub = self._shape_steps.get(key)
        if sub is None:
            if self.dp is not None:
                raise TypeError(f"a data-parallel step runs one compiled shape ({[list(s) for s, _ in self._example_types]}); "
                                f"got {[list(k) for k in key]}: compile a step per shape (all ranks alike)")
            budget = "unconstrained" if self.budget is None else f"budget {format_bytes(self.budget)}"
            self._announce(f"remat: new input shapes {', '.join(str(list(k)) for k in key)}: compiling a plan for "
                           f"them ({budget}, as for the first shapes); {len(self._shape_steps) + 1} shape(s) cached so far")
            try:
                sub = TrainStep(self.model, self._keywords(tuple(inputs)), self._loss_fn, self.optimizer, self.budget,
                                **self._options)
            except BudgetTooSmall:
                raise
            except Exception as e:  # noqa: BLE001  shapes the model cannot take (e.g. inputs and targets disagree)
                differ = "; ".join(
                    f"{self._arg_name(k)}: expected {dtype}{list(shape)} (as compiled), got {t.dtype}{list(t.shape)}"
                    for k, (t, (shape, dtype)) in enumerate(zip(inputs, self._example_types)) if tuple(t.shape) != shape)
                first = (str(e).strip().splitlines() or [""])[0]
                raise TypeError(f"the training step got other shapes ({differ}) and compiling a plan for them failed: "
                                f"{type(e).__name__}: {first}") from e
            self._shape_steps[key] = sub
        sub._step = self._step  # one step count (and dropout seed sequence) across shapes
        loss = sub(*inputs) if self._input_names is None else sub(**self._keywords(tuple(inputs)))
        self._step = sub._step
        return loss

    def shapes_cached(self) -> int:
        """How many input shapes have a compiled plan: the example's, and each other one met."""
        return 1 + len(self._shape_steps)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Parameters, buffers, optimizer state (this rank's shards under ZeRO) and step counts,
        with the metadata to reassemble shards (``remat.distributed.checkpoint``)."""
        from ..distributed.checkpoint import state_dict

        return state_dict(self)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same mode, world size and rank; training resumes identically."""
        from ..distributed.checkpoint import load_state_dict

        load_state_dict(self, sd)

    def _check_optimizer(self) -> None:
        lrs = {id(p): g["lr"] for g in self.optimizer.param_groups for p in g["params"]}
        for p, u in zip(self._params, self.updates):
            if lrs[id(p)] != u.attrs["lr"]:
                raise RuntimeError(f"the optimizer's learning rate changed from {u.attrs['lr']} to {lrs[id(p)]} after "
                                   "remat.compile; learning-rate schedules need a recompile (not supported yet)")

    # ------------------------------------------------------------------ report
    def report(self) -> Report:
        """What was planned, and measured on the last step (see :class:`Report` for the overheads)."""
        measured = self.last_stats.peak_bytes if self.last_stats is not None else None
        step_s = None if self.last_stats is None else self.last_stats.total_seconds
        overhead = None
        if not self._recomputes:
            overhead = 0.0  # the unconstrained program itself: nothing is recomputed
        elif step_s is not None and self.unconstrained_step_seconds:
            overhead = step_s / self.unconstrained_step_seconds - 1.0
        return Report(self.budget, self.predicted_peak, measured, self.unconstrained_peak, overhead,
                      self.predicted_overhead, self.solver, list(self.notes), self.plan_seconds, self.setup_seconds,
                      step_s, self.unconstrained_step_seconds, self.instructions, self.recomputed,
                      dict(self.stage_seconds), None if self.dp is None else self.dp.mode, self._memory(),
                      dict(self.recomputed_layers), self.workspace_bytes, self.predicted_allocator_peak,
                      self.measured_allocator_peak,
                      self.shapes_cached(), list(self.algorithm_choices), self.micro_batches,
                      self._example[0].shape[0] if self.micro_batches > 1 else None, self.predicted_seconds,
                      list(self.micro_batch_choice), self.imported.from_cache, self.channels_last)

    def _value_kinds(self) -> dict:
        """The kind of every value of the step program (``remat.distributed.memory.kinds``)."""
        from ..distributed.memory import kinds

        n_state = sum(len(ts) for ts in self._state_types) if self.updates else 0
        first = self.layout.n_args
        n_params = self.layout.n_params + len(self.imported.frozen_names)  # frozen ones are parameters too
        return kinds(self.program, n_params, range(first, first + n_state))

    def _memory(self) -> dict[str, int] | None:
        """Bytes by kind (parameters, gradients, optimizer state, ...) live at the peak: measured by
        the VM on the first step, predicted (the same bytes) before it."""
        from ..distributed.memory import KINDS

        if self.kind_stats is not None:
            split = self.kind_stats.at_peak
        else:
            from ..plan.liveness import simulate

            if len(self.program.blocks) != 1:
                return None
            split = simulate(self.program, kinds=self._kinds).by_kind.at_peak
        return {k: split[k] for k in KINDS + ("other",) if k in split}

    def measure_allocator_peak(self, *inputs) -> int:
        """The peak of PyTorch's allocator during one run of the step program on copies of the
        parameters, optimizer state and ``inputs`` (bytes; profiler memory events, arguments
        counted as the VM counts them). The model is not modified. Shown by ``report()``."""
        from ..runtime.allocator import measure_allocator_peak

        self._check_inputs(inputs)
        args = self._step_args(inputs, copy=True, step=1)
        self.measured_allocator_peak = measure_allocator_peak(self.program, args, self.dialects)
        return self.measured_allocator_peak


def compile(model, example_inputs: Sequence | Mapping, loss_fn: Callable | None = None, optimizer=None, budget=None,
            **options: Any) -> TrainStep:
    """Compile a training step of ``model`` (a vanilla ``torch.nn.Module``) under ``budget``.

    ``example_inputs``: the model's inputs followed by the loss's targets (shapes are fixed by them).
    ``loss_fn(output, *targets)``: the loss (omit it if the model returns the loss).
    Hugging Face conventions: ``example_inputs`` may be a dict of keyword inputs of the model
    (``dict(input_ids=x, labels=y)``; the step is then called with the same keywords). A model
    returning a ``ModelOutput`` or dict gives its own ``loss`` when ``loss_fn`` is None, else
    ``loss_fn`` is applied to its ``logits``; with keyword inputs, the loss's targets are the
    entries named after its parameters (``F.cross_entropy``: ``target=``).
    ``optimizer``: a ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` over ``model.parameters()``; its
    state tensors are updated in place. Without one, the step leaves gradients in ``.grad``.
    ``budget``: bytes, a size such as "1.5GiB", a percentage "40%" or a fraction in (0, 1] of
    the unconstrained peak; None plans no recomputation. Raises ``BudgetTooSmall`` with the
    minimum feasible budget; nothing of the model is modified by compiling.
    Options: ``cost_model`` ("static": deterministic estimates, the default; "profiled": measured
    per-instruction times), ``solver`` ("auto", "greedy", "milp"; "greedy" plans deterministically: no
    time-limited MILP, neither the whole one nor the one on the greedy's neighbourhood near the floor),
    ``dialects``, ``seed``, ``keep_grads``, ``num_targets``, ``milp_time_limit`` (seconds; also caps the
    neighbourhood MILP's 3 s), ``progress`` (a callable receiving stage names),
    ``print_after`` (a stage name of ``STAGES``, or several: print the IR after it; "plan" prints
    the planned step). ``step.report()`` gives each stage's seconds.
    ``data_parallel``: None (one process), "ddp", "zero1" or "zero2" (``remat.distributed``): inside an
    initialised ``torch.distributed`` process group, each rank passes its own shard of the batch and
    the budget is per rank; ``bucket_bytes`` sizes the gradient buckets (default ``remat.distributed.DEFAULT_BUCKET_BYTES``).
    ``count_workspaces`` (default True; budgeted steps only): kernels' own workspaces are measured once
    per kernel and shape (cached on disk) and planned for, so that PyTorch's allocator peak, not only
    the VM's exact count of IR values, stays within the budget; False: the budget bounds the VM's
    count only. ``measure_allocator`` (default True; budgeted steps only): the first step runs under
    torch.profiler and ``report()`` shows the allocator's measured peak beside the VM's
    (``step.measure_allocator_peak(x, y)`` measures on copies at any time). ``step.report()`` gives
    each stage's seconds, the VM's peak and the allocator's. ``algorithms`` ("auto", the default, or "reference"):
    under a budget no plan with the reference algorithms meets, "auto" plans the step with memory-lean
    algorithms (each language-model head's cross-entropy chunked, ``linear_cross_entropy``; attention with
    dropout without its score matrix, ``dropout_attention``); ``report().algorithms`` says what was chosen and why. Such a step's
    gradients equal the unconstrained step's up to summation order; "reference" keeps them bit-identical.
    ``layout`` ("auto", the default, or "NCHW"): "auto" runs a model's convolutions, and the pooling, batch
    norms and element-wise ops between them, channels-last (NHWC: faster kernels, smaller workspaces;
    ``remat.passes.layout``); values equal the NCHW step's up to summation order, and every budget
    plans the same layout. "NCHW" keeps the layout the model was captured in.
    ``micro_batches``: 1 (default: the whole batch at once), ``k`` (``k`` micro-batches of the batch
    with gradient accumulation in the step program; gradients equal the whole batch's up to
    summation order) or "auto" (the count chosen with recomputation: the least predicted step time
    that fits; ``report()`` lists each count tried). Refused (``MicroBatchingRefused``) for models
    with batch statistics or buffer updates, and for losses that are neither a mean nor a sum over
    samples (checked eagerly; ``loss_reduction="mean"|"sum"`` overrides the check).
    """
    if options.get("micro_batches") == "auto":
        from .microbatch import compile_auto

        return compile_auto(model, example_inputs, loss_fn, optimizer, budget,
                            **{k: v for k, v in options.items() if k != "micro_batches"})
    return TrainStep(model, example_inputs, loss_fn, optimizer, budget, **options)
