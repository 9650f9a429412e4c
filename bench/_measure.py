"""Peak CPU memory of one call, measured the same way for every method in the benchmarks.

PyTorch keeps no allocator statistics on CPU, so the peak is read from the profiler's memory
events: with ``torch.profiler.profile(profile_memory=True)`` every allocation and free made by
PyTorch's CPU allocator during the call is recorded with its size in bytes and a timestamp.

Definition (bytes): ``peak = resident + max_t net(t)`` where

* ``resident`` is the total size of the distinct storages of the tensors the caller names as
  alive when the call starts (parameters, buffers, existing ``.grad``\\ s, optimizer state,
  inputs, targets), see :func:`resident_bytes`;
* ``net(t)`` is the bytes allocated minus the bytes freed by the call up to time ``t``, counting
  only memory allocated *during* the call (the profiler cannot see the size of a block allocated
  before it started, so frees of pre-existing memory are invisible and such memory stays counted
  in ``resident``: the measurement is an upper bound when the call frees resident tensors).

Sizes are the requested ``nbytes`` (PyTorch's CPU allocator does not round up or cache), so
the peak of a program is exactly the sum of its live tensor sizes at its worst moment. Memory
not obtained from PyTorch's allocator (oneDNN scratch space, NumPy arrays, Python objects) is
not seen, for any method alike.
"""
from __future__ import annotations

import gc
import os
import platform
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from remat.runtime.allocator import allocation_trace, peak_of_trace  # noqa: F401  (one definition, shared)


@dataclass(frozen=True)
class MemoryMeasurement:
    """One measured call. All sizes in bytes."""

    peak_bytes: int        # resident_bytes + peak_net_bytes
    resident_bytes: int    # distinct storages alive at the start (as named by the caller)
    peak_net_bytes: int    # max over the call of (allocated - freed), memory allocated during the call
    end_net_bytes: int     # net bytes still allocated when the call returned (kept by its results or state)
    allocated_bytes: int   # total bytes allocated during the call (with repeats)
    num_allocations: int   # allocation events seen
    result: Any            # what the call returned


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    """Distinct storages ``{data_ptr: nbytes}`` of the tensors found in ``tensors`` (nested in
    lists, tuples, dicts; non-tensors are skipped). Views share their base's storage."""
    seen: dict[int, int] = {}
    stack = [tensors]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.is_meta:
                continue
            st = x.untyped_storage()
            ptr = st.data_ptr() if x.is_cpu else (str(x.device), st.data_ptr())
            if ptr != 0 or st.nbytes() > 0:
                seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set)):
            stack.extend(x)
    return seen


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Total bytes of the distinct storages of ``tensors`` (nested containers allowed); a tensor
    and its views, or tied parameters, are counted once."""
    return sum(_storages(tensors).values())


def resident_bytes(model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                   extra: Iterable[Any] = ()) -> int:
    """Bytes alive before a training step: the model's parameters, buffers and existing ``.grad``\\ s,
    the optimizer's state tensors, and ``extra`` (inputs, targets, anything else the step keeps),
    each distinct storage once."""
    items: list[Any] = [list(extra)]
    if model is not None:
        params = list(model.parameters())
        items += [params, list(model.buffers()), [p.grad for p in params if p.grad is not None]]
    if optimizer is not None:
        items.append([dict(s) for s in optimizer.state.values()])
    return tensor_bytes(items)


def measure_peak(fn: Callable[[], Any], resident: int = 0, device: torch.device | None = None) -> MemoryMeasurement:
    """Peak memory of one call ``fn()``: ``resident`` bytes (see :func:`resident_bytes`) plus the
    peak of the net bytes the call allocates. Collects garbage first so that frees of stale objects
    do not land inside the measured window. ``device``: a CUDA device, measured by its caching
    allocator's statistics (``max_memory_allocated`` above the level before the call; its blocks
    are rounded up to 512 bytes) instead of the CPU profiler's events."""
    if resident < 0:
        raise ValueError(f"resident bytes must be >= 0, got {resident}")
    gc.collect()
    if device is not None:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak_net = torch.cuda.max_memory_allocated(device) - before
        end_net = torch.cuda.memory_allocated(device) - before
        return MemoryMeasurement(resident + peak_net, resident, peak_net, end_net, peak_net, 0, result)
    result, events = allocation_trace(fn)
    peak_net, end_net, allocated = peak_of_trace(events)
    n_alloc = sum(1 for _, d in events if d > 0)
    return MemoryMeasurement(resident + peak_net, resident, peak_net, end_net, allocated, n_alloc, result)


def mib(b: int | None) -> str:
    """Bytes as MiB with two decimals for the benchmarks' tables ("-" when not measured)."""
    return "-" if b is None else f"{b / 2**20:.2f}"


def checked_rows(cases: dict, show, rtol: float) -> list[dict]:
    """Each case's row (``cases``: name -> a function returning a row with ``max_relative_difference``),
    printed as ``show(row)``; stops with an error naming the case whose results differ by more than ``rtol``."""
    rows = []
    for name, run in cases.items():
        row = run()
        rows.append(row)
        print(f"{name:16} {show(row)}  max rel diff {row['max_relative_difference']:.1e}", flush=True)
        if row["max_relative_difference"] > rtol:
            raise SystemExit(f"{name}: gradients differ by {row['max_relative_difference']:.2e} > {rtol:g}")
    return rows


def write_kernel_rows(path: str, rows: list[dict], rounds: int) -> None:
    """A kernel benchmark's rows as JSON at ``path`` (folders made), with torch's version and threads."""
    import json
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": rounds,
                               "rows": rows}, indent=1) + "\n")


def machine() -> dict:
    """The machine a result was measured on: cores, torch threads, versions, the processor and what
    it computes natively (bf16 speed depends on it: ``remat.runtime.hardware``)."""
    from remat.runtime.hardware import cpu_name, native_precision

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "cpu": cpu_name(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_precision("bf16")}
