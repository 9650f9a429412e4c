"""Seconds of instructions run alone: what a profiled compile prices an instruction by when the
step's own measured runs never ran it (a lean algorithm's recomputed copy, a fused kernel, an
optimizer update; :class:`remat.plan.costmodel.MeasuredSignatures`).

Each instruction runs alone in a VM (its kernel in the dialect the step's VM would choose,
:func:`~remat.runtime.allocator.kernel_vm`) on the operands the workspace measurements use
(:func:`~remat.runtime.allocator.kernel_operands`: zeros, an optimizer update in its steady state),
once untimed (kernels compile or load, caches warm), then :data:`MIN_RUNS` to :data:`MAX_RUNS` times
until :data:`MIN_SECONDS` have passed; its time is the fastest of the VM's own per-instruction times,
as the step's measured runs take them (``Compilation.measured_costs``: another process only ever
adds time).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from ..ir import Instruction

MIN_RUNS = 3
MAX_RUNS = 25
MIN_SECONDS = 5e-3
"""Timed runs per instruction: at least MIN_RUNS, then more while under MIN_SECONDS in all, at most MAX_RUNS."""


def runs_alone(ins: Instruction) -> bool:
    """Whether ``ins`` can be timed alone: not a view or a control op (they cost nothing), and no effect
    other than an in-place update (a collective run alone would wait for ranks that do not take part)."""
    tags = ins.op.tags
    return not ("view" in tags or "control" in tags or "effect" in tags and "inplace" not in tags)


def kernel_seconds(instrs: Sequence[Instruction], dialects: Sequence[str] | None = None,
                   device: Any = None) -> list[float | None]:
    """The fastest seconds of each instruction run alone (module docstring); None for one that cannot
    (:func:`runs_alone`, or its kernel refuses the zero operands)."""
    from .allocator import kernel_dialect, kernel_operands, kernel_vm

    out: list[float | None] = []
    for ins in instrs:
        if not runs_alone(ins):
            out.append(None)
            continue
        try:
            vm = kernel_vm(ins, kernel_dialect(ins, dialects), device)
            args = kernel_operands(ins, device)
            out.append(_fastest_seconds(vm, args))
        except Exception:  # noqa: BLE001 - a kernel that cannot run alone is priced another way
            out.append(None)
    return out


def _fastest_seconds(vm, args: list) -> float:
    """Fastest seconds of the kernel of ``vm``'s ``@kernel`` over its timed runs (module docstring)."""
    vm.run("kernel", *args, outputs="torch")
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MAX_RUNS and (len(times) < MIN_RUNS or time.perf_counter() - start < MIN_SECONDS):
        _, st = vm.run("kernel", *args, outputs="torch")
        times.append(st.instr_times[0][2] if st.instr_times else st.total_seconds)
    return min(times)


__all__ = ["MAX_RUNS", "MIN_RUNS", "MIN_SECONDS", "kernel_seconds", "runs_alone"]
