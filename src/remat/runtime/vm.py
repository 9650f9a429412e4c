"""The VM: runs IR functions instruction by instruction with exact memory accounting.

Kernels come from the dialect assigned to each instruction (``remat.backends``); values are
released at the points computed by ``remat.ir.liveness`` (after their last use; results never
used right after they are produced; on CFG edges for values that die there), and every storage is
counted by :class:`~remat.runtime.memory.MemoryTracker`. ``remat.plan.simulator.predict_peak``
replays the same accounting (``remat.accounting``) from types and equals the measured ``peak_bytes`` on straight-line code.

Contracts the VM enforces at run time:

* arguments are checked against the parameter types (``TypeError`` naming the index);
  non-contiguous or read-only arguments are copied once (the copy is what is counted), and so is
  an argument that is a view into a larger buffer (a slice of the caller's batch) unless the
  function writes it in place: the VM then counts exactly the bytes of its type, as predicted;
* every kernel output must have the IR result dtype and shape (``RuntimeError`` naming the
  instruction);
* a result the op does not alias to an operand must be a fresh buffer: an output that shares
  storage with any live value, is not contiguous, or owns more or fewer bytes than its type is
  copied (so a misbehaving kernel costs time, never wrong accounting);
* a result the op aliases to an operand (``reshape``, in-place updates), or an element-wise
  result written over a dying operand (``remat.ir.reuse``: the kernel runs in place), must share
  that operand's storage (``RuntimeError`` otherwise).

Cost. A function is prepared once per VM: kernels resolved (and bound to their attributes where a
kernel offers it, ``remat.backends.bound``), values in numbered frame slots,
releases precomputed, and which operands need a dialect conversion decided from the producer of
each slot (results are stored in their dialect's own array type, so a torch kernel reading a torch
result calls it as is). ``run(..., record="full")`` (the default) also records a timeline entry
and the time of every instruction; ``record="peak"`` records only the peak and where it was
reached, for repeated runs such as training steps; both check every contract above on every
result (``bench/vm_overhead.py`` measures the per-instruction cost of each). With
``by_kind=True`` (after :meth:`VM.set_kinds`), either level also measures bytes by kind
(parameters, gradients, ... as the caller labelled the values; ``RunStats.by_kind``).
"""
from __future__ import annotations

import functools
import operator
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import backends
from ..accounting import OTHER, KindBytes, TimelineEntry
from ..errors import format_bytes
from ..ir import Function, Instruction, Module, TensorType, verify
from ..ir.printer import Namer, format_instruction
from ..ir.liveness import liveness
from ..ir.reuse import buffer_reuse
from ..ir.types import DType
from .memory import KindTracker, MemoryTracker, storage_of

from .steps import K_BR, K_CALL, K_COND_BR, K_FREE, K_KERNEL, K_RETURN
RECORD_LEVELS = ("full", "peak")

_TK: Any = None


def _torch():
    import torch

    return torch


def _tk():
    """``remat.backends.torch_kernels``, imported on first use (an import statement per call costs µs)."""
    global _TK
    if _TK is None:
        from ..backends import torch_kernels

        _TK = torch_kernels
    return _TK


def _to_numpy(x: Any) -> np.ndarray:
    return x if type(x) is np.ndarray else _tk().to_numpy(x)


def _to_torch(x: Any):
    return _tk().to_torch(x)


# dialect -> the function converting any array into that dialect's operand type (numba kernels take NumPy arrays).
_CONVERT = {"numpy": _to_numpy, "torch": _to_torch, "numba": _to_numpy}


def _cpu_torch() -> bool:
    """Whether torch is loaded and its kernels run on the CPU (tensor storages keyed by address alone)."""
    return "torch" in sys.modules and _tk().DEVICE.type == "cpu"


def device_dialects(device: Any, dialects: Sequence[str] | str | None) -> tuple[str, ...]:
    """The dialects that may run on ``device`` (a ``torch.device``): all of ``dialects`` on the CPU;
    elsewhere the torch dialect alone (the default), and a ValueError when others are asked for."""
    if device is None or device.type == "cpu":
        return backends.resolve(dialects)
    if dialects is None:
        return ("torch",)
    asked = backends.resolve(dialects)
    if asked != ("torch",):
        raise ValueError(f"dialects {', '.join(asked)} cannot run on {device}: off the CPU only the torch dialect "
                         "runs (NumPy and Numba kernels take host arrays); pass dialects=('torch',) or leave it unset")
    return asked


def _is_family(conv: Callable) -> bool:
    """Whether the VM may skip ``conv`` for values it already converted: true of converters for which
    ``conv(conv(x)) is conv(x)`` (NumPy arrays; torch tensors on the torch device). Operands of a
    dialect whose converter is not known here are converted at every use, as before."""
    return conv is _to_numpy or conv is _to_torch


def tensor_type_of(x: Any) -> TensorType:
    """The IR type of a NumPy array or torch tensor."""
    if isinstance(x, np.ndarray):
        return TensorType(DType.from_numpy(x.dtype), x.shape)
    if "torch" in sys.modules and isinstance(x, sys.modules["torch"].Tensor):
        dt = _tk().FROM_TORCH.get(x.dtype)
        if dt is None:
            raise TypeError(f"torch dtype {x.dtype} has no remat dtype")
        return TensorType(dt, tuple(x.shape))
    raise TypeError(f"expected a numpy array or torch tensor, got {type(x).__name__}")


def _is_dense(x: Any) -> bool:
    """Contiguous and (for NumPy) writeable: safe to view zero-copy from either dialect."""
    if isinstance(x, np.ndarray):
        return x.flags.c_contiguous and x.flags.writeable
    return x.is_contiguous()


def _dense_copy(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return np.array(x, order="C", copy=True)
    return x.clone(memory_format=_torch().contiguous_format)


def _distinct_arguments(xs: list, stor: list, written: Sequence[bool]) -> None:
    """Give each argument that shares its storage with an earlier one (one tensor passed as two
    inputs: ``labels=input_ids``) a copy of its own, in place in ``xs`` and ``stor``: the plan counts
    every parameter's bytes, so the step holds them (the same tensor counted once would make the
    measured peak one input below the predicted). An argument written in place is never copied."""
    seen: set = set()
    for i, st in enumerate(stor):
        if st[0] in seen and st[1] and not written[i]:
            xs[i] = _dense_copy(xs[i])
            stor[i] = st = storage_of(xs[i])
        seen.add(st[0])


@dataclass
class RunStats:
    """Measurements of one run (bytes and seconds).

    ``timeline``: one :class:`TimelineEntry` per executed instruction of the function run
    (``index`` is the position in ``fn.instructions()``; a call counts as one instruction whose
    high-water mark includes the callee's). ``instr_times``: (index, op name, seconds) in execution
    order. ``peak_at``: the instruction during which ``peak_bytes`` was first reached (None when
    the arguments alone are the peak). ``record``: the recording level of the run; with
    ``"peak"`` the ``timeline`` and ``instr_times`` are empty lists (so ``time_by_op()`` is empty)
    and every other field is measured as with ``"full"``.
    """

    function: str
    peak_bytes: int
    timeline: list[TimelineEntry]
    instr_times: list[tuple[int, str, float]]
    total_seconds: float
    peak_at: Instruction | None
    peak_index: int | None
    live_bytes_at_end: int
    argument_bytes: int
    record: str = "full"
    by_kind: KindBytes | None = None  # run(..., by_kind=True): bytes by the kinds of VM.set_kinds

    def time_by_op(self) -> dict[str, float]:
        """Seconds per op name, largest first (empty for a ``record="peak"`` run)."""
        out: dict[str, float] = {}
        for _, name, s in self.instr_times:
            out[name] = out.get(name, 0.0) + s
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def __str__(self) -> str:
        where = "the arguments" if self.peak_at is None else f"instruction {self.peak_index}: {_fmt(self.peak_at)}"
        what = f"{len(self.instr_times)} instructions" if self.record == "full" else "peak only recorded"
        lines = [f"run of @{self.function}: {what}, {self.total_seconds * 1e3:.2f} ms",
                 f"  peak memory   {format_bytes(self.peak_bytes)} ({self.peak_bytes} bytes) at {where}",
                 f"  arguments     {format_bytes(self.argument_bytes)}",
                 f"  live at end   {format_bytes(self.live_bytes_at_end)} ({self.live_bytes_at_end} bytes)"]
        top = list(self.time_by_op().items())[:5]
        if top:
            lines.append("  slowest ops   " + ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in top))
        return "\n".join(lines)


def _fmt(ins: Instruction) -> str:
    fn = ins.block.function if ins.block is not None else None
    return format_instruction(ins, Namer(fn)) if fn is not None else ins.op.name


def _kernel_error(plan: "_FnPlan", st: "_Step", e: Exception) -> Exception:
    """The error a run raises when the kernel of ``st`` raised ``e``: naming the kernel, the function
    and the instruction, with its index as ``remat_instruction`` (the caller's frames rewrite it: the
    top level's). An out-of-range index is the caller's data, not a kernel bug: it stays an
    IndexError (as in eager PyTorch), with the instruction as context."""
    kind = IndexError if isinstance(e, IndexError) else RuntimeError
    err = kind(f"kernel '{st.ins.dialect}.{st.name}' failed in @{plan.fn.name} at "
               f"instruction {st.index}: {_fmt(st.ins)}\n  {type(e).__name__}: {e}")
    err.remat_instruction = st.index
    return err


# ---------------------------------------------------------------- execution plan
class _Step:
    """One precomputed instruction: what to call, which slots to read and write, what to release.

    Kernel steps: ``get(frame)`` gives the operands (a tuple, or the value itself when ``nargs`` is
    1); ``convs`` is None when every operand is already of the kernel's dialect (known at plan
    time), else one converter or None per operand; ``fast`` marks torch results on a CPU torch
    device, whose contract checks are inlined in the run loop.
    """

    __slots__ = ("kind", "index", "ins", "name", "fn", "conv", "family", "attrs", "ins_slots", "out_slots",
                 "alias", "expect", "single", "rel", "rel_top", "targets", "callee", "cond", "get", "nargs",
                 "convs", "fast", "kinds", "post")


class _Target:
    __slots__ = ("block", "src", "dst", "rel", "rel_top")


class _BlockPlan:
    __slots__ = ("arg_slots", "dead", "dead_top", "steps")


class _FnPlan:
    __slots__ = ("fn", "nslots", "param_slots", "param_expect", "blocks", "arg_dialect", "uses_torch", "instrs",
                 "param_written", "param_kinds", "tagged", "straight", "lean_runs")


def _expect(t: TensorType, dialect: str):
    """(numpy dtype, torch dtype or None, shape, nbytes) of a result type."""
    tdt = _tk().TORCH_DTYPE[t.dtype] if dialect == "torch" or "torch" in sys.modules else None
    return (t.dtype.numpy, tdt, t.shape, t.nbytes)


def _getter(slots: tuple[int, ...]) -> Callable[[list], Any]:
    """frame -> operands: the value itself for one slot, a tuple otherwise (itemgetter: no Python frame)."""
    if not slots:
        return lambda frame: ()
    return operator.itemgetter(*slots)


class VM:
    """Runs the functions of a module; prepared once (dialects assigned, plans built), reusable.

    ``dialects``: the dialects to use (default: the globally enabled ones). Instructions already
    carrying an enabled dialect keep it; the others are assigned the best enabled dialect.
    ``device``: where the torch dialect's kernels run (a ``torch.device`` or its name; default the
    CPU). Off the CPU only the torch dialect runs (NumPy and Numba kernels would copy every operand
    to the host and back, and could not update a device tensor in place): its default dialects are
    ``("torch",)``, and others asked for are refused.
    """

    straight_runs = True
    """Lean runs of straight-line functions take their generated form (:mod:`remat.runtime.straight`);
    False: every run is interpreted (for comparing the two)."""

    def __init__(self, module: Module | Function, dialects: Sequence[str] | str | None = None,
                 device: Any = None):
        if isinstance(module, Function):
            module = module.module if module.module is not None else Module([module.clone()])
        verify(module)
        self.device = None if device is None or str(device) == "cpu" else _torch().device(device)
        # Timed runs (record="full") wait for a device's kernels at each instruction (_Recorder).
        self._sync = None if self.device is None else functools.partial(_torch().accelerator.synchronize, self.device)
        if self.device is not None:  # kernels are chosen for the device (their checkers read it)
            with _tk().on_device(self.device):
                self._prepare(module, device_dialects(self.device, dialects))
        else:
            self._prepare(module, dialects)

    def _prepare(self, module: Module, dialects: Sequence[str] | str | None) -> None:
        self.dialects = backends.resolve(dialects)
        m = module.clone()
        for f in m:
            for ins in f.instructions():
                if ins.op.has("control"):
                    ins.dialect = None
                elif ins.dialect is None or ins.dialect not in self.dialects:
                    ins.dialect = backends.select(ins, self.dialects).dialect
        self.module = m
        self.kind_names: list[str] = [OTHER]  # kind index -> name (set_kinds); 0: unlabelled values
        self._plans: dict[str, _FnPlan] = {}
        for f in m:
            if not f.is_declaration:
                self._plans[f.name] = self._plan(f)
        self._uses_torch = any(p.uses_torch for p in self._plans.values())

    # -------------------------------------------------------------- planning
    def _plan(self, fn: Function) -> _FnPlan:
        lv = liveness(fn)
        reuse = buffer_reuse(fn)  # results written over a dying operand (as remat.plan.simulator counts them)
        slot: dict = dict(lv.order)  # every value's definition index: its register
        params = set(fn.params)
        bindex = {b: i for i, b in enumerate(fn.blocks)}

        def rels(vs):
            """(release list inside callees or with donation, release list at top level without)."""
            all_ = tuple(slot[v] for v in vs)
            return all_, tuple(slot[v] for v in vs if v not in params)

        p = _FnPlan()
        p.fn = fn
        p.nslots = len(slot)
        p.param_slots = tuple(slot[a] for a in fn.params)
        p.param_expect = tuple(_expect(t, "numpy") for t in fn.param_types)
        p.blocks = []
        # Arguments are converted on entry (run) and at call sites to the first kernel's dialect.
        p.arg_dialect = next((i.dialect for i in fn.instructions() if not i.op.has("control")), None)
        p.uses_torch = False
        p.instrs = tuple(fn.instructions())  # by step index (RunStats.peak_at)
        p.param_written = _written_params(fn)
        p.param_kinds = (0,) * len(fn.params)
        p.tagged = False
        p.straight = None  # the lean run generated (remat.runtime.straight); False: not eligible
        p.lean_runs = 0  # lean runs interpreted before it is generated
        # The converter family every slot's value is known to be in (see _is_family): parameters
        # (converted on entry), kernel results (converted by _store). Block arguments and call
        # results may come from several places: unknown (None), converted at each use.
        family: dict[int, Callable | None] = {}
        if p.arg_dialect is not None and _is_family(_CONVERT[p.arg_dialect]):
            for s in p.param_slots:
                family[s] = _CONVERT[p.arg_dialect]
        cpu_torch = _cpu_torch()
        index = 0
        for b in fn.blocks:
            bp = _BlockPlan()
            bp.arg_slots = tuple(slot[a] for a in b.args)
            bp.dead, bp.dead_top = rels(lv.dead_args.get(b, ()))
            bp.steps = []
            for ins in b.instrs:
                st = _Step()
                st.index = index
                index += 1
                st.ins = ins
                st.name = ins.op.name
                st.ins_slots = tuple(slot[v] for v in ins.operands)
                st.out_slots = tuple(slot[r] for r in ins.results)
                st.rel, st.rel_top = rels(lv.dies_at.get(ins, ()))
                st.single = len(ins.results) == 1
                st.attrs = ins.attrs
                st.fn = st.conv = st.family = st.targets = st.callee = st.cond = st.convs = st.post = None
                st.get = _getter(st.ins_slots)
                st.nargs = len(st.ins_slots)
                st.fast = False
                st.kinds = (0,) * len(ins.results)  # kind index per result (set_kinds)
                st.alias = tuple(ins.op.aliases.get(k, -1) for k in range(len(ins.results)))
                st.expect = ()
                name = st.name
                if name == "call":
                    st.kind = K_CALL
                    st.callee = ins.attrs["callee"]
                    callee = fn.module[st.callee]
                    if callee.is_declaration:
                        raise ValueError(f"@{fn.name} calls @{st.callee}, a gradient declaration not yet "
                                         f"differentiated; run the 'grad' pass first")
                elif name == "free":
                    st.kind = K_FREE
                elif name == "return":
                    st.kind = K_RETURN
                elif name in ("br", "cond_br"):
                    st.kind = K_BR if name == "br" else K_COND_BR
                    st.cond = st.ins_slots[0] if name == "cond_br" else None
                    st.targets = []
                    for i, s in enumerate(ins.successors):
                        t = _Target()
                        t.block = bindex[s.block]
                        t.src = tuple(slot[v] for v in s.args)
                        t.dst = tuple(slot[a] for a in s.block.args)
                        t.rel, t.rel_top = rels(lv.edge_kills.get((b, i), ()))
                        st.targets.append(t)
                else:
                    st.kind = K_KERNEL
                    impl = backends.kernel_for(ins, ins.dialect)
                    st.fn = impl.fn
                    if ins in reuse:
                        st.fn = backends.inplace(impl, reuse[ins])
                        st.alias = (reuse[ins],) + st.alias[1:]
                    else:
                        fn_ = backends.bound(impl, ins.attrs)  # attribute-only decisions taken once
                        if fn_ is not None:
                            st.fn, st.attrs = fn_, {}
                    st.conv = conv = _CONVERT[ins.dialect]
                    st.family = conv if _is_family(conv) else None
                    convs = tuple(None if st.family is not None and family.get(s) is conv else conv
                                  for s in st.ins_slots)
                    st.convs = None if all(c is None for c in convs) else convs
                    # The numba kernels' results are PyTorch allocations seen as NumPy arrays: with
                    # torch on the CPU they are stored as tensors (converted once, zero-copy), so
                    # their torch consumers need no conversion and the fast accounting applies.
                    if ins.dialect == "numba" and cpu_torch:
                        st.post = st.family = _to_torch  # st.family from here on: the results' type
                    for s in st.out_slots:
                        family[s] = st.family
                    st.expect = tuple(_expect(r.type, ins.dialect) for r in ins.results)
                    st.fast = (conv is _to_torch or st.post is not None) and cpu_torch
                    if ins.dialect == "torch":
                        p.uses_torch = True
                bp.steps.append(st)
            p.blocks.append(bp)
        return p

    def arguments(self, fn: str | Function, *args: Any) -> list:
        """``args`` as a run of ``fn`` reads them: checked, converted, a dense copy of a view into a
        larger buffer and of an argument sharing its storage with an earlier one (each holds its own
        bytes, as predicted). A run given these copies nothing, so a caller measuring the run's
        allocations (``TrainStep``'s allocator peak) makes the copies before it starts measuring."""
        return self._arguments(self._plans[fn.name if isinstance(fn, Function) else fn], args)[0]

    def instructions(self, fn: str | Function) -> tuple:
        """The instructions of ``fn`` as this VM runs them, by index: the index of
        ``RunStats.peak_at`` and of the ``remat_instruction`` attribute a failed run's exception
        carries (the top-level instruction that was running when it failed)."""
        return self._plans[fn.name if isinstance(fn, Function) else fn].instrs

    def function(self, fn: str | Function) -> Function:
        """``fn`` as this VM runs it (its own copy, with dialects assigned): the function whose
        parameters the operands of :meth:`instructions` refer to."""
        return self._plans[fn.name if isinstance(fn, Function) else fn].fn

    def set_kinds(self, fn: str | Function, kind_of: dict) -> None:
        """Label the values of ``fn`` with kinds (names such as "parameters", "gradients") for
        ``run(..., by_kind=True)``. ``kind_of`` maps values of ``fn`` (the function given to the VM
        or this VM's copy of it: values are matched by position) to kind names; values left out
        are counted as ``"other"``."""
        name = fn.name if isinstance(fn, Function) else fn
        plan = self._plans.get(name)
        if plan is None:
            raise KeyError(f"no runnable function @{name} in this VM; it has {', '.join('@' + n for n in self._plans)}")
        mine = self.module[name]
        src = fn if isinstance(fn, Function) else mine

        def values(f: Function) -> list:
            return list(f.params) + [r for ins in f.instructions() for r in ins.results]

        theirs, ours = values(src), values(mine)
        if len(theirs) != len(ours):
            raise ValueError(f"set_kinds: @{name} given has {len(theirs)} values, the VM's copy {len(ours)}; "
                             "pass the function this VM was built from")
        names = self.kind_names

        def index(v) -> int:
            k = kind_of.get(v, OTHER)
            if k not in names:
                names.append(k)
            return names.index(k)

        at = dict(zip(ours, map(index, theirs)))
        plan.param_kinds = tuple(at[p] for p in mine.params)
        for bp in plan.blocks:
            for st in bp.steps:
                st.kinds = tuple(at[r] for r in st.ins.results)
        plan.tagged = True
        if plan.straight:
            plan.straight = None  # generated with the old kinds: again on its next use

    # -------------------------------------------------------------- running
    def function(self, name: str | Function) -> Function:
        """The prepared (dialect-assigned) copy of a function of the module."""
        return self.module[name.name if isinstance(name, Function) else name]

    def run(self, fn: str | Function, *args: Any, donate: bool = False, outputs: str = "numpy",
            on_step: Callable[[TimelineEntry], None] | None = None, record: str = "full",
            by_kind: bool = False) -> tuple[tuple[Any, ...], RunStats]:
        """Run ``fn`` on NumPy arrays / torch tensors; returns (results, :class:`RunStats`).

        ``donate``: the arguments become the VM's and are released at their last use (by
        default they belong to the caller and stay counted for the whole run).
        ``outputs``: "numpy" (default) or "torch".
        ``on_step``: called after each top-level instruction with its timeline entry (for
        cross-checks such as tracemalloc; adds a call per instruction; needs ``record="full"``).
        ``record``: "full" (default) records the timeline and per-instruction times (profiling,
        cross-checks); "peak" only the live and peak bytes and where the peak was reached, for
        repeated runs such as training steps. Both check every kernel contract and measure bytes
        from the real storages alike.
        ``by_kind``: also measure bytes by the kinds given to :meth:`set_kinds` (``RunStats.by_kind``;
        a few list updates per allocation and release, only when asked).
        """
        if outputs not in ("numpy", "torch"):
            raise ValueError(f"outputs must be 'numpy' or 'torch', got {outputs!r}")
        if record not in RECORD_LEVELS:
            raise ValueError(f"record must be one of {', '.join(map(repr, RECORD_LEVELS))}, got {record!r}")
        if on_step is not None and record != "full":
            raise ValueError("on_step needs record='full' (a timeline entry per instruction)")
        if self.device is not None:  # the torch kernels run on this VM's device while it runs
            with _tk().on_device(self.device):
                return self._run(fn, args, donate, outputs, on_step, record, by_kind)
        return self._run(fn, args, donate, outputs, on_step, record, by_kind)

    def _run(self, fn, args, donate, outputs, on_step, record, by_kind) -> tuple[tuple[Any, ...], RunStats]:
        name = fn.name if isinstance(fn, Function) else fn
        if name not in self._plans:
            raise KeyError(f"no runnable function @{name} in this VM; it has {', '.join('@' + n for n in self._plans)}")
        plan = self._plans[name]
        if by_kind and not plan.tagged:
            raise ValueError(f"by_kind=True needs the values of @{name} labelled first: call VM.set_kinds")
        xs, stor = self._arguments(plan, args)

        tracker = KindTracker(self.kind_names) if by_kind else MemoryTracker()
        rec = _Recorder(on_step, self._sync) if record == "full" else _PeakRecorder()
        t0 = time.perf_counter()
        # IEEE semantics: NaN and inf are values, not errors (NumPy would warn; torch does not).
        with np.errstate(all="ignore"):
            if self._uses_torch:
                with _torch().no_grad():
                    if record == "peak" and not by_kind and not donate and self._straight(plan):
                        res = plan.straight(xs, stor, tracker, rec)
                    else:
                        res = self._exec(plan, xs, stor, tracker, donate, rec)
            else:
                res = self._exec(plan, xs, stor, tracker, donate, rec)
        total = time.perf_counter() - t0
        outs, _ = res
        if outputs == "numpy":
            outs = tuple(o if type(o) is np.ndarray else _to_numpy(o) for o in outs)
        elif _cpu_torch():  # to_torch(o) is o for a plain CPU tensor
            tensor = sys.modules["torch"].Tensor
            outs = tuple(o if type(o) is tensor and o.is_cpu else _to_torch(o) for o in outs)
        else:
            outs = tuple(_to_torch(o) for o in outs)
        at = rec.peak_index
        stats = RunStats(name, rec.peak, rec.timeline, rec.times, total,
                         None if at is None else plan.instrs[at], at, tracker.live_bytes, rec.arg_bytes, record,
                         tracker.by_kind() if by_kind else None)
        return outs, stats

    def _straight(self, plan: _FnPlan) -> bool:
        """Whether this lean run of ``plan`` takes its generated straight-line function
        (:mod:`remat.runtime.straight`): from its ``straight.INTERPRETED_RUNS + 1``-th lean run on
        (generating it then), when the function is eligible."""
        if plan.straight is None:
            from . import straight

            if not (self.straight_runs and straight.eligible(plan)):
                plan.straight = False
            elif plan.lean_runs < straight.INTERPRETED_RUNS:
                plan.lean_runs += 1
                return False
            else:
                plan.straight = straight.generate(plan, self._store, _kernel_error)
        return plan.straight is not False

    def _arguments(self, plan: _FnPlan, args: Sequence[Any]) -> tuple[list, list]:
        """Check the arguments against the parameter types; dense copies where needed; convert.
        Returns the arguments and their storages (:func:`storage_of`)."""
        f = plan.fn
        ptypes = f.param_types
        if len(args) != len(ptypes):
            raise TypeError(f"@{f.name} takes {len(ptypes)} argument(s) ({', '.join(map(str, ptypes))}), got {len(args)}")
        conv = _CONVERT[plan.arg_dialect] if plan.arg_dialect else None
        tensor = sys.modules["torch"].Tensor if "torch" in sys.modules else None
        same = conv is _to_torch and _cpu_torch()  # to_torch(a) is a for a plain CPU tensor
        xs, stor = [], []
        written = plan.param_written
        for i, (a, (npdt, tdt, shape, nbytes)) in enumerate(zip(args, plan.param_expect)):
            if same and type(a) is tensor and a.dtype is tdt and a.shape == shape and a.is_cpu and a.is_contiguous():
                # The common case (a training step's parameters, state and inputs), inlined: the
                # checks below pass it through unchanged.
                sto = a.untyped_storage()
                size = sto.nbytes()
                if size == nbytes or written[i]:
                    xs.append(a)
                    stor.append((sto.data_ptr(), size, sto))
                    continue
            if type(a) is np.ndarray:
                ok = a.dtype == npdt and a.shape == shape
            elif tensor is not None and type(a) is tensor:
                ok = a.dtype is tdt and a.shape == shape
            else:
                ok = False
            if not ok:  # the slow path: other types, subclasses, and the error message
                got = tensor_type_of(a)
                if got != ptypes[i]:
                    raise TypeError(f"argument {i} of @{f.name}: expected {ptypes[i]}, got {got}")
            if not _is_dense(a):
                a = _dense_copy(a)
            if conv is not None and not (same and type(a) is tensor and a.is_cpu):
                a = conv(a)
            st = storage_of(a)
            if st[1] != nbytes and not written[i]:
                # A view into a larger buffer (``x[rank * n:(rank + 1) * n]``): the buffer is the
                # caller's; the step reads its own copy, which holds exactly the predicted bytes.
                # (An argument written in place cannot be copied: its whole buffer is counted.)
                a = _dense_copy(a)
                st = storage_of(a)
            xs.append(a)
            stor.append(st)
        if len(stor) > 1 and len({st[0] for st in stor}) != len(stor):
            _distinct_arguments(xs, stor, written)
        return xs, stor

    def _exec(self, plan: _FnPlan, xs: list, stor: list | None, tracker: MemoryTracker, donate: bool,
              rec: "_Recorder | _PeakRecorder | None", keys_in: list | None = None):
        """Execute one frame. ``stor``: the arguments' storages at top level (acquired fresh);
        None in a callee, whose arguments are the caller's ``keys_in``."""
        frame: list = [None] * plan.nslots
        keys: list = [None] * plan.nslots
        top = keys_in is None
        release = tracker.release
        pkinds = plan.param_kinds
        for i, s in enumerate(plan.param_slots):
            frame[s] = xs[i]
            if top:
                key, nbytes, owner = stor[i]
                tracker.add(key, nbytes, owner, pkinds[i])
                keys[s] = key
            else:
                keys[s] = keys_in[i]
                tracker.acquire_key(keys_in[i])
        use_top = top and not donate  # parameters stay live (they belong to the caller)
        full = isinstance(rec, _Recorder)  # per-instruction timeline and times
        if rec is not None:
            rec.start(tracker)
        # Lean top level: the tracker's high-water mark only grows; note where it last rose.
        lean = rec is not None and not full
        pk = tracker.peak_bytes
        pk_at = None
        refs = tracker._refs
        tensor = sys.modules["torch"].Tensor if "torch" in sys.modules else None
        blocks = plan.blocks
        bp = blocks[0]
        for s in (bp.dead_top if use_top else bp.dead):
            release(keys[s])
            frame[s] = keys[s] = None
        perf = time.perf_counter
        while True:
            nxt = None
            for st in bp.steps:
                if full:
                    t0 = perf()
                    saved_peak = tracker.begin_instruction()
                kind = st.kind
                if kind == K_KERNEL:
                    try:
                        if st.convs is None:  # every operand already of the dialect's type
                            if st.nargs == 1:
                                out = st.fn(st.get(frame), **st.attrs)
                            else:
                                out = st.fn(*st.get(frame), **st.attrs)
                        else:
                            out = st.fn(*[frame[s] if c is None else c(frame[s])
                                          for s, c in zip(st.ins_slots, st.convs)], **st.attrs)
                    except Exception as e:
                        raise _kernel_error(plan, st, e) from e
                    if st.post is not None:
                        out = st.post(out) if st.single else tuple(map(st.post, out))
                    if st.fast:
                        # The contract of _store for the common case, inlined (same checks, same
                        # accounting): plain CPU tensors of the results' dtypes and shapes, each
                        # either a view of its aliased operand's storage or, for other results,
                        # contiguous with a storage holding exactly its bytes and not live. Anything
                        # else takes the general path, which names the violation or copies.
                        # These checks run on every result of every run, not once per plan: whether
                        # a kernel returns a fresh buffer can depend on its operand values and
                        # strides (e.g. an op returning its input when it has nothing to do), and
                        # whether a storage is already live depends on the whole run, so no first
                        # run can prove them for later ones. What cannot change between runs (the
                        # expected dtype, shape and bytes, the aliased operand, the conversions)
                        # is decided in _plan.
                        for r, o in enumerate((out,) if st.single else out):
                            _, tdt, shape, nbytes = st.expect[r]
                            if type(o) is tensor and o.dtype is tdt and o.shape == shape and o.is_cpu:
                                sto = o.untyped_storage()
                                key = sto.data_ptr()
                                a = st.alias[r]
                                if a < 0:
                                    if key not in refs and sto.nbytes() == nbytes and o.is_contiguous():
                                        tracker.add(key, nbytes, sto, st.kinds[r])
                                        s = st.out_slots[r]
                                        frame[s] = o
                                        keys[s] = key
                                        continue
                                elif key == keys[st.ins_slots[a]]:
                                    tracker.acquire_key(key)
                                    s = st.out_slots[r]
                                    frame[s] = o
                                    keys[s] = key
                                    continue
                            self._store(plan, st, r, o, frame, keys, tracker)
                        o = None
                    elif st.single:
                        self._store(plan, st, 0, out, frame, keys, tracker)
                    else:
                        for r in range(len(out)):
                            self._store(plan, st, r, out[r], frame, keys, tracker)
                    # Hold no reference to a released (dead) result: a storage object kept by a
                    # local would keep its memory allocated past the release the VM counts.
                    out = sto = None
                elif kind == K_CALL:
                    callee = self._plans[st.callee]
                    cconv = _CONVERT[callee.arg_dialect] if callee.arg_dialect else None
                    xs_ = [frame[s] for s in st.ins_slots]
                    if cconv is not None:  # callee parameters are of its argument dialect (see _plan)
                        xs_ = [cconv(x) for x in xs_]
                    try:
                        outs, okeys = self._exec(callee, xs_, None, tracker, True, None, [keys[s] for s in st.ins_slots])
                    except Exception as e:
                        e.remat_instruction = st.index  # where it failed, as the top level numbers it
                        raise
                    for s, o, k in zip(st.out_slots, outs, okeys):
                        frame[s] = o
                        keys[s] = k  # the callee took this reference on our behalf
                elif kind == K_RETURN:
                    outs = [frame[s] for s in st.ins_slots]
                    okeys = [keys[s] for s in st.ins_slots]
                    for k in okeys:
                        tracker.acquire_key(k)  # the caller's reference
                    if not top:
                        for s in range(plan.nslots):
                            if keys[s] is not None:
                                release(keys[s])
                    if full:
                        rec.step(st, tracker, t0, saved_peak)
                    elif lean:
                        if tracker.peak_bytes > pk:
                            pk, pk_at = tracker.peak_bytes, st.index
                        rec.peak, rec.peak_index = pk, pk_at
                    return outs, okeys
                elif kind == K_FREE:
                    pass
                else:  # br, cond_br
                    if kind == K_BR:
                        t = st.targets[0]
                    else:
                        t = st.targets[0] if bool(frame[st.cond]) else st.targets[1]
                    vals = [frame[s] for s in t.src]
                    vks = [keys[s] for s in t.src]
                    for k in vks:
                        tracker.acquire_key(k)
                    for s in (st.rel_top if use_top else st.rel):
                        release(keys[s])
                        frame[s] = keys[s] = None
                    for s in (t.rel_top if use_top else t.rel):
                        release(keys[s])
                        frame[s] = keys[s] = None
                    for s, v, k in zip(t.dst, vals, vks):
                        frame[s] = v
                        keys[s] = k
                    nxt = blocks[t.block]
                    for s in (nxt.dead_top if use_top else nxt.dead):
                        release(keys[s])
                        frame[s] = keys[s] = None
                    if full:
                        rec.step(st, tracker, t0, saved_peak)
                    elif lean and tracker.peak_bytes > pk:
                        pk, pk_at = tracker.peak_bytes, st.index
                    break
                for s in (st.rel_top if use_top else st.rel):
                    release(keys[s])
                    frame[s] = keys[s] = None
                if full:
                    rec.step(st, tracker, t0, saved_peak)
                elif lean and tracker.peak_bytes > pk:
                    pk, pk_at = tracker.peak_bytes, st.index
            if nxt is None:
                raise RuntimeError(f"block of @{plan.fn.name} ended without a terminator")
            bp = nxt

    def _store(self, plan: _FnPlan, st: _Step, r: int, o: Any, frame: list, keys: list,
               tracker: MemoryTracker) -> None:
        """Check a kernel output against its IR type and contract, then count and store it."""
        npdt, tdt, shape, nbytes = st.expect[r]
        if type(o) is np.ndarray:
            ok = o.dtype == npdt and o.shape == shape
        elif tdt is not None and isinstance(o, sys.modules["torch"].Tensor):
            ok = o.dtype == tdt and tuple(o.shape) == shape
        else:
            ok = False
        if not ok:
            got = f"{type(o).__name__} {getattr(o, 'dtype', '?')} {tuple(getattr(o, 'shape', ()))}"
            raise RuntimeError(f"kernel '{st.ins.dialect}.{st.name}' in @{plan.fn.name}, instruction {st.index} "
                               f"({_fmt(st.ins)}): result {r} should be {st.ins.results[r].type} "
                               f"({npdt} {list(shape)}), got {got}")
        if st.family is not None:
            # Into the dialect's own type, so later kernels of the dialect take it unconverted
            # (zero-copy on CPU: the same storage, so the accounting below is unchanged).
            o = st.family(o)
        key, size, owner = storage_of(o)
        a = st.alias[r]
        if a >= 0:
            want = keys[st.ins_slots[a]]
            if key != want:
                raise RuntimeError(f"kernel '{st.ins.dialect}.{st.name}' in @{plan.fn.name}, instruction {st.index}: "
                                   f"result {r} must share the storage of operand {a} (a view or in-place update), "
                                   f"but the kernel returned a new buffer")
            tracker.acquire_key(key)
        else:
            # Contract: a fresh, contiguous buffer owning exactly its bytes; otherwise copy it.
            if size != nbytes or tracker.is_live(key) or not _is_contig(o):
                o = _dense_copy(o)
                key = tracker.acquire(o, st.kinds[r])
            else:
                tracker.add(key, size, owner, st.kinds[r])
        s = st.out_slots[r]
        frame[s] = o
        keys[s] = key


def _written_params(fn: Function) -> tuple[bool, ...]:
    """For each parameter of ``fn``: whether an in-place op writes its buffer (directly or
    through views of it), so the VM must hand the kernels the caller's buffer itself."""
    root = {p: p for p in fn.params}
    written: set = set()
    for ins in fn.instructions():
        for k, a in ins.op.aliases.items():
            r = root.get(ins.operands[a])
            if r is None:
                continue
            root[ins.results[k]] = r
            if ins.op.has("inplace"):
                written.add(r)
    return tuple(p in written for p in fn.params)


def _is_contig(x: Any) -> bool:
    return x.flags.c_contiguous if isinstance(x, np.ndarray) else x.is_contiguous()


class _PeakRecorder:
    """Only the peak and where it was first reached (``record="peak"``); the run loop fills it in."""

    __slots__ = ("timeline", "times", "peak", "peak_index", "arg_bytes")

    def __init__(self) -> None:
        self.timeline: list[TimelineEntry] = []
        self.times: list[tuple[int, str, float]] = []
        self.peak = 0
        self.peak_index: int | None = None
        self.arg_bytes = 0

    def start(self, tracker: MemoryTracker) -> None:
        self.arg_bytes = self.peak = tracker.live_bytes


class _Recorder(_PeakRecorder):
    """Per-instruction live bytes, high-water marks and times of the top-level frame (``record="full"``).
    ``sync``: waits for the device's queued kernels (a CUDA VM's), called before the run and at the end
    of each instruction, so that an instruction's time is its kernels' and not their launch's."""

    __slots__ = ("on_step", "sync")

    def __init__(self, on_step: Callable[[TimelineEntry], None] | None = None,
                 sync: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.on_step = on_step
        self.sync = sync

    def start(self, tracker: MemoryTracker) -> None:
        if self.sync is not None:
            self.sync()
        super().start(tracker)

    def step(self, st: _Step, tracker: MemoryTracker, t0: float, saved_peak: int) -> None:
        if self.sync is not None:
            self.sync()
        hw = tracker.end_instruction(saved_peak)
        e = TimelineEntry(st.index, tracker.live_bytes, hw)
        self.timeline.append(e)
        if hw > self.peak:
            self.peak, self.peak_index = hw, st.index
        self.times.append((st.index, st.name, time.perf_counter() - t0))
        if self.on_step is not None:
            self.on_step(e)


def run(target: Any, *args: Any, dialects: Sequence[str] | str | None = None, donate: bool = False,
        outputs: str = "numpy", record: str = "full", device: Any = None) -> tuple[tuple[Any, ...], RunStats]:
    """Run a Function (or an object with ``__remat_function__()``) on arrays; returns (results, stats).

    Builds a fresh :class:`VM` each call; keep a ``VM`` to run the same module many times.
    ``record``: see :meth:`VM.run`; ``device``: the VM's (default the CPU).
    """
    fn = target.__remat_function__() if hasattr(target, "__remat_function__") else target
    if not isinstance(fn, Function):
        raise TypeError(f"remat.run needs a remat Function or a staged function, got {type(target).__name__}")
    vm = VM(fn.module if fn.module is not None else Module([fn.clone()]), dialects=dialects, device=device)
    return vm.run(fn.name, *args, donate=donate, outputs=outputs, record=record)


__all__ = ["RECORD_LEVELS", "RunStats", "TimelineEntry", "VM", "run", "tensor_type_of"]
