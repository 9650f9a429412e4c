"""The one cost model of planning: seconds per instruction, and the overhead of a program.

:func:`static_costs` estimates each instruction from its arithmetic and memory traffic. Plans made
with it are deterministic (the same model and budget give the same plan on any machine), unlike
plans made from measured timings. Rates are nominal CPU figures unless a device is named
(:func:`priced_on` a :class:`~remat.plan.device.DeviceSpec`: a roofline on its rates, so plans for
different devices can differ); only ratios between instructions matter to the planners. :class:`CostModel` prices any program of one step from those per-instruction
seconds (static or measured), so every planner's plan is scored the same way (:func:`program_overhead`); in
a profiled compile, instructions its measured runs lack are measured alone, once per signature
(:class:`MeasuredSignatures`), not estimated.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Mapping, Sequence

from ..ir import Function, Instruction
from .device import DeviceSpec

FLOPS_PER_SECOND = 2e10   # nominal sustained arithmetic rate
BYTES_PER_SECOND = 1e10   # nominal memory bandwidth
OVERHEAD_SECONDS = 2e-6   # per-instruction dispatch
SLICE_COST = 0.5          # per further slice of an instruction computed over ``chunks``: this fraction of the whole call again
"""An instruction computed over ``chunks`` slices of its batch costs its whole-batch estimate times
``1 + SLICE_COST * (chunks - 1)``: each further slice runs all of the kernel's operations again, on a
fraction of the data. Measured on the explicit bf16 attention kernels on a 2-core CPU (AVX-512 BF16),
2 to 8 slices of Swin's, ViT's and short-sequence language models' shapes (16-65 queries per head):
+5% to +67% of the whole call per further slice, forward and backward, the smaller calls the dearer
(two slices of ViT's forward ran faster than one). Priced toward the top, so that slices are chosen
where they save recomputation, not where they only move it."""


_DEVICE: ContextVar[DeviceSpec | None] = ContextVar("remat_cost_device", default=None)


@contextmanager
def priced_on(device: DeviceSpec | None) -> Iterator[None]:
    """Static costs inside the block are the roofline of ``device`` (None: the nominal CPU's). A
    compile prices its whole planning on its ``device=`` option this way (``remat.train.compilation``)."""
    token = _DEVICE.set(device)
    try:
        yield
    finally:
        _DEVICE.reset(token)


def pricing_device() -> DeviceSpec | None:
    """The device static costs are priced on now (:func:`priced_on`), None for the nominal CPU."""
    return _DEVICE.get()


def flops(ins: Instruction) -> float:
    """Estimated floating-point operations of one instruction, by its op's declared cost rule
    (``OpDef.flops``; views, constants and control ops declare 0)."""
    rule = ins.op.flops
    if rule is None:
        raise ValueError(f"op '{ins.op.name}' declares no cost rule (OpDef.flops); the planners cannot price it. "
                         "Declare one with the op, e.g. flops=max_numel from remat.ir.ops._util")
    return float(rule([o.type for o in ins.operands], [r.type for r in ins.results], ins.attrs))


def instruction_cost(ins: Instruction) -> float:
    """Estimated seconds: arithmetic or memory traffic, whichever dominates, plus dispatch; over
    ``chunks`` slices, more (:data:`SLICE_COST`)."""
    if ins.op.has("view") or ins.op.has("control"):
        return 0.0
    traffic = sum(o.type.nbytes for o in ins.operands) + sum(r.type.nbytes for r in ins.results)
    sliced = 1.0 + SLICE_COST * (ins.attrs.get("chunks", 1) - 1)
    device = _DEVICE.get()
    if device is not None:
        dtype = next((o.type.dtype.value for o in ins.operands if getattr(o.type, "dtype", None) is not None
                      and o.type.dtype.is_float), None)
        dense = ins.op.has("matmul") or ins.op.has("conv") or ins.op.has("dense")
        return device.seconds(flops(ins), traffic, dtype, dense) * sliced
    return (max(flops(ins) / FLOPS_PER_SECOND, traffic / BYTES_PER_SECOND) + OVERHEAD_SECONDS) * sliced


def function_cost(fn: Function) -> float:
    """Estimated seconds of one run of ``fn`` (every instruction once)."""
    return sum(instruction_cost(i) for b in fn.blocks for i in b.instrs)


def static_costs(fn: Function) -> dict[Instruction, float]:
    """Estimated seconds of each instruction of ``fn``."""
    return {i: instruction_cost(i) for b in fn.blocks for i in b.instrs}


def _signature(ins: Instruction) -> tuple:
    """What makes two instructions cost the same: op, operand and result types, attributes. (Types
    compare as their printed forms do, and hash once: cheaper than the text on every candidate.)"""
    return (ins.op.name, tuple([o.type for o in ins.operands]), tuple([r.type for r in ins.results]),
            repr(sorted(ins.attrs.items())))


def _priced(fn: Function) -> Iterator[Instruction]:
    """The instructions of ``fn`` a program's cost counts: not frees, returns or views."""
    for b in fn.blocks:
        for ins in b.instrs:
            if ins.op.name not in ("free", "return") and not ins.op.has("view"):
                yield ins


def _instructions(fn: Function) -> int:
    """The instructions of ``fn`` a run dispatches to a kernel or a callee: all but frees and returns
    (a free is the VM's bookkeeping of a step, a fraction of a kernel call's: zoo U-Net small at 50%
    has 253 more of them than its unconstrained step, which counted as calls added 0.7 ms to a
    recomputation of 2.7 ms)."""
    return sum(1 for b in fn.blocks for ins in b.instrs if ins.op.name not in ("free", "return"))


class MeasuredSignatures:
    """Measured seconds by instruction signature, shared by every cost model of one profiled compile:
    those measured in the step's own runs (:meth:`record`: the joint's, a lean variant's joint's, the
    unconstrained step program's), and those of instructions none of them ran (a lean algorithm's
    recomputed copy, a fused kernel, an optimizer update of another shape) measured once each when
    first priced, by ``measure`` (instructions -> seconds each, None where one cannot be measured:
    then the static estimate). Costs only steer the planners' choices: peaks and gradients do not
    depend on them."""

    def __init__(self, measure: Callable[[Sequence[Instruction]], Sequence[float | None]]):
        self.measure = measure
        self.seconds: dict[tuple, float] = {}
        self.measured_alone = 0  # signatures ``measure`` timed (the others came from the step's own runs)
        # Seconds a run spends per instruction (frees and views too) beyond the priced instructions'
        # own times: the VM's dispatch and bookkeeping, measured on the unconstrained step
        # (:meth:`set_dispatch`). A plan recomputing many small instructions pays it on each.
        self.dispatch = 0.0

    def set_dispatch(self, fn: Function, costs: Mapping[Instruction, float], total: float) -> None:
        """:attr:`dispatch` from a run of ``fn`` taking ``total`` seconds, ``costs`` its instructions' times."""
        n = _instructions(fn)
        priced = sum(costs.get(ins, 0.0) for ins in _priced(fn))
        self.dispatch = max(0.0, total - priced) / n if n else 0.0

    def record(self, costs: Mapping[Instruction, float]) -> None:
        """Per-instruction seconds measured in a run of the step's own programs (of a signature, the
        fastest recorded: another process only ever adds time)."""
        seconds = self.seconds
        for ins, sec in costs.items():
            k = _signature(ins)
            seconds[k] = min(sec, seconds.get(k, sec))

    def fastest(self, costs: Mapping[Instruction, float]) -> dict[Instruction, float]:
        """``costs`` with each instruction's seconds the fastest recorded for its signature."""
        seconds = self.seconds
        return {ins: seconds.get(_signature(ins), sec) for ins, sec in costs.items()}

    def price(self, instrs: Sequence[Instruction]) -> list[float]:
        """Seconds of each of ``instrs``: recorded, else measured now (and kept), else static."""
        keys = [_signature(i) for i in instrs]
        todo = {k: i for k, i in zip(keys, instrs) if k not in self.seconds}
        if todo:
            got = self.measure(list(todo.values()))
            for (k, ins), sec in zip(todo.items(), got):
                self.seconds[k] = instruction_cost(ins) if sec is None else sec
            self.measured_alone += sum(1 for sec in got if sec is not None)
        return [self.seconds[k] for k in keys]


class CostModel:
    """Seconds per instruction of any program of one step: the step's own per-instruction costs
    (estimated or measured on the joint), looked up by signature for recomputed copies; for
    instructions the joint lacks (a lean algorithm's, the optimizer updates, fused kernels),
    ``measured``'s seconds (a profiled compile: :class:`MeasuredSignatures`), else the static estimate."""

    def __init__(self, costs: dict[Instruction, float], measured: MeasuredSignatures | None = None):
        self.by_signature: dict[tuple, float] = {}
        for ins, sec in costs.items():
            self.by_signature.setdefault(_signature(ins), sec)
        self.base = sum(costs.values())  # the joint's compute seconds: the overhead's denominator
        self.measured = measured

    def program_cost(self, fn: Function) -> float:
        """Seconds of one run of ``fn``."""
        if self.measured is not None:
            return self._measured_cost(fn)
        total = 0.0
        for ins in _priced(fn):
            sec = self.by_signature.get(_signature(ins))
            total += instruction_cost(ins) if sec is None else sec
        return total

    def _measured_cost(self, fn: Function) -> float:
        """:meth:`program_cost` with ``measured``: the instructions of signatures not known yet
        priced together (:meth:`MeasuredSignatures.price`), then known; and the VM's dispatch of
        every instruction (:attr:`MeasuredSignatures.dispatch`)."""
        total = self.measured.dispatch * _instructions(fn)
        missing: dict[tuple, list] = {}  # signature -> [an instruction of it, how many]
        for ins in _priced(fn):
            sig = _signature(ins)
            sec = self.by_signature.get(sig)
            if sec is not None:
                total += sec
            elif sig in missing:
                missing[sig][1] += 1
            else:
                missing[sig] = [ins, 1]
        if missing:
            prices = self.measured.price([ins for ins, _ in missing.values()])
            for (sig, (_, n)), sec in zip(missing.items(), prices):
                self.by_signature[sig] = sec
                total += n * sec
        return total


def program_overhead(model: CostModel, program: Function, unconstrained: float) -> float:
    """Recompute seconds of ``program`` over the joint's compute seconds (0.1 = +10%); never below 0.
    ``unconstrained``: ``model.program_cost`` of the unconstrained step program."""
    return max(0.0, (model.program_cost(program) - unconstrained) / model.base) if model.base > 0 else 0.0


__all__ = ["BYTES_PER_SECOND", "CostModel", "FLOPS_PER_SECOND", "MeasuredSignatures", "OVERHEAD_SECONDS", "flops", "function_cost",
           "instruction_cost", "priced_on", "pricing_device", "program_overhead", "SLICE_COST", "static_costs"]
