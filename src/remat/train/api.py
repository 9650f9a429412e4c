"""``remat.compile``: a vanilla PyTorch model, a loss and an optimizer in; a training step whose
measured peak memory stays within a byte budget out (RAF's 2–3 line change).

    step = remat.compile(model, (x, y), loss_fn, optimizer=torch.optim.AdamW(model.parameters()),
                         budget="1.5GiB")
    for x, y in loader:
        loss = step(x, y)
    print(step.report())

Compiling runs the stages of :mod:`remat.train.compilation` over one record; :class:`TrainStep`
is what runs the result.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import time
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from .._gc import cyclic_gc_paused
from ..errors import BudgetTooSmall, NonFiniteStep, StepFailed, format_bytes
from ..ir.ops.optim import UPDATE_OPS
from ..step.optim import advance_steps, current_state
from .against import Against, Watch
from .compilation import STAGES, Compilation, CompileOptions, compile_step  # noqa: F401  (STAGES: public)
from .microbatch import MicroBatchingRefused, batch_size
from .report import Report, precision_summary


_PROFILING = threading.Lock()  # one allocator measurement (torch.profiler session) at a time


MAX_VARIANTS = 16
"""Steps a step keeps compiled for other input shapes and model states besides its own (the least
recently used is dropped, and compiled again if it is met again): a value that changes at every
call (a loss reading a step counter) compiles at every call, announced, but does not fill memory."""


def _refuse_an_empty_batch(inputs: tuple) -> None:
    """ValueError, before anything runs or is compiled, for a batch of no samples (every tensor input's
    first dimension 0, as the last slice of a loader can be): a mean loss over it is NaN and there is
    nothing to learn from; the caller skips it."""
    import torch

    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0]
    if tensors and all(t.shape[0] == 0 for t in tensors):
        raise ValueError(f"the training step got an empty batch (inputs of shapes {[list(t.shape) for t in tensors]}: "
                         "no samples): nothing to train on, nothing was changed; skip empty batches in the loop")


class TrainStep:
    """A compiled training step. Call it with the inputs and targets; it runs forward, backward
    and the optimizer update on the model's own tensors and returns the loss.

    ``compilation``: the record the compile's stages filled (the captured module, the training graph,
    the planning problem, the plan, the program); ``binding``: the model's tensors and optimizer
    state as the program's arguments."""

    def __init__(self, compilation: Compilation):
        c = self.compilation = compilation
        self.model, self.optimizer, self.binding, self.signature = c.model, c.optimizer, c.binding, c.signature
        self.program, self.vm, self.budget, self.dp, self.dialects = c.program, c.vm, c.budget, c.dp, c.dialects
        self.device = c.placement  # the torch.device the step runs on (its model's), None: the CPU
        self.predicted_peak, self.unconstrained_peak = c.predicted_peak, c.unconstrained_peak
        self.updates, self.keep_grads, self.micro_batches = c.binding.updates, c.keep_grads, c.micro_batches
        self.setup_seconds = time.perf_counter() - c.started
        self.micro_batch_choice: list[str] = []  # micro_batches="auto": each count tried and why one won
        self.measured_allocator_peak: int | None = None  # profiler memory events of the first step (or on copies)
        self.last_stats = None
        # Bytes by kind (parameters, gradients, optimizer state, ...) as the VM measured them on this
        # step's first run (RunStats.by_kind; later runs record the peak only, to stay lean: the
        # program and so the split are the same at every step).
        self.kind_stats = None
        self.last_seconds: float | None = None
        self._variants: dict[tuple, TrainStep] = {}  # steps compiled for other input shapes or model states
        self._watch = Watch(c.model, "cpu" if self.device is None else self.device.type, c.loss_fn)
        self._against = self._watch.now(c.options.precision)  # what this step was compiled against
        self.skipped_steps = 0  # steps the non-finite guard skipped (on_nonfinite="skip")
        self._minimum: int | None = None  # minimum_budget(), once computed

    # ------------------------------------------------------------------ run
    def __call__(self, *inputs, **keyword_inputs):
        """One training step on ``inputs`` (model inputs then targets, or the keywords compiled
        with); returns the loss (a 0-d tensor). Other sizes of the same dtypes and ranks compile
        (once) a plan of their own under the same budget, and so does a model changed since compile
        (``model.eval()``, a replaced, frozen or unfrozen parameter, another dtype, a caller's
        ``torch.autocast``: :class:`~remat.train.against.Against`), announced once: a step never
        runs stale.

        Atomic for bad arguments and out-of-range indices (class targets, token ids): they raise
        before anything is written, so parameters, gradients, buffers and ``optimizer.state_dict()``
        stay exactly as they were, also on the first call (the optimizer's state is registered only
        after a step succeeded). The program places no in-place update before the first check of
        each index value (``step.program.last_new_index_check``); a kernel failing after the first
        update (out of memory in the backward, say) is the one case that leaves updates applied.

        With ``on_nonfinite="skip"`` a NaN or infinite loss or gradient skips the step as
        ``torch.amp.GradScaler`` does: no parameter, optimizer state, step count or buffer changes, the
        loss is returned and ``report().skipped_steps`` counts it ("skip"), or ``NonFiniteStep`` is
        raised ("raise")."""
        if self.compilation.options.dry_run:
            from .dry_run import refuse

            refuse("run")
        inputs = self.signature.positional(inputs, keyword_inputs)
        _refuse_an_empty_batch(inputs)
        now = self._watch.now(self.compilation.options.precision)
        if now != self._against or self.signature.other_shapes(inputs):
            return self._call_variant(inputs, now)
        return self._run(inputs)

    def _run(self, inputs: tuple):
        import torch

        b = self.binding
        self.signature.check(inputs)
        opt_step, state = b.calls, None
        if self.updates:
            b.check_optimizer()
            # The optimizer's own step count and state (it may also have been stepped eagerly).
            opt_step = b.optimizer_steps()
            if self.dp is None or not self.dp.shards_state:
                state = current_state(self.optimizer, b.params, self.updates, b.state)
        rng = torch.get_rng_state() if b.imported.has_seed and b.seed is None else None
        args = b.step_args(inputs, copy=False, step=opt_step + 1, state=state, seed=b.next_seed())
        t0 = time.perf_counter()
        by_kind = self.kind_stats is None
        if (self.measured_allocator_peak is None and self.budget is not None and self.compilation.options.measure_allocator
                and threading.current_thread() is threading.main_thread()  # torch.profiler: one thread, the main one
                and not torch._C._autograd._profiler_enabled()  # a profiler of the caller's: not nested
                and _PROFILING.acquire(blocking=False)):
            try:
                outs, stats = self._run_measuring_allocator(args, by_kind)
            finally:
                _PROFILING.release()
        else:
            try:
                where = "cpu" if self.device is None else self.device.type
                # The run makes and drops a few hundred small objects (results, the VM's counts) and
                # no reference cycles; with the cyclic collector on, they trigger young collections
                # that walk them while they are still live (zoo U-Net bf16: 1% of its step at one thread,
                # 0.5% at two).
                # The precision is the program's: a caller's autocast is off while it runs.
                autocast_off = (torch.autocast(where, enabled=False) if torch.is_autocast_enabled(where)
                                else contextlib.nullcontext())
                with cyclic_gc_paused(), autocast_off:
                    outs, stats = self.vm.run(self.program.name, *args, outputs="torch", record="peak", by_kind=by_kind)
            except BaseException as e:
                if rng is not None:  # a failed step draws nothing: torch's generator as before
                    torch.set_rng_state(rng)
                failed = self._failed(e, args) if isinstance(e, Exception) else None
                if failed is None:
                    peer = self._collective_failed(e)
                    if peer is not None:
                        raise peer from e
                    raise
                raise failed from e
        skipped = self.compilation.guarded and bool(outs[-1])  # the guard's flag: nothing was updated
        if b.loss_scaled:  # fp16: GradScaler's backoff or growth
            b.next_loss_scale(skipped)
        if state is not None and not skipped:  # the step succeeded: now the optimizer owns the state it updated
            b.bind_state(state)
        self.last_seconds = time.perf_counter() - t0
        self.last_stats = stats
        if stats.by_kind is not None:
            self.kind_stats = stats.by_kind
        b.calls += 1
        if skipped:
            return self._skipped(outs[0], opt_step + 1)
        b.put_results(outs, args, self.keep_grads)
        if self.dp is not None and self.dp.shards_state:
            self.dp.steps += 1
        elif self.updates:
            advance_steps(self.optimizer, b.params, self.updates)
        if self.updates:
            self.optimizer._opt_called = True  # as optimizer.step() records it: LR schedulers see the step taken
        return outs[0]

    def _failed(self, e: Exception, args: list) -> StepFailed | None:
        """``e``, raised by a kernel during the step, as a :class:`StepFailed` naming the parameters
        whose in-place update had already run, or, compiled with ``atomic=True``, after rolling them
        back from the step's backups (None: keep ``e`` as it is: an index out of range before any
        update, the caller's data as in eager PyTorch, or a run that did not say where it failed)."""
        at = getattr(e, "remat_instruction", None)
        if at is None or (self.dp is not None and self.dp.shards_state):
            return None
        instrs = self.vm.instructions(self.program.name)
        position = {id(p): k for k, p in enumerate(self.vm.function(self.program.name).params)}
        names = self.binding.imported.param_names
        updated: list[int] = []
        for ins in instrs[:at + 1]:  # the failing one too when it is an update: it may have written part
            if ins.op.name in UPDATE_OPS:
                k = position.get(id(ins.operands[0]))
                if k is not None and k < len(names):
                    updated.append(k)
        if not updated and isinstance(e, IndexError):
            return None
        restored = bool(self.binding.backups) and bool(updated)
        if restored:
            self.binding.restore(args, updated)
        first = (str(e).strip().splitlines() or [""])[0]
        return StepFailed(self.binding.calls + 1, at, f"{type(e).__name__}: {first}",
                          [] if restored else [names[k] for k in updated], len(self.updates or ()),
                          restored=[names[k] for k in updated] if restored else [])

    def _collective_failed(self, e: BaseException) -> RuntimeError | None:
        """A data-parallel step's collective that failed, as an error saying what it most likely
        means (None for any other failure): a peer left the step (it refused a change made on it
        alone, or failed), since the ranks run one program in lockstep."""
        at = getattr(e, "remat_instruction", None)
        if self.dp is None or at is None:
            return None
        from ..ir.ops.collective import COLLECTIVES

        ins = self.vm.instructions(self.program.name)[at]
        if ins.op.name not in COLLECTIVES:
            return None
        first = (str(e).strip().splitlines() or [""])[0]
        return RuntimeError(f"rank {self.dp.rank} of {self.dp.world}: the collective {ins.op.name} of step "
                            f"{self.binding.calls + 1} failed ({type(e).__name__}: {first[:300]}); another rank most "
                            "likely left the step: it raised (its own error says why: a model, a loss or input shapes "
                            "changed on that rank alone are refused) or stopped. All ranks must call the same "
                            "compiled step with the same changes.")

    def _skipped(self, loss, step: int):
        """A step the non-finite guard skipped: counted and its loss returned, or NonFiniteStep raised.
        Nothing is written back (buffers, ``.grad``), and the optimizer's step count stays."""
        if self.binding.loss_scaled:  # fp16: an overflow at this scale, as GradScaler skips it (the scale is halved)
            self.skipped_steps += 1
            return loss
        if self.compilation.options.on_nonfinite == "raise":
            raise NonFiniteStep(step, self.binding.calls, float(loss))
        if not self.skipped_steps:
            warnings.warn(f"remat: training step {self.binding.calls} skipped: its loss ({float(loss)}) or a gradient "
                          "is not finite, so nothing was updated (as torch.amp.GradScaler skips a step); "
                          "report().skipped_steps counts such steps, on_nonfinite='raise' raises instead",
                          RuntimeWarning, stacklevel=3)
        self.skipped_steps += 1
        return loss

    def _run_measuring_allocator(self, args: list, by_kind: bool = False) -> tuple:
        """One run of the step under torch.profiler's memory events: the allocator's measured
        peak (arguments counted as the VM counts them) for ``report()``. Budgeted steps do this on
        their first call only (``measure_allocator=False``: never), and not inside a profiler the
        caller runs, nor from a thread other than the main one (torch.profiler crashes when threads
        start it concurrently): the next call on the main thread measures then."""
        from ..runtime.allocator import allocation_trace, device_allocation, peak_of_trace

        vm = self.vm
        args = vm.arguments(self.program.name, *args)  # the step's own copies of its inputs: not the run's allocations
        run = lambda: vm.run(self.program.name, *args, outputs="torch", record="peak", by_kind=by_kind)  # noqa: E731
        if self.device is not None:  # the device allocator's own peak statistic
            (outs, stats), grown = device_allocation(run, self.device)
        else:
            (outs, stats), events = allocation_trace(run)
            grown = peak_of_trace(events)[0]
        self.measured_allocator_peak = sum(p.type.nbytes for p in self.program.params) + grown
        return outs, stats

    def _call_variant(self, inputs: tuple, now: Against):
        """One step on inputs of other shapes, or on a model changed since compile: with the step
        cached for them, compiled on first sight under the same byte budget (the model, optimizer and
        options are this step's; the precision the caller's autocast asks for)."""
        key = (tuple(tuple(t.shape) for t in inputs), now)
        sub = self._variants.pop(key, None)
        if sub is not None:
            self._variants[key] = sub  # the most recently used last
        else:
            changed = self._against.changes(now, self._watch)
            if self.signature.other_shapes(inputs):
                changed.insert(0, "new input shapes " + ", ".join(str(list(k)) for k in key[0]))
            what = "; ".join(changed)
            if self.dp is not None:
                raise TypeError(f"a data-parallel step runs as compiled ({[list(s) for s, _ in self.signature.types]}"
                                f" and the model as it was); got {what}: compile a step for it (all ranks alike)")
            budget = "unconstrained" if self.budget is None else f"budget {format_bytes(self.budget)}"
            c = self.compilation
            (c.options.progress or _announce)(f"remat: {what}: compiling a step for it ({budget}, as before); "
                                              f"{len(self._variants) + 1} step(s) kept before it")
            try:
                sub = TrainStep(compile_step(self.model, self.signature.keywords(tuple(inputs)), c.loss_fn,
                                             self.optimizer, self.budget,
                                             replace(c.options, full_batch_peak=None, precision=now.precision)))
            except BudgetTooSmall:
                raise
            except Exception as e:  # noqa: BLE001  shapes the model cannot take (e.g. inputs and targets disagree)
                eager = getattr(e, "eager_error", None)  # a CaptureError: the model's own error comes first
                first = (f"the model itself raises on them when run eagerly: {eager}" if eager
                         else (str(e).strip().splitlines() or [""])[0])
                differ = self.signature.differences(inputs)
                raise TypeError(f"the training step got {what}{f' ({differ})' if differ else ''} and compiling a "
                                f"step for it failed: {type(e).__name__}: {first}") from e
            self._variants[key] = sub
            while len(self._variants) > MAX_VARIANTS:  # the least recently used goes
                self._variants.pop(next(iter(self._variants)))
        # One step count (and dropout seed sequence) and one fp16 loss scale across variants.
        sub.binding.calls = self.binding.calls
        if sub.binding.loss_scaled and self.binding.loss_scaled:
            sub.binding.loss_scale, sub.binding.growth_tracker = self.binding.loss_scale, self.binding.growth_tracker
        try:
            return sub._run(inputs)
        finally:
            self.binding.calls = sub.binding.calls
            if sub.binding.loss_scaled and self.binding.loss_scaled:
                self.binding.loss_scale, self.binding.growth_tracker = sub.binding.loss_scale, sub.binding.growth_tracker

    @property
    def loss_scale(self) -> float | None:
        """fp16: the dynamic loss scale the next step uses (``torch.amp.GradScaler``'s: 2**16 at first,
        halved after a step whose gradients overflowed, which is skipped, doubled after 2000 steps in a
        row that did not); None in other precisions. Settable (a scaler's ``init_scale``): setting it
        also restarts the count of steps without overflow (``GradScaler.update(new_scale)`` keeps its
        count); a resume restores both with :meth:`load_state_dict`."""
        return self.binding.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        if self.binding.loss_scale is None:
            raise ValueError("loss_scale: only a step compiled with precision='fp16' scales its loss")
        if not (isinstance(value, (int, float)) and value > 0 and value != float("inf")):
            raise ValueError(f"loss_scale must be a positive finite number, got {value!r}")
        self.binding.loss_scale = float(value)
        self.binding.growth_tracker = 0

    def shapes_cached(self) -> int:
        """How many compiled steps this one holds: the example's, and one for each other input
        shape or model state met."""
        return 1 + len(self._variants)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Parameters, buffers, optimizer state (this rank's shards under ZeRO) and step counts,
        with the metadata to reassemble shards (``remat.distributed.checkpoint``)."""
        from ..distributed.checkpoint import state_dict

        return state_dict(self.binding)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same mode, world size and rank; training resumes identically."""
        from ..distributed.checkpoint import load_state_dict

        load_state_dict(self.binding, sd)

    # ------------------------------------------------------------------ report
    def report(self) -> Report:
        """What was planned, and measured on the last step (see :class:`Report` for the overheads)."""
        c, stats = self.compilation, self.last_stats
        step_s = None if stats is None else stats.total_seconds
        overhead = measured_s = None
        if c.runs_unconstrained:
            overhead = measured_s = 0.0  # the unconstrained program itself: nothing is recomputed
        elif step_s is not None and c.unconstrained_step_seconds:
            overhead = step_s / c.unconstrained_step_seconds - 1.0
            measured_s = step_s - c.unconstrained_step_seconds
        predicted_s, predicted_overhead = c.predicted_recompute()
        report = Report(
            budget=c.budget, predicted_peak=c.predicted_peak, measured_peak=None if stats is None else stats.peak_bytes,
            unconstrained_peak=c.unconstrained_peak, overhead=overhead, predicted_overhead=predicted_overhead,
            predicted_recompute_seconds=predicted_s, measured_recompute_seconds=measured_s,
            solver=c.plan.solver, solver_notes=list(c.notes), plan_seconds=c.stage_seconds["plan"],
            setup_seconds=self.setup_seconds, step_seconds=step_s,
            unconstrained_step_seconds=c.unconstrained_step_seconds, instructions=c.instructions,
            recomputed_instructions=c.recomputed, stage_seconds=dict(c.stage_seconds),
            data_parallel=None if c.dp is None else c.dp.mode, memory=self._memory(),
            recomputed_layers=dict(c.recomputed_layers), workspace_bytes=c.workspace_bytes,
            predicted_allocator_peak=c.predicted_allocator_peak, measured_allocator_peak=self.measured_allocator_peak,
            shapes_cached=self.shapes_cached(), algorithms=list(c.plan.algorithms), micro_batches=c.micro_batches,
            batch_size=c.signature.example[0].shape[0] if c.micro_batches > 1 else None,
            predicted_step_seconds=c.predicted_seconds, micro_batch_choice=list(self.micro_batch_choice),
            capture_cached=c.imported.from_cache, channels_last=c.channels_last, precision=c.options.precision,
            precision_note=c.precision_note,
            weights=_weights_dtype(self.binding.params),
            on_nonfinite=c.options.on_nonfinite if c.guarded else None, loss_scale=self.binding.loss_scale,
            clip_strategy=c.clip_strategy, priced_by=_priced_by(c.options),
            skipped_steps=self.skipped_steps + sum(s.skipped_steps for s in self._variants.values()),
            **dict(zip(("low_precision_ops", "casts", "cast_bytes"), precision_summary(self.program))))
        if c.options.dry_run:
            from .dry_run import dry_report

            return dry_report(report, c, self.minimum_budget())
        return report

    # ------------------------------------------------------------------ dry runs
    def minimum_budget(self) -> int:
        """The smallest budget (bytes) a plan of this step fits, as a refusal (``BudgetTooSmall.minimum``)
        reports it (computed once: a bounded search about as long as a plan). A dry run's report has it."""
        if self._minimum is None:
            from .compilation import minimum_budget

            self._minimum = minimum_budget(self.compilation)
        return self._minimum

    def curve(self, budgets=None, n_points: int = 10) -> list:
        """Budgets from the minimum to the unconstrained peak (or ``budgets``), each planned, nothing run
        (:func:`remat.train.dry_run.curve`)."""
        from .dry_run import curve

        return curve(self.compilation, self.minimum_budget(), budgets, n_points)

    def _memory(self) -> dict[str, int] | None:
        """Bytes by kind (parameters, gradients, optimizer state, ...) live at the peak: measured by
        the VM on the first step, predicted (the same bytes) before it."""
        from ..distributed.memory import KINDS

        if self.kind_stats is not None:
            split = self.kind_stats.at_peak
        else:
            from ..plan.simulator import simulate

            if len(self.program.blocks) != 1:
                return None
            split = simulate(self.program, kinds=self.compilation.kinds).by_kind.at_peak
        return {k: split[k] for k in KINDS + ("other",) if k in split}

    def measure_allocator_peak(self, *inputs) -> int:
        """The peak of PyTorch's allocator during one run of the step program on copies of the
        parameters, optimizer state and ``inputs`` (bytes; profiler memory events, arguments
        counted as the VM counts them). The model is not modified. Shown by ``report()``."""
        from ..runtime.allocator import measure_allocator_peak

        if self.compilation.options.dry_run:
            from .dry_run import refuse

            refuse("measure the allocator")
        self.signature.check(inputs)
        args = self.binding.step_args(inputs, copy=True, step=1)
        self.measured_allocator_peak = measure_allocator_peak(self.program, args, self.dialects, self.device)
        return self.measured_allocator_peak


def _priced_by(options) -> str:
    """What the report's predicted seconds are: measured (``cost_model="profiled"``), or the rates the
    static cost model prices on (the nominal CPU's, or the named device's), not this machine's."""
    if options.cost_model == "profiled":
        return "measured"
    spec = options.device_spec
    return "nominal CPU" if spec is None or spec.name == "cpu" else spec.name


def _weights_dtype(params) -> str:
    """The parameters' floating dtype as the report names it ("fp32", "bf16", ...; the most common one)."""
    from collections import Counter

    names = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}
    counts = Counter(str(p.dtype) for p in params if p.dtype.is_floating_point)
    return names.get(counts.most_common(1)[0][0], "fp32") if counts else "fp32"


def _announce(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def compile(model, example_inputs: Sequence | Mapping, loss_fn: Callable | None = None, optimizer=None, budget=None,
            **options: Any) -> TrainStep:
    """Compile a training step of ``model`` (a vanilla ``torch.nn.Module``) under ``budget``.

    ``example_inputs``: the model's inputs followed by the loss's targets (shapes are fixed by them).
    ``loss_fn(output, *targets)``: the loss (omit it if the model returns the loss).
    Hugging Face conventions: ``example_inputs`` may be a dict of keyword inputs of the model
    (``dict(input_ids=x, labels=y)``; the step is then called with the same keywords). A model
    returning a ``ModelOutput`` or dict gives its own ``loss`` when ``loss_fn`` is None, else
    ``loss_fn`` is applied to its ``logits`` (without ``logits``, to the output itself, as eagerly:
    diffusers' ``out.sample``); with keyword inputs, the loss's targets are the
    entries named after its parameters (``F.cross_entropy``: ``target=``).
    ``optimizer``: a ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` over ``model.parameters()``; its
    state tensors are updated in place. Without one, the step leaves gradients in ``.grad``.
    ``budget``: bytes, a size such as "1.5GiB", a percentage "40%" or a fraction in (0, 1] of
    the unconstrained peak; None plans no recomputation. Raises ``BudgetTooSmall`` with the
    minimum feasible budget; nothing of the model is modified by compiling.
    Options: ``cost_model`` ("static": deterministic estimates, the default; "profiled": measured
    per-instruction times), ``solver`` ("auto", "greedy", "milp"; "greedy" plans deterministically: no
    time-limited MILP, neither the whole one nor the one on the greedy's neighbourhood near the floor),
    ``dialects``, ``seed`` (None: each step draws its dropout seed from torch's global generator, as
    eager dropout does; an int: the step's own sequence ``seed + calls``), ``keep_grads``, ``num_targets``, ``milp_time_limit`` (seconds; also caps the
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
    ``on_nonfinite`` ("skip", the default; "raise"; None), with an optimizer: the non-finite guard. A
    step whose loss has a NaN or infinite element changes nothing, as ``torch.amp.GradScaler`` skips
    it: parameters, optimizer state (``exp_avg``, ``exp_avg_sq``, momentum buffers, ``step``),
    buffers and ``.grad`` stay bit-identical, and the next step trains as if it had not happened.
    "skip" returns its loss, counts it in ``report().skipped_steps`` and warns once; "raise" raises
    ``remat.NonFiniteStep`` naming the step; None does not check. Checking the loss costs nothing
    (it is known before the first gradient). ``check_gradients=True`` checks every gradient too:
    then no update can follow its own gradient (a NaN in the last gradient must stop the first
    update), so every gradient is kept until all are known finite, which can raise the budget's floor
    (GPT small's minimum budget by 20%); None (the default) checks them only where they are all kept
    anyway (``max_grad_norm``, micro-batches). Data-parallel ranks agree on the flag (one scalar
    all_reduce): all skip, or none.
    ``atomic`` (default False), with an optimizer: keep a backup of each parameter and its optimizer
    state from just before its update (their bytes are program arguments: planned into the budget),
    so that a kernel failing midway (``remat.StepFailed``) rolls the updated ones back and leaves
    everything as before the step; without it the error names the parameters already updated.
    ``max_grad_norm``: clip the gradients by their global norm inside the fused update, as
    ``torch.nn.utils.clip_grad_norm_`` does (needs ``optimizer=``). The norm needs every gradient
    before any update: the planner keeps them all until it is known, or, where that does not fit the
    budget or is slower, runs a second backward (a norm pass that drops each gradient once its squares
    are summed, then the step; the same bits either way); ``report().clip_strategy`` says which, and
    ``clip_strategy="keep gradients"`` or ``"second backward"`` imposes one (default "auto"). The
    fused update reads each param group's hyperparameters at every call, so learning-rate schedules
    work unchanged.
    ``precision`` ("fp32", the default, "bf16" or "fp16"): "bf16" captures the forward and the loss under
    ``torch.autocast`` in bfloat16 (matmuls, convolutions and attention in bf16; norms, softmax and
    losses in fp32; parameters stay fp32 master weights); the casts are instructions the planner
    counts, and the budget counts bf16 activations at their real size. "fp16": the same in float16,
    with dynamic loss scaling as ``torch.amp.GradScaler`` does it (needs ``optimizer=``, one process
    and ``micro_batches=1``; ``step.loss_scale`` reads or sets the scale).
    ``dry_run`` (default False): plan without running (``remat.train.dry_run``): the model, optimizer and
    inputs may be on the ``meta`` device or fake tensors; the step is captured, differentiated, planned and
    lowered as here, nothing is executed, and the step's ``report()`` (with ``minimum_budget()`` and
    ``curve()``) says what a real step would do, but calling it raises ``remat.DryRunStep``. ``device`` (a name of ``remat.DEVICES``, a ``remat.DeviceSpec`` or a dict of its
    fields): the static cost model prices instructions on that device (roofline), and without ``budget``
    its memory is the budget.
    """
    opts = CompileOptions.of(options)
    if opts.micro_batches == "auto":
        return compile_auto(model, example_inputs, loss_fn, optimizer, budget, opts)
    return TrainStep(compile_step(model, example_inputs, loss_fn, optimizer, budget, opts))


def compile_auto(model, example_inputs, loss_fn, optimizer, budget, options: CompileOptions) -> TrainStep:
    """``remat.compile(..., micro_batches="auto")``: the micro-batch count chosen with recomputation.

    For each ``k`` dividing the batch, in increasing order, a step is planned (``k = 1`` is the
    whole batch); among those that fit the budget the one with the least predicted whole-step
    time wins. The search stops at a ``k`` whose plan recomputes nothing, or whose step without
    recomputation already costs more than the best found (more micro-batches only add per-op
    cost). Raises ``BudgetTooSmall`` with the smallest minimum over every ``k`` tried."""
    from ..frontend.torch_import import keyword_inputs

    if budget is None:
        return TrainStep(compile_step(model, example_inputs, loss_fn, optimizer, budget, replace(options, micro_batches=1)))
    _, tensors, _ = keyword_inputs(example_inputs, loss_fn, options.num_targets)
    n = batch_size(tensors)
    ks = [1] if n is None or options.data_parallel else [d for d in range(1, n + 1) if n % d == 0]
    lines: list[str] = []
    best: TrainStep | None = None
    first_error: BudgetTooSmall | None = None
    minimums: list[int] = []
    infeasible: list[int] = []
    ref: int | None = None
    for k in ks:
        try:
            c = compile_step(model, example_inputs, loss_fn, optimizer, budget,
                             replace(options, micro_batches=k, full_batch_peak=ref))
        except BudgetTooSmall as e:
            first_error = first_error or e
            minimums.append(e.minimum)
            infeasible.append(k)
            ref = ref if ref is not None else e.unconstrained_peak
            lines.append(f"k={k}: infeasible (needs at least {format_bytes(e.minimum)})")
            continue
        except MicroBatchingRefused as e:
            lines.append(f"k={k}: refused: {e}")
            break
        ref = c.unconstrained_peak
        lines.append(f"k={k}: peak {format_bytes(c.predicted_peak)} ({c.unconstrained_peak - c.predicted_peak:,} B "
                     f"below the whole batch's unconstrained peak), predicted step {c.predicted_seconds * 1e3:.1f} ms, "
                     f"recompute overhead {c.plan.overhead:+.1%} ({c.plan.solver})")
        if best is None or c.predicted_seconds < best.compilation.predicted_seconds:
            best = TrainStep(c)
        if not c.recomputes or c.unconstrained_predicted_seconds >= best.compilation.predicted_seconds:
            break
    if best is None:
        refused = [ln for ln in lines if "refused" in ln]
        raise BudgetTooSmall(first_error.budget, min(minimums), "this training step at any micro-batch count tried",
                             detail=f"micro-batch counts tried: {', '.join(map(str, infeasible))}"
                             + (f"; {refused[0]}" if refused else ""),
                             unconstrained_peak=ref) from first_error  # of the whole batch
    best.micro_batch_choice = lines + [f"chose k={best.micro_batches}: the least predicted step time that fits"]
    return best
