"""What PyTorch's CPU allocator sees, which the VM's count of IR values does not: kernels' own
temporaries (convolution, pooling and normalisation workspaces, matmul packing, conversions).

* :func:`allocation_trace` / :func:`peak_of_trace`: the allocator's events during a call, from
  ``torch.profiler``'s memory events (PyTorch keeps no allocator statistics on CPU); the
  benchmarks' ``bench/_measure.py`` measures with them too.
* :func:`kernel_workspace`: the bytes one instruction's kernel allocates beyond its results,
  measured once per (dialect, op, operand types, attributes, threads) and cached for the process.
* :func:`measure_allocator_peak`: the allocator peak of one VM run of a program.

``remat.plan.workspace.allocator_bound`` turns the workspaces into a bound the planner can use.

Memory that does not come from PyTorch's allocator (NumPy arrays, oneDNN scratch space) is not
seen, here and in the measurement alike.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

from ..ir import Function, Instruction, Module

_CACHE: dict[tuple, int] = {}


def allocation_trace(fn: Callable[[], Any]) -> tuple[Any, list[tuple[int, int]]]:
    """Run ``fn()`` under the profiler; return its result and the allocator events
    ``[(time_ns, delta_bytes), ...]`` in time order (positive: allocation, negative: free)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
            result = fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [(e.start_ns(), int(e.nbytes())) for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == cpu]
    events.sort(key=lambda t: t[0])  # stable: ties keep the recording order
    return result, events


def peak_of_trace(events: list[tuple[int, int]]) -> tuple[int, int, int]:
    """``(peak_net, end_net, allocated)`` in bytes of a time-ordered event list. ``peak_net`` is at
    least 0 (the moment before the first event)."""
    net = peak = allocated = 0
    for _, delta in events:
        net += delta
        if delta > 0:
            allocated += delta
        peak = max(peak, net)
    return peak, net, allocated


def _key(ins: Instruction) -> tuple:
    import torch

    return (ins.op.name, tuple(v.type for v in ins.operands),
            tuple(sorted((k, repr(v)) for k, v in ins.attrs.items())), torch.get_num_threads())


def _zeros(t) -> Any:
    """A zero-filled torch tensor of IR type ``t`` (zeros are valid indices, seeds and values)."""
    import torch

    return torch.zeros(t.shape, dtype=_torch_dtype(t.dtype.value))


def _torch_dtype(name: str) -> Any:
    import torch

    return {"bool": torch.bool, "i32": torch.int32, "i64": torch.int64, "f16": torch.float16,
            "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64}[name]


def kernel_workspace(ins: Instruction, dialects: Sequence[str] | None = None) -> int:
    """Bytes the kernel of ``ins`` (its assigned dialect) allocates beyond its new results, as
    PyTorch's allocator sees them while the VM runs it: measured on zero-filled operands (valid
    indices, seeds and shapes), the second of two runs (the first may warm caches), cached per
    kernel and shape. 0 for control ops and for kernels whose memory the allocator does not see.
    ``dialects``: those the VM chooses from when ``ins`` has none assigned."""
    from .. import backends

    if ins.op.has("control"):
        return 0
    dialect = ins.dialect or backends.select(ins, backends.resolve(dialects)).dialect
    if dialect in ("numpy", "numba"):  # NumPy memory: not PyTorch's allocator
        return 0
    key = (dialect,) + _key(ins)
    if key in _CACHE:
        return _CACHE[key]
    import torch

    from ..runtime.vm import VM

    f = Function("kernel", [v.type for v in ins.operands], [r.type for r in ins.results])
    from ..ir import Builder

    b = Builder(f.entry)
    new = b.create(ins.op.name, list(f.params), dict(ins.attrs), result_types=[r.type for r in ins.results],
                   dialect=dialect)
    b.ret(*new.results)
    vm = VM(Module([f]), dialects=(dialect,))
    fresh = sum(r.type.nbytes for k, r in enumerate(ins.results) if k not in ins.op.aliases)
    ws = 0
    try:
        for _ in range(2):
            args = [_zeros(v.type) for v in ins.operands]
            _, events = allocation_trace(lambda: vm.run("kernel", *args, outputs="torch", record="peak"))
            peak, _, _ = peak_of_trace(events)
            ws = max(0, peak - fresh)
    except Exception:  # noqa: BLE001 - a kernel refusing zeros (none known) costs nothing extra
        ws = 0
    _CACHE[key] = ws
    return ws


def workspaces(fn: Function, dialects: Sequence[str] | None = None) -> dict[Instruction, int]:
    """Each instruction of ``fn``'s entry block to its kernel's workspace (bytes)."""
    return {ins: kernel_workspace(ins, dialects) for ins in fn.entry.instrs}


def measure_allocator_peak(fn: Function, args: Sequence, dialects: Sequence[str] | None) -> int:
    """The allocator peak of one VM run of ``fn`` on ``args`` (bytes): the arguments' bytes (as the
    VM counts them) plus the peak of what the run allocates, from the profiler's memory events."""
    from ..runtime.vm import VM

    vm = VM(Module([fn.clone()]) if fn.module is None else fn.module, dialects=dialects)
    _, events = allocation_trace(lambda: vm.run(fn.name, *args, outputs="torch", record="peak"))
    return sum(p.type.nbytes for p in fn.params) + peak_of_trace(events)[0]


__all__ = ["allocation_trace", "kernel_workspace", "measure_allocator_peak", "peak_of_trace",
           "workspaces"]
