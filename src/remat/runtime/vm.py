"""The VM: runs IR functions instruction by instruction with exact memory accounting.

Kernels come from the dialect assigned to each instruction (``remat.backends``); values are
released at the points computed by ``remat.plan.liveness`` (after their last use; results never
used right after they are produced; on CFG edges for values that die there), and every storage is
counted by :class:`~remat.runtime.memory.MemoryTracker`. ``remat.plan.liveness.predict_peak``
replays the same accounting from types and equals the measured ``peak_bytes`` on straight-line code.

Contracts the VM enforces at run time:

* arguments are checked against the parameter types (``TypeError`` naming the index);
  non-contiguous or read-only arguments are copied once (the copy is what is counted);
* every kernel output must have the IR result dtype and shape (``RuntimeError`` naming the
  instruction);
* a result the op does not alias to an operand must be a fresh buffer: an output that shares
  storage with any live value, is not contiguous, or owns more or fewer bytes than its type is
  copied (so a misbehaving kernel costs time, never wrong accounting);
* a result the op aliases to an operand (``reshape``, in-place updates) must share that
  operand's storage (``RuntimeError`` otherwise).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import backends
from ..errors import format_bytes
from ..ir import Function, Instruction, Module, TensorType, verify
from ..ir.printer import Namer, format_instruction
from ..ir.types import DType
from ..plan.liveness import TimelineEntry, liveness
from .memory import MemoryTracker, storage_of

_K_KERNEL, _K_CALL, _K_FREE, _K_BR, _K_COND_BR, _K_RETURN = range(6)


def _torch():
    import torch

    return torch


def _tk():
    from ..backends import torch_kernels

    return torch_kernels


def _to_numpy(x: Any) -> np.ndarray:
    return x if type(x) is np.ndarray else _tk().to_numpy(x)


def _to_torch(x: Any):
    return _tk().to_torch(x)


_CONVERT = {"numpy": _to_numpy, "torch": _to_torch}


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


@dataclass
class RunStats:
    """Measurements of one run (bytes and seconds).

    ``timeline``: one :class:`TimelineEntry` per executed instruction of the function run
    (``index`` is the position in ``fn.instructions()``; a call counts as one instruction whose
    high-water mark includes the callee's). ``instr_times``: (index, op name, seconds) in execution
    order. ``peak_at``: the instruction during which ``peak_bytes`` was first reached (None when
    the arguments alone are the peak).
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

    def time_by_op(self) -> dict[str, float]:
        """Seconds per op name, largest first."""
        out: dict[str, float] = {}
        for _, name, s in self.instr_times:
            out[name] = out.get(name, 0.0) + s
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def __str__(self) -> str:
        where = "the arguments" if self.peak_at is None else f"instruction {self.peak_index}: {_fmt(self.peak_at)}"
        lines = [f"run of @{self.function}: {len(self.instr_times)} instructions in {self.total_seconds * 1e3:.2f} ms",
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


# ---------------------------------------------------------------- execution plan
class _Step:
    """One precomputed instruction: what to call, which slots to read and write, what to release."""

    __slots__ = ("kind", "index", "ins", "name", "fn", "conv", "attrs", "ins_slots", "out_slots", "alias",
                 "expect", "single", "rel", "rel_top", "targets", "callee", "cond")


class _Target:
    __slots__ = ("block", "src", "dst", "rel", "rel_top")


class _BlockPlan:
    __slots__ = ("arg_slots", "dead", "dead_top", "steps")


class _FnPlan:
    __slots__ = ("fn", "nslots", "param_slots", "blocks", "arg_dialect", "uses_torch")


def _expect(t: TensorType, dialect: str):
    """(numpy dtype, torch dtype or None, shape, nbytes) of a result type."""
    tdt = _tk().TORCH_DTYPE[t.dtype] if dialect == "torch" or "torch" in sys.modules else None
    return (t.dtype.numpy, tdt, t.shape, t.nbytes)


class VM:
    """Runs the functions of a module; prepared once (dialects assigned, plans built), reusable.

    ``dialects``: the dialects to use (default: the globally enabled ones). Instructions already
    carrying an enabled dialect keep it; the others are assigned the best enabled dialect.
    """

    def __init__(self, module: Module | Function, dialects: Sequence[str] | str | None = None):
        if isinstance(module, Function):
            module = module.module if module.module is not None else Module([module.clone()])
        verify(module)
        self.dialects = backends.resolve(dialects)
        m = module.clone()
        for f in m:
            for ins in f.instructions():
                if ins.op.name in backends.CONTROL_OPS:
                    ins.dialect = None
                elif ins.dialect is None or ins.dialect not in self.dialects:
                    ins.dialect = backends.select(ins, self.dialects).dialect
        self.module = m
        self._plans: dict[str, _FnPlan] = {}
        for f in m:
            if not f.is_declaration:
                self._plans[f.name] = self._plan(f)
        self._uses_torch = any(p.uses_torch for p in self._plans.values())

    # -------------------------------------------------------------- planning
    def _plan(self, fn: Function) -> _FnPlan:
        lv = liveness(fn)
        slot: dict = {}
        for b in fn.blocks:
            for a in b.args:
                slot[a] = len(slot)
            for ins in b.instrs:
                for r in ins.results:
                    slot[r] = len(slot)
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
        p.blocks = []
        p.arg_dialect = None
        p.uses_torch = False
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
                st.fn = st.conv = st.targets = st.callee = st.cond = None
                st.alias = tuple(ins.op.aliases.get(k, -1) for k in range(len(ins.results)))
                st.expect = ()
                name = st.name
                if name == "call":
                    st.kind = _K_CALL
                    st.callee = ins.attrs["callee"]
                    callee = fn.module[st.callee]
                    if callee.is_declaration:
                        raise ValueError(f"@{fn.name} calls @{st.callee}, a gradient declaration not yet "
                                         f"differentiated; run the 'grad' pass first")
                elif name == "free":
                    st.kind = _K_FREE
                elif name == "return":
                    st.kind = _K_RETURN
                elif name in ("br", "cond_br"):
                    st.kind = _K_BR if name == "br" else _K_COND_BR
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
                    st.kind = _K_KERNEL
                    impl = backends.kernel_for(ins, ins.dialect)
                    st.fn = impl.fn
                    st.conv = _CONVERT[ins.dialect]
                    st.expect = tuple(_expect(r.type, ins.dialect) for r in ins.results)
                    if ins.dialect == "torch":
                        p.uses_torch = True
                    if p.arg_dialect is None:
                        p.arg_dialect = ins.dialect
                bp.steps.append(st)
            p.blocks.append(bp)
        return p

    # -------------------------------------------------------------- running
    def function(self, name: str | Function) -> Function:
        """The prepared (dialect-assigned) copy of a function of the module."""
        return self.module[name.name if isinstance(name, Function) else name]

    def run(self, fn: str | Function, *args: Any, donate: bool = False,
            outputs: str = "numpy", on_step: Callable[[TimelineEntry], None] | None = None
            ) -> tuple[tuple[Any, ...], RunStats]:
        """Run ``fn`` on NumPy arrays / torch tensors; returns (results, :class:`RunStats`).

        ``donate``: the arguments become the VM's and are released at their last use (by
        default they belong to the caller and stay counted for the whole run).
        ``outputs``: "numpy" (default) or "torch".
        ``on_step``: called after each top-level instruction with its timeline entry (for
        cross-checks such as tracemalloc; adds a call per instruction).
        """
        if outputs not in ("numpy", "torch"):
            raise ValueError(f"outputs must be 'numpy' or 'torch', got {outputs!r}")
        name = fn.name if isinstance(fn, Function) else fn
        if name not in self._plans:
            raise KeyError(f"no runnable function @{name} in this VM; it has {', '.join('@' + n for n in self._plans)}")
        plan = self._plans[name]
        f = plan.fn
        ptypes = f.param_types
        if len(args) != len(ptypes):
            raise TypeError(f"@{name} takes {len(ptypes)} argument(s) ({', '.join(map(str, ptypes))}), got {len(args)}")
        conv = _CONVERT[plan.arg_dialect] if plan.arg_dialect else None
        xs = []
        for i, (a, t) in enumerate(zip(args, ptypes)):
            got = tensor_type_of(a)
            if got != t:
                raise TypeError(f"argument {i} of @{name}: expected {t}, got {got}")
            if not _is_dense(a):
                a = _dense_copy(a)
            xs.append(conv(a) if conv is not None else a)

        tracker = MemoryTracker()
        rec = _Recorder(on_step)
        t0 = time.perf_counter()
        # IEEE semantics: NaN and inf are values, not errors (NumPy would warn; torch does not).
        with np.errstate(all="ignore"):
            if self._uses_torch:
                with _torch().no_grad():
                    res = self._exec(plan, xs, None, tracker, donate, rec)
            else:
                res = self._exec(plan, xs, None, tracker, donate, rec)
        total = time.perf_counter() - t0
        outs, _ = res
        cv = _to_numpy if outputs == "numpy" else _to_torch
        outs = tuple(cv(o) for o in outs)
        at = rec.peak_index
        stats = RunStats(name, rec.peak, rec.timeline, rec.times, total,
                         None if at is None else plan_instr(plan, at), at, tracker.live_bytes, rec.arg_bytes)
        return outs, stats

    def _exec(self, plan: _FnPlan, xs: list, keys_in: list | None, tracker: MemoryTracker, donate: bool,
              rec: "_Recorder | None"):
        """Execute one frame. ``keys_in`` None: top level (arguments are acquired fresh)."""
        frame: list = [None] * plan.nslots
        keys: list = [None] * plan.nslots
        top = keys_in is None
        release = tracker.release
        for i, s in enumerate(plan.param_slots):
            frame[s] = xs[i]
            if top:
                keys[s] = tracker.acquire(xs[i])
            else:
                keys[s] = keys_in[i]
                tracker.acquire_key(keys_in[i])
        use_top = top and not donate  # parameters stay live (they belong to the caller)
        if rec is not None:
            rec.start(tracker)
        blocks = plan.blocks
        bp = blocks[0]
        for s in (bp.dead_top if use_top else bp.dead):
            release(keys[s])
            frame[s] = keys[s] = None
        perf = time.perf_counter
        while True:
            nxt = None
            for st in bp.steps:
                if rec is not None:
                    t0 = perf()
                    saved_peak = tracker.peak_bytes
                    tracker.peak_bytes = tracker.live_bytes
                kind = st.kind
                if kind == _K_KERNEL:
                    conv = st.conv
                    try:
                        out = st.fn(*[conv(frame[s]) for s in st.ins_slots], **st.attrs)
                    except Exception as e:
                        raise RuntimeError(f"kernel '{st.ins.dialect}.{st.name}' failed in @{plan.fn.name} at "
                                           f"instruction {st.index}: {_fmt(st.ins)}\n  {type(e).__name__}: {e}") from e
                    if st.single:
                        self._store(plan, st, 0, out, frame, keys, tracker)
                    else:
                        for r in range(len(out)):
                            self._store(plan, st, r, out[r], frame, keys, tracker)
                    out = None  # hold no reference to a released (dead) result
                elif kind == _K_CALL:
                    callee = self._plans[st.callee]
                    outs, okeys = self._exec(callee, [frame[s] for s in st.ins_slots],
                                             [keys[s] for s in st.ins_slots], tracker, True, None)
                    for s, o, k in zip(st.out_slots, outs, okeys):
                        frame[s] = o
                        keys[s] = k  # the callee took this reference on our behalf
                elif kind == _K_RETURN:
                    outs = [frame[s] for s in st.ins_slots]
                    okeys = [keys[s] for s in st.ins_slots]
                    for k in okeys:
                        tracker.acquire_key(k)  # the caller's reference
                    if not top:
                        for s in range(plan.nslots):
                            if keys[s] is not None:
                                release(keys[s])
                    if rec is not None:
                        rec.step(st, tracker, t0, saved_peak)
                    return outs, okeys
                elif kind == _K_FREE:
                    pass
                else:  # br, cond_br
                    if kind == _K_BR:
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
                    if rec is not None:
                        rec.step(st, tracker, t0, saved_peak)
                    break
                for s in (st.rel_top if use_top else st.rel):
                    release(keys[s])
                    frame[s] = keys[s] = None
                if rec is not None:
                    rec.step(st, tracker, t0, saved_peak)
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
                key = tracker.acquire(o)
            else:
                tracker.add(key, size, owner)
        s = st.out_slots[r]
        frame[s] = o
        keys[s] = key


def _is_contig(x: Any) -> bool:
    return x.flags.c_contiguous if isinstance(x, np.ndarray) else x.is_contiguous()


def plan_instr(plan: _FnPlan, index: int) -> Instruction:
    for bp in plan.blocks:
        for st in bp.steps:
            if st.index == index:
                return st.ins
    raise IndexError(index)


class _Recorder:
    """Per-instruction live bytes, high-water marks and times of the top-level frame."""

    __slots__ = ("timeline", "times", "peak", "peak_index", "arg_bytes", "on_step")

    def __init__(self, on_step: Callable[[TimelineEntry], None] | None = None) -> None:
        self.on_step = on_step
        self.timeline: list[TimelineEntry] = []
        self.times: list[tuple[int, str, float]] = []
        self.peak = 0
        self.peak_index: int | None = None
        self.arg_bytes = 0

    def start(self, tracker: MemoryTracker) -> None:
        self.arg_bytes = self.peak = tracker.live_bytes

    def step(self, st: _Step, tracker: MemoryTracker, t0: float, saved_peak: int) -> None:
        hw = tracker.peak_bytes
        e = TimelineEntry(st.index, tracker.live_bytes, hw)
        self.timeline.append(e)
        if hw > self.peak:
            self.peak, self.peak_index = hw, st.index
        tracker.peak_bytes = max(saved_peak, hw)
        self.times.append((st.index, st.name, time.perf_counter() - t0))
        if self.on_step is not None:
            self.on_step(e)


def run(target: Any, *args: Any, dialects: Sequence[str] | str | None = None, donate: bool = False,
        outputs: str = "numpy") -> tuple[tuple[Any, ...], RunStats]:
    """Run a Function (or an object with ``__remat_function__()``) on arrays; returns (results, stats).

    Builds a fresh :class:`VM` each call; keep a ``VM`` to run the same module many times.
    """
    fn = target.__remat_function__() if hasattr(target, "__remat_function__") else target
    if not isinstance(fn, Function):
        raise TypeError(f"remat.run needs a remat Function or a staged function, got {type(target).__name__}")
    vm = VM(fn.module if fn.module is not None else Module([fn.clone()]), dialects=dialects)
    return vm.run(fn.name, *args, donate=donate, outputs=outputs)


__all__ = ["RunStats", "TimelineEntry", "VM", "run", "tensor_type_of"]
