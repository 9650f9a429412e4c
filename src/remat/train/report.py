"""What a compiled step planned and measured: :class:`Report`, what ``step.report()`` returns."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import format_bytes
from ..ir import Function


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

    Overheads are fractions of the unconstrained step (0.1 = +10%), predicted and measured alike.
    ``predicted_overhead``: ``predicted_recompute_seconds`` (the planned step's seconds on the cost
    model less the unconstrained step's: recomputation, and a lean algorithm's own cost) over the
    unconstrained step's (``predicted_step_seconds`` less it). With ``cost_model="profiled"`` both
    programs are priced as they run (fused, every instruction measured), so it compares with the
    measured one. ``overhead`` (measured): the last step's time over the unconstrained step
    program's measured time, minus 1 (``measured_recompute_seconds``: their difference); exactly 0
    when nothing is recomputed (the program is the unconstrained one), and None when there is no
    unconstrained measurement (the static cost model runs nothing at compile time). The planner's
    notes give overheads over the joint's compute alone (forward and backward, no updates)."""

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
    precision: str = "fp32"      # the ``precision`` option
    precision_note: str | None = None  # where the processor lacks native bf16/fp16 (remat.runtime.hardware)
    weights: str = "fp32"        # the parameters' dtype (fp32: master weights under bf16/fp16 autocast)
    low_precision_ops: dict[str, int] = field(default_factory=dict)  # op -> instructions computing in bf16/f16
    priced_by: str = "measured"  # what predicted seconds are: "measured" (cost_model="profiled"), or whose rates
                                 # the static cost model priced them at ("nominal CPU", or a named device)
    casts: int = 0               # dtype casts in the program (mixed precision), and the bytes they produce
    cast_bytes: int = 0
    on_nonfinite: str | None = None  # the non-finite guard ("skip", "raise"; None: unguarded or no optimizer)
    skipped_steps: int = 0       # steps the guard skipped (a NaN or infinite loss or gradient): nothing updated
    loss_scale: float | None = None  # fp16: the dynamic loss scale the next step uses (GradScaler's)
    dry_run: bool = False        # planned without running (``dry_run=True``): nothing measured
    device: str | None = None    # the device the cost model priced (``device=``), None: the nominal CPU
    minimum_budget: int | None = None  # the smallest budget a plan fits (dry runs: always computed)
    predicted_recompute_seconds: float | None = None  # the plan's step minus the unconstrained step, on the cost model
    measured_recompute_seconds: float | None = None   # the last step minus the unconstrained step, measured
    device_peak: int | None = None  # the predicted peak with every storage rounded to the device allocator's granularity
    clip_strategy: str | None = None  # max_grad_norm: "keep gradients" or "second backward" (the notes say why, what it cost)

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
            ("precision", self.precision if self.precision == "fp32" else
             f"{self.precision} (torch.autocast's op lists; "
             + ("fp32 master weights" if self.weights == "fp32" else f"{self.weights} weights") + "): "
             + (", ".join(f"{op} {n}" for op, n in self.low_precision_ops.items()) or "no op")
             + f" in {self.precision}; {self.casts} casts making {format_bytes(self.cast_bytes)}"
             + (f"; {self.precision_note}" if self.precision_note else "")),
            ("non-finite guard", "off" if self.on_nonfinite is None else
             f"{self.on_nonfinite}: {self.skipped_steps} step(s) skipped (a NaN or infinite loss or gradient)"),
            *([("gradient clipping", f"{self.clip_strategy} (the notes say why and what it costs)")]
              if self.clip_strategy is not None else []),
            *([("loss scale", f"{self.loss_scale:g} (dynamic, as torch.amp.GradScaler; {self.skipped_steps} "
                              "overflowed step(s) skipped)")] if self.loss_scale is not None else []),
            ("recomputed instructions", f"{self.recomputed_instructions} of {self.instructions}"),
            ("recomputed layers", ", ".join(f"{p or '(top level)'} ({n})" for p, n in self.recomputed_layers.items())
             or "-"),
            ("predicted recompute overhead", f"{self.predicted_overhead:+.1%}" + _seconds(
                self.predicted_recompute_seconds, self.predicted_step_seconds, "predicted",
                None if self.priced_by == "measured" else f"static cost model at {self.priced_by} rates")),
            ("measured step overhead", "- (no unconstrained measurement)" if self.overhead is None
             else f"{self.overhead:+.1%}" + _seconds(self.measured_recompute_seconds, self.step_seconds, "measured")),
            ("step time (last)", "-" if self.step_seconds is None else f"{self.step_seconds * 1e3:.1f} ms"),
            ("unconstrained step time (profiled)", "-" if self.unconstrained_step_seconds is None
             else f"{self.unconstrained_step_seconds * 1e3:.1f} ms"),
            ("setup time", f"{self.setup_seconds:.2f} s: " + ", ".join(
                f"{k} {v:.2f} s" + (" (capture cache)" if k == "capture" and self.capture_cached else "")
                for k, v in self.stage_seconds.items())),
        ]
        if self.dry_run:
            rows = [r for r in rows if not r[0].startswith(("measured", "step time", "allocator peak: measured",
                                                            "unconstrained step time"))]
            rows[2:2] = [("minimum feasible budget", b(self.minimum_budget)),
                         ("device", self.device or "nominal CPU (static cost model)"),
                         ("peak, allocator granularity", b(self.device_peak)),
                         ("predicted step time", "-" if self.predicted_step_seconds is None
                          else f"{self.predicted_step_seconds * 1e3:.2f} ms, of which recomputation "
                          f"{(self.predicted_recompute_seconds or 0.0) * 1e3:.2f} ms")]
        w = max(len(k) for k, _ in rows)
        lines = ["remat training step" + (" (dry run: planned, not run)" if self.dry_run else ""), "-" * (w + 40)] + [f"{k:<{w}}  {v}" for k, v in rows]
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
        notes = [n for n in self.solver_notes if not n.startswith("algorithm choice: ")]
        if any("predicted overhead" in n for n in notes):
            notes.insert(0, "the planners' predicted overheads below are over the forward and backward they plan; "
                            "'predicted recompute overhead' above is over the whole unconstrained step")
        lines += [f"  note: {n}" for n in notes]
        return "\n".join(lines)


def _seconds(recompute: float | None, step: float | None, what: str, rates: str | None = None) -> str:
    """`` (+x ms on a y ms <what> unconstrained step[, <rates>])``: an overhead's seconds and the
    unconstrained step's (``step`` less them), or nothing when unknown; ``rates`` says what seconds
    they are when not this machine's (the static cost model's)."""
    if recompute is None or step is None:
        return ""
    return (f" ({recompute * 1e3:+.2f} ms on a {(step - recompute) * 1e3:.1f} ms {what} unconstrained step"
            + ("" if rates is None else f", {rates}") + ")")


COMPUTE_OPS = ("matmul", "linear", "conv2d", "conv2d_input_grad", "conv2d_weight_grad", "conv2d_grads", "attention",
               "attention_grad")
"""The op classes whose precision the report lists (those torch.autocast runs in low precision)."""


def precision_summary(fn: Function) -> tuple[dict[str, int], int, int]:
    """(op -> instructions of :data:`COMPUTE_OPS` computing in bf16/f16, casts, bytes the casts produce)."""
    low: dict[str, int] = {}
    casts = cast_bytes = 0
    for ins in fn.instructions():
        if ins.op.name == "cast":
            casts += 1
            cast_bytes += ins.results[0].type.nbytes
        elif ins.op.name in COMPUTE_OPS and ins.results and ins.results[0].type.dtype.name in ("bf16", "f16"):
            low[ins.op.name] = low.get(ins.op.name, 0) + 1
    return low, casts, cast_bytes
