"""What PyTorch's CPU allocator sees, which the VM's count of IR values does not: kernels' own
temporaries (convolution, pooling and normalisation workspaces, matmul packing, conversions).

* :func:`allocation_trace` / :func:`peak_of_trace`: the allocator's events during a call, from
  ``torch.profiler``'s memory events (PyTorch keeps no allocator statistics on CPU); the
  benchmarks' ``bench/_measure.py`` measures with them too.
* :func:`kernel_workspace` / :func:`workspaces`: the bytes an instruction's kernel allocates beyond
  its results, measured once per (dialect, op, operand types, attributes, threads) by running the
  kernel alone (all new kernels of a program in one profiler session), and cached in the process
  and on disk (:func:`cache_file`, one file per torch version), so a budgeted compile measures
  only kernels and shapes no earlier compile met.
* :func:`measure_allocator_peak`: the allocator peak of one VM run of a program.

``remat.plan.workspace.allocator_bound`` turns the workspaces into a bound the planner can use.

Memory that does not come from PyTorch's allocator (NumPy arrays, oneDNN scratch space) is not
seen, here and in the measurement alike.
"""
from __future__ import annotations

import hashlib
import json
import platform
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from ..ir import Function, Instruction, Module
from ..ir.ops.optim import UPDATE_OPS

_CACHE: dict[str, int] = {}  # _key(...) -> workspace bytes (also on disk: cache_file())


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


def _key(ins: Instruction, dialect: str, device: Any = None) -> str:
    """What decides a kernel's workspace: dialect, implementation (a dialect may have several per op,
    chosen by their checkers: the torch dialect's MKL and oneDNN products), op, operand types,
    attributes, threads, and the device off the CPU (a string: the on-disk cache's key)."""
    import torch

    from .. import backends

    key = (dialect, backends.kernel_for(ins, dialect).fn.__name__, ins.op.name,
           tuple(str(v.type) for v in ins.operands), tuple(sorted((k, repr(v)) for k, v in ins.attrs.items())),
           torch.get_num_threads())
    return repr(key if device is None else (*key, _device_name(device)))


def _device_name(device: Any) -> str:
    """The device's type and model ("cuda:NVIDIA H200"): what a kernel's workspace depends on."""
    import torch

    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def _zeros(t, device: Any = None) -> Any:
    """A zero-filled torch tensor of IR type ``t`` (zeros are valid indices, seeds and values)."""
    import torch

    return torch.zeros(t.shape, dtype=_torch_dtype(t.dtype.value), device=device)


def kernel_operands(ins: Instruction, device: Any = None) -> list:
    """The operands a kernel's workspace is measured on: zeros, but an optimizer update's
    (``UPDATE_OPS``) step count 2 and hyperparameters 0.5: its steady state (SGD's first step only
    copies the gradient into the momentum buffer and allocates nothing; every later step's
    ``mul_(momentum)`` allocates scalar temporaries), with every hyperparameter non-zero (the
    costliest form, since a schedule may change them at run time); skip flag false. A loss with an
    ``ignore_index`` gets its first target ignored: the kernels skip the row mask and the cleaned
    targets when every row counts, and a causal LM's shifted labels always end in an ignored one
    (measured on all-zero targets, such a step's allocator peak exceeded the bound by those two
    temporaries, 9 bytes a row)."""
    args = [_zeros(v.type, device) for v in ins.operands]
    if ins.op.name in UPDATE_OPS:
        args[-3].fill_(2)
        args[-2].fill_(0.5)  # args[-1], skip: false
    ignore = ins.attrs.get("ignore_index")
    if ignore is not None:
        for a, v in zip(args, ins.operands):
            if not v.type.dtype.is_float and a.numel():
                a.view(-1)[0] = ignore  # the class targets: one row ignored
    return args


def _torch_dtype(name: str) -> Any:
    import torch

    return {"bool": torch.bool, "i32": torch.int32, "i64": torch.int64, "f16": torch.float16,
            "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64}[name]


# ---------------------------------------------------------------- the on-disk cache
_disk_loaded = False
_dirty = False


CACHE_VERSION = 6
"""Bumped when what is measured changes (2: optimizer updates measured at step 2, not 0; 3: keys name
the implementation; 4: optimizer updates take their hyperparameters as an operand; 6: losses with
an ignored target) or how it is stored (5: a header with the version and a checksum,
:mod:`remat.cache`), so that workspaces cached by an older remat are measured again."""


def _kernels_digest() -> str:
    """A digest of the torch kernels' source: a workspace is what a kernel allocates, so a changed
    kernel module is measured again (12 hex digits of SHA-256)."""
    from ..backends import torch_kernels

    return hashlib.sha256(Path(torch_kernels.__file__).read_bytes()).hexdigest()[:12]


def cache_file() -> Path:
    """The on-disk cache of workspaces (bytes per kernel and shape), one file per cache version, torch
    version, machine and kernel source: ``$REMAT_CACHE_DIR`` (else ``~/.cache/remat``)
    ``/workspaces/v<N>-torch-<version>-<arch>-<kernels digest>.json``."""
    import torch

    from ..cache import cache_root

    return cache_root() / "workspaces" / (f"v{CACHE_VERSION}-torch-{torch.__version__}-{platform.machine()}"
                                          f"-{_kernels_digest()}.json")


def _read_disk() -> dict[str, int]:
    """The on-disk cache's measurements ({} when there is none; a damaged file is ignored with a
    warning naming it, and removed: :func:`remat.cache.read_entry`)."""
    from ..cache import read_entry, warn_bad_entry

    path = cache_file()
    payload = read_entry(path, "workspaces", CACHE_VERSION, "workspace cache")
    if payload is None:
        return {}
    try:
        data = json.loads(payload)
    except ValueError as e:
        data = e
    if not isinstance(data, dict) or not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in data.items()):
        warn_bad_entry(path, "workspace cache", "it does not hold workspaces")
        return {}
    return data


def _load() -> None:
    """Merge the on-disk cache into the process cache (once; a missing or damaged file is empty)."""
    global _disk_loaded
    if _disk_loaded:
        return
    _disk_loaded = True
    for k, v in _read_disk().items():
        _CACHE.setdefault(k, v)


def save_cache() -> None:
    """Write the process cache to disk (atomically, with a version and checksum:
    :func:`remat.cache.write_entry`; merged with what other processes wrote)."""
    global _dirty
    if not _dirty:
        return
    from ..cache import write_entry

    try:
        data = _read_disk()
        data.update(_CACHE)
        write_entry(cache_file(), "workspaces", CACHE_VERSION, json.dumps(data, sort_keys=True).encode())
        _dirty = False
    except OSError:  # a read-only home: measurements stay cached for this process only
        pass


def clear_cache(disk: bool = False) -> None:
    """Forget measured workspaces and the instructions' memoised kernel keys (this process; with
    ``disk`` also the on-disk cache)."""
    global _disk_loaded, _dirty
    _CACHE.clear()
    _KEYS.clear()
    _disk_loaded = _dirty = False
    if disk:
        try:
            cache_file().unlink()
        except OSError:
            pass


# ---------------------------------------------------------------- measuring
_MARK = (1237, 3271)  # a marker between kernels: two allocations of these odd sizes, each freed at once
_REPEATS = 2          # runs per kernel (the first may warm caches); the workspace is the largest seen


def _mark() -> None:
    import torch

    for n in _MARK:
        t = torch.empty(n, dtype=torch.uint8)
        del t


def _segments(events: list[tuple[int, int]]) -> list[list[int]]:
    """The allocator deltas between markers (the first segment is before the first marker)."""
    pattern = [_MARK[0], -_MARK[0], _MARK[1], -_MARK[1]]
    deltas = [d for _, d in events]
    segs: list[list[int]] = [[]]
    i = 0
    while i < len(deltas):
        if deltas[i:i + 4] == pattern:
            segs.append([])
            i += 4
        else:
            segs[-1].append(deltas[i])
            i += 1
    return segs


def kernel_dialect(ins: Instruction, dialects: Sequence[str] | None) -> str:
    """The dialect whose kernel runs ``ins``: its assigned one, else the VM's choice among ``dialects``."""
    from .. import backends

    return ins.dialect or backends.select(ins, backends.resolve(dialects)).dialect


def kernel_vm(ins: Instruction, dialect: str, device: Any = None):
    """A VM running ``ins`` alone (its kernel in ``dialect``) as ``@kernel``."""
    from ..ir import Builder
    from .vm import VM

    f = Function("kernel", [v.type for v in ins.operands], [r.type for r in ins.results])
    b = Builder(f.entry)
    new = b.create(ins.op.name, list(f.params), dict(ins.attrs), result_types=[r.type for r in ins.results],
                   dialect=dialect)
    b.ret(*new.results)
    return VM(Module([f]), dialects=(dialect,), device=device)


def measure_workspaces(instrs: Sequence[Instruction], dialects: Sequence[str] | None = None,
                       device: Any = None) -> None:
    """Measure (and cache, in the process and on disk) the workspace of every kernel of ``instrs``
    not cached yet: each kernel runs alone on zero-filled operands, ``_REPEATS`` times, all in one
    profiler session (markers separate the kernels), and its workspace is the largest allocator
    peak of a run beyond its new results. Kernels refusing zeros (none known) count 0. ``device``:
    a torch device off the CPU (None: the CPU), where the peak is the device allocator's own
    statistic (``torch.cuda.max_memory_allocated``) around each run."""
    _measure([(ins, key) for ins, key in zip(instrs, _kernel_keys(instrs, dialects, device)) if key is not None],
             dialects, device)


_KEYS: dict[tuple, str | None] = {}  # an instruction's signature -> its kernel key (_kernel_key)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _resolved(dialects: Sequence[str] | None) -> tuple[str, ...]:
    """The dialects as a tuple (None: the enabled ones now); a tuple is taken as it is (the
    memo's key only: the dialect choice itself resolves it)."""
    from .. import backends

    return dialects if isinstance(dialects, tuple) else backends.resolve(dialects)


def _kernel_key(ins: Instruction, dialects: Sequence[str] | None, device: Any = None) -> str | None:
    """The cache key of ``ins``'s kernel (:func:`_kernel_keys` of one instruction)."""
    return _kernel_keys([ins], dialects, device)[0]


def _kernel_keys(instrs: Sequence[Instruction], dialects: Sequence[str] | None, device: Any = None) -> list[str | None]:
    """The cache key of each instruction's kernel; None for one with no workspace to measure:
    control ops and collectives (effects other than in-place updates: run alone, a collective would
    wait for ranks that do not take part) and NumPy / Numba kernels (their memory is not PyTorch's
    allocator's). Memoised by the instruction's signature (op, types, attributes, dialects, threads):
    planners ask for every instruction of every candidate program, and the key's dialect choice and
    text cost ~20 µs each (64-layer GPT: 9 of its 25 s of planning). The dialects and threads, the
    same for every instruction, are looked up once per call."""
    context = (_resolved(dialects), _threads(), device)
    keys = _KEYS
    out: list[str | None] = []
    for ins in instrs:
        tags = ins.op.tags
        if "effect" in tags and "inplace" not in tags:
            out.append(None)
            continue
        try:
            sig = (ins.op.name, tuple([v.type for v in ins.operands]), tuple([r.type for r in ins.results]),
                   tuple(sorted(ins.attrs.items())), ins.dialect, context)
            out.append(keys[sig])
            continue
        except TypeError:  # an unhashable attribute value: not memoised
            sig = None
        except KeyError:
            pass
        dialect = kernel_dialect(ins, dialects)
        key = None if dialect in ("numpy", "numba") else _key(ins, dialect, device)
        if sig is not None:
            keys[sig] = key
        out.append(key)
    return out


def _measure(keyed: Sequence[tuple[Instruction, str]], dialects: Sequence[str] | None, device: Any = None) -> None:
    """:func:`measure_workspaces` of instructions already keyed (``_kernel_key``)."""
    global _dirty
    _load()
    todo: dict[str, tuple[Instruction, str]] = {}
    for ins, key in keyed:
        if key not in _CACHE and key not in todo:
            todo[key] = (ins, kernel_dialect(ins, dialects))
    if not todo:
        return
    runs = []
    for key, (ins, dialect) in todo.items():
        try:
            vm = kernel_vm(ins, dialect, device)
        except Exception:  # noqa: BLE001 - a kernel that cannot run alone costs nothing extra
            _CACHE[key] = 0
            continue
        fresh = sum(r.type.nbytes for k, r in enumerate(ins.results) if k not in ins.op.aliases)
        runs.append((key, vm, kernel_operands(ins, device), fresh))
    if device is not None:
        _measure_on_device(runs, device)
        return

    def run_all() -> list[bool]:
        ok = []
        for _, vm, args, _ in runs:
            good = True
            for _ in range(_REPEATS):
                _mark()
                try:
                    vm.run("kernel", *args, outputs="torch", record="peak")
                except Exception:  # noqa: BLE001
                    good = False
                _mark()
            ok.append(good)
        _mark()
        return ok

    ok, events = allocation_trace(run_all)
    segs = _segments(events)
    if len(segs) != 2 * _REPEATS * len(runs) + 2:  # a kernel's own events looked like a marker
        raise RuntimeError(f"measuring kernel workspaces: {len(segs) - 2} allocator segments between markers, "
                           f"expected {2 * _REPEATS * len(runs)}; the measurement cannot be attributed to kernels")
    # Segments: [before], then per run (kernel, gap to the next run) pairs; the operands exist
    # before the first marker, so a kernel's segment holds the kernel's own events only.
    k = 1
    for (key, _, _, fresh), good in zip(runs, ok):
        ws = 0
        for _ in range(_REPEATS):
            net = peak = 0
            for d in segs[k]:
                net += d
                peak = max(peak, net)
            ws = max(ws, peak - fresh)
            k += 2
        _CACHE[key] = ws if good else 0
    _dirty = True
    save_cache()


def declared_workspace(ins: Instruction, dialects: Sequence[str] | None = None, device: Any = None) -> int:
    """The workspace the kernel of ``ins`` declares (``KernelImpl.workspace``: collectives, which
    cannot run alone), else 0: for instructions whose kernel is not measured (:func:`_kernel_keys`)."""
    from .. import backends

    if ins.op.has("control") or not ins.op.has("effect"):
        return 0
    dialects = _resolved(dialects)
    impl = backends.select(ins, dialects) if ins.dialect is None else backends.kernel_for(ins, ins.dialect)
    return 0 if impl.workspace is None else int(impl.workspace(ins, device))


def kernel_workspace(ins: Instruction, dialects: Sequence[str] | None = None, device: Any = None) -> int:
    """Bytes the kernel of ``ins`` (its assigned dialect) allocates beyond its new results, as
    PyTorch's allocator sees them while the VM runs it (see :func:`measure_workspaces`; measured
    once per kernel and shape and cached). 0 for control ops and for kernels whose memory the
    allocator does not see (NumPy, Numba). ``dialects``: those the VM chooses from when ``ins``
    has none assigned."""
    key = _kernel_key(ins, dialects, device)
    if key is None:
        return declared_workspace(ins, dialects, device)
    if key not in _CACHE:
        _measure([(ins, key)], dialects, device)
    return _CACHE[key]


def workspaces(fn: Function, dialects: Sequence[str] | None = None, device: Any = None) -> dict[Instruction, int]:
    """Each instruction of ``fn``'s entry block to its kernel's workspace (bytes) on ``device``
    (None: the CPU); the kernels not cached yet are measured together, in one profiler session."""
    dialects = _resolved(dialects)
    keyed = list(zip(fn.entry.instrs, _kernel_keys(fn.entry.instrs, dialects, device)))
    _measure([(ins, k) for ins, k in keyed if k is not None], dialects, device)
    return {ins: declared_workspace(ins, dialects, device) if k is None else _CACHE[k] for ins, k in keyed}


def cached_workspaces(fn: Function, dialects: Sequence[str] | None = None) -> tuple[dict[Instruction, int], int]:
    """Each instruction of ``fn``'s entry block to its kernel's workspace as measured before (the
    process and on-disk caches), 0 for a kernel never measured; and how many of ``fn``'s kernels
    were never measured. Nothing is run (a dry run plans on tensors without data)."""
    _load()
    dialects = _resolved(dialects)
    out, missing = {}, set()
    for ins, k in zip(fn.entry.instrs, _kernel_keys(fn.entry.instrs, dialects)):
        if k is not None and k not in _CACHE:
            missing.add(k)
        out[ins] = declared_workspace(ins, dialects) if k is None else _CACHE.get(k, 0)
    return out, len(missing)


def measure_allocator_peak(fn: Function, args: Sequence, dialects: Sequence[str] | None, device: Any = None) -> int:
    """The allocator peak of one VM run of ``fn`` on ``args`` (bytes): the arguments' bytes (as the
    VM counts them) plus the peak of what the run allocates, from the profiler's memory events (off
    the CPU: from the device allocator's peak statistic)."""
    from ..runtime.vm import VM

    vm = VM(Module([fn.clone()]) if fn.module is None else fn.module, dialects=dialects, device=device)
    run = lambda: vm.run(fn.name, *args, outputs="torch", record="peak")  # noqa: E731
    grown = device_allocation(run, device)[1] if device is not None else peak_of_trace(allocation_trace(run)[1])[0]
    return sum(p.type.nbytes for p in fn.params) + grown


def device_allocation(fn: Callable[[], Any], device: Any) -> tuple[Any, int]:
    """:func:`allocation_trace` off the CPU: ``fn()``'s result, and how far the device allocator's
    allocated bytes rose above their level before the call (bytes, as the allocator counts them:
    blocks rounded up to its granularity)."""
    import torch

    if device.type != "cuda":
        raise NotImplementedError(f"measuring allocator peaks on {device.type} (remat measures the CPU and CUDA)")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, max(0, torch.cuda.max_memory_allocated(device) - before)


def _measure_on_device(runs: list, device: Any) -> None:
    """:func:`_measure` off the CPU: each kernel's workspace is the device allocator's peak over each
    run beyond its new results (the largest of ``_REPEATS`` runs after an unmeasured one: what a
    library allocates once and keeps, such as cuBLAS's workspace, is the process's, not the
    kernel's); results are freed between runs."""
    global _dirty
    for key, vm, args, fresh in runs:
        ws = 0
        once = partial(vm.run, "kernel", *args, outputs="torch", record="peak")
        try:
            once()
            for _ in range(_REPEATS):
                ws = max(ws, device_allocation(once, device)[1] - fresh)
        except Exception:  # noqa: BLE001 - a kernel that cannot run alone costs nothing extra
            ws = 0
        _CACHE[key] = ws
    _dirty = True
    save_cache()


__all__ = ["allocation_trace", "cache_file", "cached_workspaces", "clear_cache", "device_allocation", "kernel_dialect",
           "kernel_operands", "kernel_vm", "kernel_workspace", "measure_allocator_peak",
           "measure_workspaces", "peak_of_trace", "save_cache", "workspaces"]
