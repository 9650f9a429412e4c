"""The ``numba`` dialect: generated loop kernels for ``fused`` element-wise bodies; dropout masks, max pooling
and batch norm statistics.

One kernel per *pattern* (body, operand dtypes, how each operand broadcasts, serial or parallel):
its Python source is written to the kernel cache directory (``$REMAT_CACHE_DIR``, default
``~/.cache/remat/kernels``) and compiled by Numba with ``cache=True`` and an explicit signature,
so a second process loads the machine code from disk and compiles nothing
(:func:`compile_count` counts real compilations in this process).

Bit-exactness with the torch kernels of the same nodes: each node is one IEEE operation in the
node's dtype (no fast-math, so no FMA contraction or reassociation; ``error_model="numpy"`` so a
division by zero gives inf/nan as torch does). :data:`NODE_CODE` lists what the generator supports;
the checker refuses any other body, which then runs on the torch dialect's interpreter.
bf16 values travel through a kernel as f32 (every bf16 is exactly an f32): loaded from the uint16
bits of their arrays, each node computed in f32, as torch's bf16 kernels compute, and its result
rounded to bf16 (round to nearest even, :func:`_bf16_round_lines`) when the node's dtype is bf16,
so a chain of bf16 nodes rounds after every node exactly as the nodes run one by one do. A node mixing
bf16 with f64 is refused (torch computes such a scalar operand in f32). Not in the table because torch's CPU kernels are not correctly rounded, so no generated code can
match them bit for bit: ``sqrt``/``rsqrt`` (torch's f32 sqrt is off by one ulp against IEEE, measured
on AVX-512) and every transcendental (exp, log, tanh, erf, …). ``maximum``/``minimum`` are left out
because torch's signed-zero and NaN results differ between its vector and scalar paths.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .._jit import cache_files, no_locator, remove_files, warn_uncached
from ..cache import cache_root, read_entry, write_entry  # noqa: F401  (also remat.backends.numba_kernels.cache_root)
from ..ir import Instruction, Module
from ..ir.ops.fused import Body, parse_body
from ..ir.types import DType
from . import kernel, out_kernel

FLOATS = (DType.f32, DType.f64)  # what the pooling and statistics kernels take
BODY_FLOATS = FLOATS + (DType.bf16,)  # what generated element-wise kernels take
_NB_TYPE = {DType.f32: "float32", DType.f64: "float64", DType.bool: "boolean", DType.i32: "int32",
            DType.i64: "int64", DType.bf16: "float32"}  # a bf16 value is held as the f32 of the same value
_ARRAY_TYPE = {**_NB_TYPE, DType.bf16: "uint16"}  # bf16 arrays are passed as their bits

# op -> (operand dtypes accepted, code template over the operands {0}, {1}, …; {z}/{o} zero/one of the dtype)
NODE_CODE: dict[str, tuple[tuple[DType, ...], str]] = {
    "add": (BODY_FLOATS, "({0} + {1})"),
    "sub": (BODY_FLOATS, "({0} - {1})"),
    "mul": (BODY_FLOATS, "({0} * {1})"),
    "div": (BODY_FLOATS, "({0} / {1})"),
    "neg": (BODY_FLOATS, "(-{0})"),
    "abs": (BODY_FLOATS, "abs({0})"),
    "relu": (BODY_FLOATS, "({z} if {0} < {z} else {0})"),  # torch's clamp_min(x, 0): keeps -0.0 and nan
    "relu_grad": (BODY_FLOATS, "({z} if {1} <= {z} else {0})"),  # torch's threshold_backward(g, y, 0)
    "eq": (BODY_FLOATS + (DType.i32, DType.i64), "({0} == {1})"),
    "ne": (BODY_FLOATS + (DType.i32, DType.i64), "({0} != {1})"),
    "lt": (BODY_FLOATS + (DType.i32, DType.i64), "({0} < {1})"),
    "le": (BODY_FLOATS + (DType.i32, DType.i64), "({0} <= {1})"),
    "gt": (BODY_FLOATS + (DType.i32, DType.i64), "({0} > {1})"),
    "ge": (BODY_FLOATS + (DType.i32, DType.i64), "({0} >= {1})"),
    "select": ((DType.bool,) + BODY_FLOATS, "({1} if {0} else {2})"),
    "not": ((DType.bool,), "(not {0})"),
    "and": ((DType.bool,), "({0} and {1})"),
    "or": ((DType.bool,), "({0} or {1})"),
    "cast": ((DType.bool, DType.i32, DType.i64) + BODY_FLOATS, "np.{dt}({0})"),
}
_CAST_TO = BODY_FLOATS  # casts to f32/f64 are exactly rounded by the hardware, as in torch; to bf16 by
# _bf16_round_lines, as torch rounds (from f32, bf16 and bool only: torch rounds a wider source twice)
_BF16_SOURCES = (DType.f32, DType.bf16, DType.bool)

PARALLEL_MIN_ELEMENTS = 1 << 20  # below this, handing half the work to a thread costs more than it gives
# (vectorised kernels take ~0.3 ns per f32 element: 1 << 20 elements are ~0.3 ms, where a thread hand-off
# of tens of µs, and torch's intra-op threads still spinning after the previous op, no longer dominate)
THREADS = max(1, min(os.cpu_count() or 1, 8))


def threads() -> int:
    """Threads a parallel kernel may use now: :data:`THREADS`, and no more than torch's intra-op
    threads when torch is loaded (``torch.set_num_threads(1)`` makes every kernel serial)."""
    torch = sys.modules.get("torch")
    return THREADS if torch is None else max(1, min(THREADS, torch.get_num_threads()))


def _empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous result array from PyTorch's CPU allocator when torch is loaded, so
    that torch.profiler's memory events (remat's allocator measurements, ``bench/``'s peaks) see the
    numba kernels' results as they see torch's; from NumPy's otherwise."""
    torch = sys.modules.get("torch")
    if torch is None:
        return np.empty(shape, dtype)
    if np.dtype(dtype) == _BF16:  # NumPy has no bf16: the tensor's bits, viewed as ml_dtypes' bfloat16
        return torch.empty(tuple(shape), dtype=torch.bfloat16).view(torch.int16).numpy().view(_BF16)
    return torch.empty(tuple(shape), dtype=_torch_dtype(np.dtype(dtype))).numpy()


_BF16 = DType.bf16.numpy


def _bits(a: np.ndarray) -> np.ndarray:
    """What a generated kernel takes for an array: the uint16 bits of a bf16 one, any other as it is."""
    return a.view(np.uint16) if a.dtype == _BF16 else a


_TORCH_DTYPES: dict = {}


def _torch_dtype(dt: np.dtype):
    t = _TORCH_DTYPES.get(dt)
    if t is None:
        import torch

        t = _TORCH_DTYPES[dt] = torch.from_numpy(np.empty(0, dt)).dtype
    return t


def _run_parts(fn: Callable, rows: int, parts: int, *args: Any) -> None:
    """``fn(lo, hi, *args)`` over ``parts`` contiguous slices of ``range(rows)``: the first on this
    thread, the others on pool threads meanwhile (``fn`` releases the GIL)."""
    bounds = [(rows * k // parts, rows * (k + 1) // parts) for k in range(parts)]
    futs = [_pool().submit(fn, lo, hi, *args) for lo, hi in bounds[1:]]
    try:
        fn(*bounds[0], *args)
    finally:
        for f in futs:
            f.result()


def node_supported(op: str, in_dtypes: tuple[DType, ...], attrs: dict) -> bool:
    """Whether the generator emits ``op`` on these operand dtypes bit-exactly (see :data:`NODE_CODE`)."""
    if op == "constant":
        return attrs["dtype"] in BODY_FLOATS + (DType.bool, DType.i32, DType.i64)
    spec = NODE_CODE.get(op)
    if spec is None:
        return False
    ok, _ = spec
    if DType.bf16 in in_dtypes and DType.f64 in in_dtypes:
        return False
    if op == "select":
        return in_dtypes[0] == DType.bool and in_dtypes[1] in BODY_FLOATS and in_dtypes[2] in BODY_FLOATS
    if op == "cast":
        to = attrs["dtype"]
        return in_dtypes[0] in ok and to in _CAST_TO and (to != DType.bf16 or in_dtypes[0] in _BF16_SOURCES)
    return all(d in ok for d in in_dtypes)


def body_supported(body: Body, types) -> bool:
    vals = body.value_types(list(types))
    return all(node_supported(n.op, tuple(vals[a].dtype for a in n.args), n.attr_dict) for n in body.nodes)


def _check(ins: Instruction) -> bool:
    try:
        body = parse_body(ins.attrs["body"])
        return body_supported(body, [v.type for v in ins.operands])
    except (TypeError, KeyError):
        return False


# ---------------------------------------------------------------- patterns and code generation
@dataclass(frozen=True)
class Pattern:
    """What one generated kernel is specialised on (a cache key)."""

    body: str
    in_dtypes: tuple[DType, ...]
    full: tuple[tuple[bool, ...], ...]  # per operand, per collapsed dim: full extent (True) or broadcast
    # The operand the first result is written over (remat.ir.reuse), -1 for none. That operand is not
    # an argument of its own: the kernel reads it from the first output array, so that LLVM sees one
    # array read and written at the same index (two arguments that overlap fail its runtime alias
    # check and run the scalar loop, several times slower).
    over: int = -1

    @property
    def rank(self) -> int:
        return len(self.full[0]) if self.full else 1

    def key(self) -> str:
        text = repr((self.body, [d.value for d in self.in_dtypes], self.full, _GEN_VERSION)
                    + ((self.over,) if self.over >= 0 else ()))
        return hashlib.sha256(text.encode()).hexdigest()[:20]


_GEN_VERSION = 5  # bump when the generated code changes (5: bf16 operands and results)


def collapse(out_shape: tuple[int, ...], in_shapes: list[tuple[int, ...]]
             ) -> tuple[tuple[int, ...], list[tuple[int, ...]], tuple[tuple[bool, ...], ...]]:
    """Merge adjacent dims where every operand broadcasts alike: (iteration shape, operand shapes, full flags).

    Dims of extent 1 go; operands are reshaped (zero-copy, they are contiguous) to the collapsed rank
    with 1 where they broadcast.
    """
    r = len(out_shape)
    padded = [(1,) * (r - len(s)) + tuple(s) for s in in_shapes]
    dims: list[int] = []
    flags: list[tuple[bool, ...]] = []
    for d in range(r):
        n = out_shape[d]
        if n == 1:
            continue
        f = tuple(p[d] == n for p in padded)
        if flags and flags[-1] == f:
            dims[-1] *= n
        else:
            dims.append(n)
            flags.append(f)
    if not dims:
        dims, flags = [1], [tuple(True for _ in in_shapes)]
    shapes = [tuple(n if fl[i] else 1 for n, fl in zip(dims, flags)) for i in range(len(in_shapes))]
    full = tuple(tuple(fl[i] for fl in flags) for i in range(len(in_shapes)))
    return tuple(dims), shapes, full


def _const(value: Any, dt: DType) -> str:
    if dt == DType.bool:
        return "True" if value else "False"
    if dt.is_int:
        return f"np.{_NB_TYPE[dt]}({int(value)})"
    v = float(np.asarray(value, dtype=dt.numpy))  # a bf16 constant: its bf16 value
    lit = "math.nan" if math.isnan(v) else ("math.inf" if v == math.inf else ("-math.inf" if v == -math.inf else repr(v)))
    return f"np.{_NB_TYPE[dt]}({lit})"


_VALUE_KEEPING = frozenset({"select", "relu", "relu_grad", "neg", "abs"})
"""Ops whose result is one of their operands' values (or zero, or its sign flipped): on bf16 operands,
a bf16 value, with nothing to round."""


def _bf16_load(array_item: str) -> str:
    """The f32 value of a bf16 array element (its bits are the high half of the f32's)."""
    return f"np.uint32(np.uint32({array_item}) << np.uint32(16)).view(np.float32)"


def _bf16_round_lines(ind: str, name: str, expr: str) -> list[str]:
    """Lines binding ``name`` to the f32 ``expr`` rounded to bf16 (to nearest, ties to even), as torch's
    f32 -> bf16 conversion rounds; NaN stays NaN (its payload aside: torch's vector and scalar paths
    give different NaN bits)."""
    return [f"{ind}t_{name} = np.float32({expr})",
            f"{ind}u_{name} = t_{name}.view(np.uint32)",
            f"{ind}{name} = (np.uint32((u_{name} + np.uint32(32767) + ((u_{name} >> np.uint32(16)) & np.uint32(1)))"
            f" & np.uint32(0xFFFF0000)).view(np.float32) if t_{name} == t_{name} else np.float32(math.nan))"]


def _bf16_bits(value: str) -> str:
    """The uint16 bits of a bf16 value held as an f32."""
    return f"np.uint16(np.float32({value}).view(np.uint32) >> np.uint32(16))"


def generate(p: Pattern, out_dtypes: tuple[DType, ...]) -> str:
    """The Python source of the kernel for a pattern: ``kernel(lo, hi, out0, …, in0, …)`` on collapsed arrays,
    computing rows ``lo:hi`` of the outermost dimension (threads split that range; ``nogil``)."""
    from ..ir import TensorType

    body = parse_body(p.body)
    n_in = body.num_inputs
    vals = body.value_types([TensorType(d, ()) for d in p.in_dtypes])
    rank = p.rank
    idx = [f"j{d}" for d in range(rank)]
    outs = [f"o{k}" for k in range(len(body.outputs))]
    ins = [f"i{k}" for k in range(n_in)]
    own = [k for k in range(n_in) if k != p.over]  # operands passed as arguments of their own
    if p.over >= 0:
        ins[p.over] = outs[0]
    lines = ["import math", "import numpy as np", ""]
    sig = ", ".join(f"{_ARRAY_TYPE[t]}[{', '.join([':'] * (rank - 1) + ['::1'])}]"
                    for t in list(out_dtypes) + [p.in_dtypes[k] for k in own])
    lines += [f'SIGNATURE = "void(int64, int64, {sig})"  # compiled by load_kernel: Numba, cache=True', "",
              f"def kernel({', '.join(['lo', 'hi'] + outs + [ins[k] for k in own])}):"]
    consts = {}
    for k, n in enumerate(body.nodes):
        if n.op == "constant":
            a = n.attr_dict
            consts[n_in + k] = f"c{n_in + k}"
            lines.append(f"    c{n_in + k} = {_const(a['value'], a['dtype'])}")
    zero = {DType.f32: "np.float32(0.0)", DType.f64: "np.float64(0.0)", DType.bf16: "np.float32(0.0)"}
    # Rows lo:hi as views indexed from 0: a loop starting at 0 lets LLVM drop the negative-index
    # wrap-around and vectorise (a loop over range(lo, hi) runs ~8x slower on f32).
    for a in outs + [ins[k] for k in own if p.full[k][0]]:
        lines.append(f"    {a} = {a}[lo:hi]")
    lines.append(f"    {', '.join(f'n{d}' for d in range(rank))}, = {outs[0]}.shape")
    # Nodes that vary along the innermost dim only (a per-channel scale of a channels-last tensor) are
    # computed once per call into a vector, before the main loop: LLVM hoists loop invariants out of
    # inner loops, not out of outer ones. The same operations in the same order: the same bits.
    inner = rank - 1
    deps: dict[int, frozenset[int]] = {k: frozenset(d for d in range(rank) if p.full[k][d]) for k in range(n_in)}
    for k, n in enumerate(body.nodes):
        deps[n_in + k] = frozenset().union(*(deps[a] for a in n.args)) if n.args else frozenset()
    hoisted: list[int] = []
    for k, n in enumerate(body.nodes):  # in order: a node is hoisted when its node operands are
        v = n_in + k
        if (rank > 1 and n.op != "constant" and deps[v] == {inner} and vals[v].dtype in BODY_FLOATS
                and all(a < n_in or a in hoisted or a in consts for a in n.args)):
            hoisted.append(v)

    def emit(ind: str, nodes: list[int], names: dict[int, str], index: list[str]) -> None:
        needed = set(nodes)
        for v in reversed(nodes):
            needed.update(body.nodes[v - n_in].args)
        for k in range(n_in):
            if k in needed:
                sub = ", ".join(index[d] if p.full[k][d] else "0" for d in range(rank))
                names[k] = f"v{k}"
                item = f"{ins[k]}[{sub}]"
                lines.append(f"{ind}v{k} = {_bf16_load(item) if p.in_dtypes[k] == DType.bf16 else item}")
        for v in nodes:
            n = body.nodes[v - n_in]
            _, tmpl = NODE_CODE[n.op]
            a0 = vals[n.args[0]].dtype if n.args else vals[v].dtype
            expr = tmpl.format(*(names[a] for a in n.args), z=zero.get(a0, "0"),
                               dt=_NB_TYPE.get(n.attr_dict.get("dtype"), ""))
            names[v] = f"v{v}"
            if vals[v].dtype == DType.bf16 and n.op not in _VALUE_KEEPING:
                lines.extend(_bf16_round_lines(ind, f"v{v}", expr))
            else:
                lines.append(f"{ind}v{v} = {expr}")

    rest = [n_in + k for k, n in enumerate(body.nodes) if n.op != "constant" and n_in + k not in hoisted]
    read = set(body.outputs).union(*(body.nodes[v - n_in].args for v in rest))
    stored = [v for v in hoisted if v in read]
    if stored:
        for v in stored:
            lines.append(f"    h{v} = np.empty(n{inner}, dtype=np.{_NB_TYPE[vals[v].dtype]})")
        lines.append(f"    for j{inner} in range(n{inner}):")
        emit("        ", hoisted, dict(consts), ["0"] * inner + [f"j{inner}"])
        lines += [f"        h{v}[j{inner}] = v{v}" for v in stored]
    ind = "    "
    for d in range(rank):
        lines.append(f"{ind}for j{d} in range(n{d}):")
        ind += "    "
    names: dict[int, str] = dict(consts)
    for v in stored:
        names[v] = f"h{v}[j{inner}]"
    emit(ind, rest, names, idx)
    sub = ", ".join(idx)
    for k, o in enumerate(body.outputs):
        value = _bf16_bits(names[o]) if out_dtypes[k] == DType.bf16 else names[o]
        lines.append(f"{ind}{outs[k]}[{sub}] = {value}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the on-disk cache
def cache_dir() -> Path:
    """Where generated kernel sources and Numba's compiled code live."""
    return cache_root() / "kernels"


_kernels: dict[str, Callable] = {}
_lock = threading.Lock()
_compiled = 0  # kernels compiled (not loaded from the disk cache) in this process


def compile_count() -> int:
    """How many kernels this process compiled (a disk-cache hit compiles nothing)."""
    return _compiled


def load_kernel(p: Pattern, out_dtypes: tuple[DType, ...]) -> Callable:
    """The compiled kernel of a pattern: from this process, else from the disk cache, else compiled.

    The source file is a cache entry (:func:`remat.cache.write_entry`: a header with the version
    and a checksum, written atomically); one that is damaged is rewritten, with a warning naming
    it. It is written only when missing or damaged: Numba's index of its compiled code is keyed on
    the file's timestamp."""
    key = p.key()
    return _compiled_once(_kernels, key, lambda: _build_kernel(p, out_dtypes, key))


def _build_kernel(p: Pattern, out_dtypes: tuple[DType, ...], key: str) -> Callable:
    """:func:`load_kernel`'s build: the source from the disk cache (written when missing or
    damaged), compiled or loaded from Numba's cache; in memory only where the cache cannot be written."""
    path = cache_dir() / f"k_{key}.py"
    tag = f"kernel:{key}"
    try:
        source = (f"# remat fused kernel; body: {p.body}\n" + generate(p, out_dtypes)).encode()
        cached = read_entry(path, tag, _GEN_VERSION, "kernel cache")
        if cached != source:  # missing, damaged, or another writer's (the source is a function of the key)
            if cached is not None:
                warnings.warn(f"remat: kernel cache entry {path} holds other source than its key's kernel; "
                              "it is written again", RuntimeWarning, stacklevel=2)
            write_entry(path, tag, _GEN_VERSION, source)
    except OSError:  # a cache that cannot be written: compiled in memory, for this process only
        import numba

        ns: dict[str, Any] = {}
        exec(compile(generate(p, out_dtypes), f"<remat kernel {key}>", "exec"), ns)  # noqa: S102
        return numba.njit(ns["SIGNATURE"], error_model="numpy", nogil=True)(ns["kernel"])
    name = f"remat_kernels.k_{key}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return njit_cached(mod.kernel, mod.SIGNATURE, error_model="numpy", nogil=True)


def _compiled_once(table: dict, key: Any, build: Callable[[], Callable]) -> Callable:
    """``table[key]``, made by ``build()`` under the lock the first time it is asked for (checked
    again under the lock: steps on several threads may ask at once); a build that compiled rather
    than loaded Numba's cached code is counted (:func:`compile_count`)."""
    global _compiled
    fn = table.get(key)
    if fn is None:
        with _lock:
            fn = table.get(key)
            if fn is None:
                fn = build()
                if sum(fn.stats.cache_misses.values()):
                    _compiled += 1
                table[key] = fn
    return fn


def njit_cached(py_func: Callable, sigs: Any = None, callees: tuple = (), **options: Any) -> Callable:
    """``numba.njit(sigs, cache=True, **options)(py_func)`` (compiled now when ``sigs`` are given, or
    loaded from Numba's on-disk cache), made safe against a damaged cache: when loading fails with
    Numba's cache files of ``py_func`` present (a truncated or corrupted index or data file raises
    ``UnpicklingError``, ``EOFError``, ...), those files are removed, a ``RuntimeWarning`` names
    their directory, and the function is compiled again (``callees``: the Numba functions it calls,
    whose cached code is loaded while it compiles, are repaired with it). Numba writes its cache files atomically
    itself and ignores an index of another Numba version or of another source file."""
    import numba

    def build(cache: bool = True) -> Callable:
        jit = numba.njit(cache=cache, **options) if sigs is None else numba.njit(sigs, cache=cache, **options)
        return jit(py_func)

    try:
        return build()
    except Exception as e:  # noqa: BLE001  a damaged cache, or a real compile error (raised again below)
        if no_locator(e):  # nowhere to write Numba's cache (a read-only install, no writable home)
            warn_uncached(py_func, e, stacklevel=3)
            return build(cache=False)
        files = _numba_cache_files(py_func, options)
        for callee in callees:
            files += _numba_cache_files(getattr(callee, "py_func", callee), {})
        if not files:
            raise
        removed = remove_files(files)
        warnings.warn(f"remat: Numba's cached code of {py_func.__qualname__} in {files[0].parent} could not be "
                      f"loaded ({type(e).__name__}: {str(e).strip()[:200]}); removed {', '.join(removed) or 'nothing'} "
                      "and compiled it again", RuntimeWarning, stacklevel=2)
        return build()


def _numba_cache_files(py_func: Callable, options: dict[str, Any]) -> list[Path]:
    """The index and data files of ``py_func`` in Numba's cache (where Numba's locator puts them)."""
    import numba

    return cache_files(numba.njit(cache=True, **options)(py_func))  # lazy: compiles and loads nothing


# ---------------------------------------------------------------- the kernel
@dataclass
class _Plan:
    fn: Callable
    in_shapes: list[tuple[int, ...]]
    cshape: tuple[int, ...]
    out_shape: tuple[int, ...]
    out_dtypes: tuple[Any, ...]
    bounds: tuple[tuple[int, int], ...]  # rows of the outermost dim per thread (one part: no threads)


_plans: dict[tuple, _Plan] = {}


def _plan(body_text: str, shapes: tuple, dtypes: tuple, over: int = -1) -> _Plan:
    from ..ir import OPS, TensorType

    body = parse_body(body_text)
    in_dt = tuple(DType.from_numpy(d) for d in dtypes)
    rtypes = OPS["fused"].result_types([TensorType(d, s) for d, s in zip(in_dt, shapes)], {"body": body_text})
    out_shape = rtypes[0].shape
    cshape, in_shapes, full = collapse(out_shape, list(shapes))
    numel = int(np.prod(out_shape, dtype=np.int64))
    pat = Pattern(body.text(), in_dt, full, over)
    out_dt = tuple(t.dtype for t in rtypes)
    fn = load_kernel(pat, out_dt)
    n0 = cshape[0]
    parts = min(THREADS, n0) if numel >= PARALLEL_MIN_ELEMENTS else 1
    bounds = tuple((n0 * k // parts, n0 * (k + 1) // parts) for k in range(parts))
    return _Plan(fn, in_shapes, cshape, out_shape, tuple(d.numpy for d in out_dt), bounds)


@kernel("fused", "numba", checker=_check)
def fused(*args, body):
    """Run the generated kernel of this body; results are fresh C-contiguous arrays."""
    return _fused(args, body, None)


@out_kernel("fused", "numba")
def fused_out(out, *args, body):
    """``fused`` with its first result written into ``out``, an operand of the result's type and
    shape (``remat.ir.reuse``), by a kernel generated for it (``Pattern.over``) that reads that
    operand from its output array: each element is read before its results are stored, and threads
    split rows of all arrays alike."""
    return _fused(args, body, out)


def _fused(args, body, first):
    over = -1 if first is None else next(k for k, a in enumerate(args) if a is first)
    key = (body, tuple(a.shape for a in args), tuple(a.dtype for a in args), over)
    p = _plans.get(key)
    if p is None:
        p = _plans[key] = _plan(*key)
    outs = [_empty(p.out_shape, dt) for dt in p.out_dtypes[1 if first is not None else 0:]]
    if first is not None:
        if not (first.flags.c_contiguous and first.flags.writeable):
            raise ValueError("fused: the operand written in place must be a writeable C-contiguous array")
        outs.insert(0, first)
    ins = [a.reshape(s) if a.flags.c_contiguous and a.flags.writeable else np.ascontiguousarray(a).reshape(s)
           for k, (a, s) in enumerate(zip(args, p.in_shapes)) if k != over]
    arrays = [_bits(a) for a in [o.reshape(p.cshape) for o in outs] + ins]
    if len(p.bounds) == 1 or threads() == 1:
        p.fn(0, p.cshape[0], *arrays)
    else:  # the kernel releases the GIL: the other parts run on pool threads meanwhile
        futs = [_pool().submit(p.fn, lo, hi, *arrays) for lo, hi in p.bounds[1:]]
        p.fn(*p.bounds[0], *arrays)
        for f in futs:
            f.result()
    return outs[0] if len(outs) == 1 else tuple(outs)


_executor = None


def _pool():
    global _executor
    if _executor is None:
        from concurrent.futures import ThreadPoolExecutor

        _executor = ThreadPoolExecutor(max_workers=THREADS - 1, thread_name_prefix="remat-fused")
    return _executor


# ---------------------------------------------------------------- dropout masks
def _mask_py(seed, threshold, out):  # pragma: no cover (compiled by numba; checked against the reference)
    """``out[i] = half i % 2 of SplitMix64 word i // 2 < threshold`` (numpy_kernels.sample_bernoulli)."""
    gamma = np.uint64(0x9E3779B97F4A7C15)
    c1 = np.uint64(0xBF58476D1CE4E5B9)
    c2 = np.uint64(0x94D049BB133111EB)
    low = np.uint64(0xFFFFFFFF)
    n = out.shape[0]
    m = n // 2
    for j in range(m):  # branch-free, so LLVM vectorises it
        z = np.uint64(j + 1) * gamma + seed
        z = (z ^ (z >> np.uint64(30))) * c1
        z = (z ^ (z >> np.uint64(27))) * c2
        z = z ^ (z >> np.uint64(31))
        out[2 * j] = np.uint32(z & low) < threshold
        out[2 * j + 1] = np.uint32(z >> np.uint64(32)) < threshold
    if n % 2:  # the last word of an odd n gives its low half only
        z = np.uint64(m + 1) * gamma + seed
        z = (z ^ (z >> np.uint64(30))) * c1
        z = (z ^ (z >> np.uint64(27))) * c2
        z = z ^ (z >> np.uint64(31))
        out[n - 1] = np.uint32(z & low) < threshold


_mask_fns: dict[None, Callable] = {}


def _mask_kernel() -> Callable:
    """The compiled mask loop (compiled on first use, then loaded from Numba's on-disk cache)."""
    return _compiled_once(_mask_fns, None, lambda: njit_cached(_mask_py, "void(uint64, uint32, boolean[::1])",
                                                                nogil=True))


@kernel("bernoulli", "numba")
def bernoulli(seed, shape, p):
    """The reference's bits (``numpy_kernels.sample_bernoulli``), ~10x faster: one pass, no temporaries."""
    from .numpy_kernels import _M64, bernoulli_threshold

    out = _empty(tuple(shape), np.bool_)
    if p <= 0.0 or p >= 1.0:
        out.fill(p >= 1.0)
        return out
    _mask_kernel()(np.uint64(int(seed) & _M64), np.uint32(bernoulli_threshold(p)), out.reshape(-1))
    return out


# ---------------------------------------------------------------- max pooling
# torch's CPU rule (aten/src/ATen/native/cpu/MaxPoolKernel.cpp), exactly: per window in row-major order
# a value wins when it is greater than the best so far or NaN, starting from -inf at the window's first
# element; the backward adds each output gradient into its window's winner in output raster order per
# plane, as max_pool2d_with_indices_backward does, so results are bit-identical without saving indices.
def _max_pool_fwd_py(lo, hi, x, out, kh, kw, sh, sw, ph, pw):  # pragma: no cover (compiled by numba)
    h, w = x.shape[1], x.shape[2]
    oh_n, ow_n = out.shape[1], out.shape[2]
    for q in range(lo, hi):
        for oh in range(oh_n):
            h0 = oh * sh - ph
            h1 = min(h0 + kh, h)
            h0 = max(h0, 0)
            for ow in range(ow_n):
                w0 = ow * sw - pw
                w1 = min(w0 + kw, w)
                w0 = max(w0, 0)
                m = x.dtype.type(-np.inf)
                for ih in range(h0, h1):
                    for iw in range(w0, w1):
                        v = x[q, ih, iw]
                        m = v if (v > m) | (v != v) else m  # a select, not a branch
                out[q, oh, ow] = m


def _winner_py(xq, h0, h1, w0, w1, w):  # pragma: no cover (compiled by numba)
    """The flat index (in the plane ``xq``) of the window ``[h0, h1) x [w0, w1)``'s winner. Branch-free
    on random data (a select of the index and the value mispredicts every other window, 1.6x slower):
    the index moves by arithmetic, the running max is np.maximum (NaN-propagating like the rule)."""
    m = xq.dtype.type(-np.inf)
    best = h0 * w + w0
    for ih in range(h0, h1):
        for iw in range(w0, w1):
            v = xq[ih, iw]
            c = np.int64((v > m) | (v != v))
            m = np.maximum(m, v)
            best += c * (ih * w + iw - best)
    return best


_winner = _winner_py  # the compiled helper once _pool_kernel has compiled it (kernels call it by this name)


def _max_pool_bwd_py(lo, hi, x, gy, gx, kh, kw, sh, sw, ph, pw):  # pragma: no cover (compiled by numba)
    _max_pool_winners(lo, hi, x, gy, gx, gx, kh, kw, sh, sw, ph, pw, 0)


def _max_pool_idx_py(lo, hi, x, out, idx, kh, kw, sh, sw, ph, pw):  # pragma: no cover (compiled by numba)
    _max_pool_winners(lo, hi, x, out, out, idx, kh, kw, sh, sw, ph, pw, 1)


def _max_pool_winners_py(lo, hi, x, a, b, idx, kh, kw, sh, sw, ph, pw, mode):  # pragma: no cover (compiled by numba)
    """Each window's winner: mode 1 writes it to ``a`` (pooled values) and its index to ``idx``;
    mode 0 adds ``a`` (the output gradient) at it in ``b`` (the input gradient, zeroed first), in
    output raster order per plane as ATen's backward does."""
    h, w = x.shape[1], x.shape[2]
    oh_n, ow_n = a.shape[1], a.shape[2]
    xf = x.reshape(x.shape[0], h * w)
    for q in range(lo, hi):
        xq = x[q]
        if mode == 0:
            b[q][:] = 0
        bf = b[q].reshape(b.shape[1] * b.shape[2])
        for oh in range(oh_n):
            h0 = oh * sh - ph
            h1 = min(h0 + kh, h)
            h0 = max(h0, 0)
            for ow in range(ow_n):
                w0 = ow * sw - pw
                best = _winner(xq, h0, h1, max(w0, 0), min(w0 + kw, w), w)
                if mode == 1:
                    a[q, oh, ow] = xf[q, best]  # the winner itself, so a zero's sign is the winner's too
                    idx[q, oh, ow] = best
                else:
                    bf[best] += a[q, oh, ow]


_max_pool_winners = _max_pool_winners_py  # compiled by _pool_kernel, like _winner


def _max_pool_scatter_py(lo, hi, gy, idx, gx):  # pragma: no cover (compiled by numba)
    n = gy.shape[1]
    for q in range(lo, hi):
        gq = gx[q]
        gq[:] = 0
        for o in range(n):
            gq[idx[q, o]] += gy[q, o]


def _pool_sig(which: str, t: str, i: str) -> str:
    """The signature of pooling loop ``which`` on ``t`` planes (``float32``, ``float64``) with ``i``
    indices (``int32``, ``int64``; the forward and backward have none)."""
    ints = ", ".join(["int64"] * 6)
    if which == "fwd":
        return f"void(int64, int64, {t}[:, :, ::1], {t}[:, :, ::1], {ints})"
    if which == "bwd":
        return f"void(int64, int64, {t}[:, :, ::1], {t}[:, :, ::1], {t}[:, :, ::1], {ints})"
    if which == "idx":
        return f"void(int64, int64, {t}[:, :, ::1], {t}[:, :, ::1], {i}[:, :, ::1], {ints})"
    return f"void(int64, int64, {t}[:, ::1], {i}[:, ::1], {t}[:, ::1])"  # scatter


_POOL_PY = {"fwd": _max_pool_fwd_py, "bwd": _max_pool_bwd_py, "idx": _max_pool_idx_py, "scatter": _max_pool_scatter_py}
_POOL_OPS = {"max_pool2d": "fwd", "max_pool2d_grad": "bwd", "max_pool2d_with_indices": "idx",
             "max_pool2d_index_grad": "scatter"}
_pool_fns: dict[tuple[str, str, str], Callable] = {}


def _pool_kernel(which: str, dtype: Any, index_dtype: Any = None) -> Callable:
    """A compiled pooling loop (``_POOL_PY``) for ``dtype`` planes and ``index_dtype`` indices (numpy
    dtypes), compiled on first use, then cached: each combination of its own (a float32 model never
    compiles the float64 loops), its signature exact."""
    key = (which, np.dtype(dtype).name, "" if index_dtype is None else np.dtype(index_dtype).name)

    def build() -> Callable:
        global _winner, _max_pool_winners
        if _winner is _winner_py:  # the helpers the kernels call, compiled first (numba binds globals)
            _winner = njit_cached(_winner_py, nogil=True, error_model="numpy")
            _max_pool_winners = njit_cached(_max_pool_winners_py, nogil=True, error_model="numpy")
        return njit_cached(_POOL_PY[which], [_pool_sig(which, *key[1:])], callees=(_winner, _max_pool_winners),
                           nogil=True, error_model="numpy")

    return _compiled_once(_pool_fns, key, build)


def _pool_check(ins: Instruction) -> bool:
    x = ins.operands[0].type
    return (x.dtype in FLOATS and len(x.shape) == 4 and all(v.type.dtype == x.dtype for v in ins.operands)
            and ins.attrs.get("layout", "NCHW") == "NCHW")  # NHWC: ATen's channels-last kernels


def _index_grad_check(ins: Instruction) -> bool:
    gy, idx = (v.type for v in ins.operands)
    return (gy.dtype in FLOATS and len(gy.shape) == 4 and idx.dtype in (DType.i32, DType.i64)
            and ins.attrs.get("layout", "NCHW") == "NCHW")


def _planes(a: np.ndarray) -> np.ndarray:
    """``a`` (N, C, H, W) as (N*C, H, W), C-contiguous and writeable (a view when it already is)."""
    if not (a.flags.c_contiguous and a.flags.writeable):
        a = np.array(a, order="C", copy=True)
    return a.reshape(-1, a.shape[2], a.shape[3])


def _pool_out_shape(x_shape, kernel, stride, padding) -> tuple[int, ...]:
    n, c, h, w = x_shape
    return (n, c, (h + 2 * padding[0] - kernel[0]) // stride[0] + 1, (w + 2 * padding[1] - kernel[1]) // stride[1] + 1)


def _pool_parts(out_shape: tuple[int, ...], kernel) -> int:
    """Threads for a pooling kernel: planes are independent, so they split exactly (same bits on any
    split); worth it when the elements visited (output elements x window) reach the threshold."""
    planes = out_shape[0] * out_shape[1]
    visits = planes * out_shape[2] * out_shape[3] * kernel[0] * kernel[1]
    return 1 if visits < PARALLEL_MIN_ELEMENTS else max(1, min(threads(), planes))


@kernel("max_pool2d", "numba", checker=_pool_check)
def max_pool2d(x, kernel, stride, padding=(0, 0), layout="NCHW"):
    """torch's max pooling, bit for bit, in one pass (torch's NCHW CPU kernel is several times slower)."""
    out = _empty(_pool_out_shape(x.shape, kernel, stride, padding), x.dtype)
    o3 = out.reshape(-1, out.shape[2], out.shape[3])
    _run_parts(_pool_kernel("fwd", x.dtype), o3.shape[0], _pool_parts(out.shape, kernel), _planes(x), o3, *kernel,
               *stride, *padding)
    return out


@kernel("max_pool2d_grad", "numba", checker=_pool_check)
def max_pool2d_grad(x, gy, kernel, stride, padding=(0, 0), layout="NCHW"):
    """Each window's gradient into its winner (torch's rule), without recomputing the forward's indices."""
    gx = _empty(x.shape, x.dtype)
    g3 = gx.reshape(-1, x.shape[2], x.shape[3])
    _run_parts(_pool_kernel("bwd", x.dtype), g3.shape[0], _pool_parts(gy.shape, kernel), _planes(x), _planes(gy), g3,
               *kernel, *stride, *padding)
    return gx


@kernel("max_pool2d_with_indices", "numba", checker=_pool_check)
def max_pool2d_with_indices(x, kernel, stride, padding=(0, 0), index_dtype=DType.i64, layout="NCHW"):
    """max_pool2d and each window's flat winner index in one pass (torch's rule, as ``max_pool2d``)."""
    out = _empty(_pool_out_shape(x.shape, kernel, stride, padding), x.dtype)
    idx = _empty(out.shape, index_dtype.numpy)
    o3 = out.reshape(-1, out.shape[2], out.shape[3])
    _run_parts(_pool_kernel("idx", x.dtype, idx.dtype), o3.shape[0], _pool_parts(out.shape, kernel), _planes(x), o3,
               idx.reshape(o3.shape), *kernel, *stride, *padding)
    return out, idx


@kernel("max_pool2d_index_grad", "numba", checker=_index_grad_check)
def max_pool2d_index_grad(gy, indices, input_shape, kernel, stride, padding=(0, 0), layout="NCHW"):
    """Each window's gradient added at its saved index, in output raster order per plane (as ATen)."""
    gx = _empty(tuple(input_shape), gy.dtype)
    planes = gx.shape[0] * gx.shape[1]
    g2 = _planes(gy).reshape(planes, -1)
    idx = np.ascontiguousarray(indices).reshape(planes, -1)
    _run_parts(_pool_kernel("scatter", gy.dtype, idx.dtype), planes, _pool_parts(gy.shape, (1, 1)), g2, idx,
               gx.reshape(planes, -1))
    return gx


# ---------------------------------------------------------------- batch norm statistics
def _bn_stats_py(lo, hi, x, rm, rv, mean, invstd, nrm, nrv, eps, momentum,
                 running):  # pragma: no cover (compiled by numba; checked against the reference)
    n, _, m = x.shape
    cnt = n * m
    for c in range(lo, hi):
        s = 0.0
        for i in range(n):
            row = x[i, c]
            for j in range(m):
                s += np.float64(row[j])
        mu = s / cnt
        q = 0.0
        for i in range(n):
            row = x[i, c]
            for j in range(m):
                d = np.float64(row[j]) - mu
                q += d * d
        var = q / cnt
        mean[c] = mu
        invstd[c] = 1.0 / math.sqrt(var + eps)
        if running:
            nrm[c] = (1.0 - momentum) * np.float64(rm[c]) + momentum * mu
            nrv[c] = (1.0 - momentum) * np.float64(rv[c]) + momentum * var * cnt / max(cnt - 1, 1)


_bn_stats_fns: dict[str, Callable] = {}


def _bn_stats_kernel(dtype: Any) -> Callable:
    """The compiled statistics loop for ``dtype`` (float32 or float64; compiled on first use, then
    cached). Sums are accumulated in float64 with reassociation allowed (``fastmath={"reassoc"}``:
    vectorised partial sums, ~9x ATen's statistics pass on one thread); the order is fixed per
    machine, so a recomputed batch's statistics are the same bits."""
    t = np.dtype(dtype).name
    v = f"{t}[::1]"
    sig = f"void(int64, int64, {t}[:, :, ::1], {', '.join([v] * 6)}, float64, float64, boolean)"
    return _compiled_once(_bn_stats_fns, t, lambda: njit_cached(_bn_stats_py, [sig], nogil=True, error_model="numpy",
                                                                 fastmath={"reassoc"}))


def _bn_stats_check(ins: Instruction) -> bool:
    x = ins.operands[0].type
    return x.dtype in FLOATS and all(v.type.dtype == x.dtype for v in ins.operands) and ins.attrs.get("axis", 1) == 1


@kernel("batch_norm_stats", "numba", checker=_bn_stats_check)
def batch_norm_stats(x, *running, momentum=0.1, eps=1e-5, axis=1):
    """Each channel's mean and biased variance in two passes over it, then its invstd and running
    update, in float64, rounded once; channels split across threads (same bits on any split)."""
    c = x.shape[1]
    if not (x.flags.c_contiguous and x.flags.writeable):
        x = np.array(x, order="C", copy=True)
    none = np.empty(0, dtype=x.dtype)
    rm, rv = (np.ascontiguousarray(running[0]), np.ascontiguousarray(running[1])) if running else (none, none)
    outs = [_empty((c,), x.dtype) for _ in range(4 if running else 2)]
    nrm, nrv = (outs[2], outs[3]) if running else (none, none)
    parts = 1 if x.size < PARALLEL_MIN_ELEMENTS else max(1, min(threads(), c))
    _run_parts(_bn_stats_kernel(x.dtype), c, parts, x.reshape(x.shape[0], c, -1), rm, rv, outs[0], outs[1], nrm, nrv,
               float(eps), float(momentum), bool(running))
    return tuple(outs)


def prepare(module: Module) -> float:
    """Compile (or load from the disk cache) the kernel of every ``fused`` instruction the numba dialect
    accepts in ``module``; returns the seconds spent. Run it before the first step so kernel
    compilation is a setup stage, not part of the first step's time."""
    from ..ir.reuse import buffer_reuse

    t0 = time.perf_counter()
    for f in module:
        reuse = buffer_reuse(f)  # the kernels written over an operand are variants of their own
        for ins in f.instructions():
            if ins.op.name == "bernoulli":
                _mask_kernel()
            elif ins.op.name == "batch_norm_stats" and _bn_stats_check(ins):
                _bn_stats_kernel(ins.operands[0].type.dtype.numpy)
            elif ins.op.name in _POOL_OPS and (_index_grad_check if ins.op.name == "max_pool2d_index_grad"
                                                else _pool_check)(ins):
                types = [v.type for v in ins.operands] + [r.type for r in ins.results]
                index = next((t.dtype.numpy for t in types if t.dtype in (DType.i32, DType.i64)), None)
                _pool_kernel(_POOL_OPS[ins.op.name], types[0].dtype.numpy, index)
            if ins.op.name == "fused" and _check(ins):
                shapes = tuple(v.type.shape for v in ins.operands)
                dts = tuple(np.dtype(v.type.dtype.numpy) for v in ins.operands)
                key = (ins.attrs["body"], shapes, dts, reuse.get(ins, -1))
                if key not in _plans:
                    _plans[key] = _plan(*key)
    return time.perf_counter() - t0
