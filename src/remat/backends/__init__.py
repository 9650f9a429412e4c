"""Dialects: backends that claim ops by priority through per-implementation checkers (RAF §3.2.1).

A *dialect* (``numpy``, ``torch``, ``numba``) is a named backend with a priority. Each op may have several
kernel *implementations*, each registered in one dialect with its own priority (default: the
dialect's) and a ``checker(instr) -> bool`` saying whether it accepts that instruction (dtype,
attributes, ...). :func:`assign_dialects` records on every instruction the highest-priority
enabled implementation that accepts it; the printer then shows it as ``torch.add``.

Users choose dialects with :func:`enable` / :func:`disable`, the context manager :func:`only`, or
an explicit ``dialects=("numpy",)`` argument (which wins over the global setting)::

    remat.dialects.disable("torch")
    with remat.dialects.only("numpy"):
        remat.run(fn, x)

Kernel contract (checked by the VM and by ``tests/backends``): a kernel is called as
``fn(*operands, **attrs)`` on operands of its dialect's array type and returns the result (a
tuple for multi-result ops) of exactly the IR result dtype and shape (rank 0 gives a 0-d array,
never a scalar). Non-view ops return fresh contiguous buffers that own exactly their bytes;
``reshape`` (the only view op) returns a view of its operand. A kernel may also offer
``fn.bind(**attrs)`` (:func:`bindable`): a function of the operands alone giving exactly
``fn(*operands, **attrs)``, with what depends only on the attributes decided once (:func:`bound`; the VM binds each
instruction's kernel when it prepares a program).
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..ir import Instruction, Module, OPS

Checker = Callable[[Instruction], bool]


def _always(instr: Instruction) -> bool:
    return True


@dataclass
class Dialect:
    """A backend: its name, priority (higher wins), whether it can run here, and its kernels."""

    name: str
    priority: int
    available: bool = True
    why_unavailable: str = ""
    kernels: dict[str, list["KernelImpl"]] = field(default_factory=dict)


@dataclass(frozen=True)
class KernelImpl:
    """One implementation of an op in a dialect."""

    op: str
    dialect: str
    fn: Callable
    priority: int
    checker: Checker = _always
    # Bytes the kernel allocates beyond its results, for kernels that cannot be measured alone
    # (collectives wait for the other ranks): ``workspace(instr, device)`` (device None: the CPU).
    # Other kernels' workspaces are measured (remat.runtime.allocator).
    workspace: Callable[[Instruction, Any], int] | None = None

    def accepts(self, instr: Instruction) -> bool:
        return bool(self.checker(instr))


_DIALECTS: dict[str, Dialect] = {}
_KERNEL_MODULES = {"numpy": "remat.backends.numpy_kernels", "torch": "remat.backends.torch_kernels",
                   "numba": "remat.backends.numba_kernels"}
_loaded = False
_enabled: set[str] | None = None  # None: every available dialect


def register_dialect(name: str, priority: int, available: bool = True, why_unavailable: str = "") -> Dialect:
    """Declare a dialect (once). ``available=False`` keeps it listed but never selected."""
    if name in _DIALECTS:
        raise ValueError(f"dialect '{name}' is registered twice")
    d = Dialect(name, priority, available, why_unavailable)
    _DIALECTS[name] = d
    return d


def kernel(op: str, dialect: str, checker: Checker | None = None, priority: int | None = None,
           workspace: Callable[[Instruction, Any], int] | None = None):
    """Decorator registering ``fn(*operands, **attrs)`` as an implementation of ``op`` in ``dialect``
    (``workspace``: see :class:`KernelImpl`)."""

    def deco(fn: Callable) -> Callable:
        if op not in OPS:
            raise KeyError(f"kernel for unknown op '{op}' in dialect '{dialect}'")
        if OPS[op].has("control"):
            raise ValueError(f"'{op}' is a control op run by the VM; it takes no kernel")
        d = _DIALECTS[dialect]
        impl = KernelImpl(op, dialect, fn, d.priority if priority is None else priority, checker or _always,
                          workspace)
        impls = d.kernels.setdefault(op, [])
        impls.append(impl)
        impls.sort(key=lambda k: -k.priority)
        return fn

    return deco


_OUT: dict[tuple[str, str], Callable] = {}  # (op, dialect) -> out-variant (see out_kernel)


def out_kernel(op: str, dialect: str):
    """Decorator registering ``fn(out, *operands, **attrs)``: ``op``'s kernel in ``dialect`` writing its
    (first) result into ``out``, one of the operands, of the result's type and dense, and returning
    it (a tuple with any further results). The bits must be those of the out-of-place kernel. Used
    where the program reuses a dying operand's buffer (``remat.ir.reuse``)."""

    def deco(fn: Callable) -> Callable:
        if op not in OPS:
            raise KeyError(f"out-variant for unknown op '{op}' in dialect '{dialect}'")
        _OUT[(op, dialect)] = fn
        return fn

    return deco


def has_out_variant(op: str, dialect: str) -> bool:
    """Whether ``op`` has an out-variant in ``dialect`` (else :func:`inplace` copies the result in)."""
    _load()
    return (op, dialect) in _OUT


def bindable(fn: Callable, bind: Callable[..., Callable]) -> Callable:
    """Give the kernel ``fn`` its ``bind(**attrs)`` (see :func:`bound`); returns ``fn``. The binder
    records whose it is, so a wrapper that copies ``fn``'s attributes (``functools.wraps``) does not
    inherit a binder that would skip the wrapper."""
    bind.kernel = fn  # type: ignore[attr-defined]
    fn.bind = bind  # type: ignore[attr-defined]
    return fn


def bound(impl: "KernelImpl", attrs: dict) -> Callable | None:
    """``impl``'s kernel bound to one instruction's attributes (``fn.bind(**attrs)``, given by
    :func:`bindable`), a function of the operands alone; None for a kernel without one (called as
    ``fn(*operands, **attrs)``)."""
    bind = getattr(impl.fn, "bind", None)
    if bind is None or getattr(bind, "kernel", None) is not impl.fn:
        return None
    return bind(**attrs)


def inplace(impl: "KernelImpl", k: int) -> Callable:
    """``impl``'s kernel with its first result written over operand ``k``: the dialect's out-variant
    (:func:`out_kernel`), else the kernel followed by a copy into the operand. The copy's transient
    result is what the kernel allocates anyway; it stays off the VM's count (the result is the
    operand's storage) and, in the torch dialect, is a workspace of that kernel."""
    _load()
    f = _OUT.get((impl.op, impl.dialect))
    if f is not None:
        return lambda *a, **kw: f(a[k], *a, **kw)
    base = impl.fn

    def copy_into(*a, **kw):
        r = base(*a, **kw)
        first = r[0] if isinstance(r, tuple) else r
        dst = a[k]
        if hasattr(dst, "copy_"):
            dst.copy_(first)
        else:
            import numpy as np

            np.copyto(dst, first)
        return (dst, *r[1:]) if isinstance(r, tuple) else dst

    return copy_into


def _load() -> None:
    """Import the kernel modules (lazily, so ``import remat`` does not import torch)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _KERNEL_MODULES.values():
        importlib.import_module(mod)


def dialects() -> dict[str, Dialect]:
    """Every registered dialect by name (available or not)."""
    _load()
    return dict(_DIALECTS)


def _check_names(names: Iterable[str]) -> list[str]:
    _load()
    out = []
    for n in names:
        if n not in _DIALECTS:
            raise ValueError(f"unknown dialect '{n}'; known dialects: {', '.join(_DIALECTS)}")
        out.append(n)
    return out


def enabled() -> tuple[str, ...]:
    """The globally enabled, available dialects, highest priority first."""
    _load()
    names = _DIALECTS if _enabled is None else _enabled
    return tuple(sorted((n for n in names if _DIALECTS[n].available), key=lambda n: -_DIALECTS[n].priority))


def enable(*names: str) -> None:
    """Enable dialects globally (they still need to be available on this machine)."""
    global _enabled
    names_ = _check_names(names)
    for n in names_:
        if not _DIALECTS[n].available:
            raise ValueError(f"dialect '{n}' is not available here: {_DIALECTS[n].why_unavailable}")
    cur = set(_DIALECTS) if _enabled is None else set(_enabled)
    _enabled = cur | set(names_)


def disable(*names: str) -> None:
    """Disable dialects globally."""
    global _enabled
    names_ = _check_names(names)
    cur = set(_DIALECTS) if _enabled is None else set(_enabled)
    _enabled = cur - set(names_)


def reset() -> None:
    """Back to the default: every available dialect enabled."""
    global _enabled
    _enabled = None


@contextlib.contextmanager
def only(*names: str) -> Iterator[None]:
    """Within the block, exactly these dialects are enabled."""
    global _enabled
    names_ = _check_names(names)
    saved = _enabled
    _enabled = set(names_)
    try:
        yield
    finally:
        _enabled = saved


def resolve(dialects_: Sequence[str] | str | None = None) -> tuple[str, ...]:
    """The dialects to use: an explicit list (checked), else the global setting; priority order."""
    if dialects_ is None:
        return enabled()
    if isinstance(dialects_, str):
        dialects_ = (dialects_,)
    names = _check_names(dialects_)
    for n in names:
        if not _DIALECTS[n].available:
            raise ValueError(f"dialect '{n}' is not available here: {_DIALECTS[n].why_unavailable}")
    return tuple(sorted(dict.fromkeys(names), key=lambda n: -_DIALECTS[n].priority))


class NoKernelError(RuntimeError):
    """No enabled dialect has a kernel that accepts an instruction."""


def select(instr: Instruction, dialects_: Sequence[str]) -> KernelImpl:
    """The highest-priority implementation among ``dialects_`` whose checker accepts ``instr``."""
    _load()
    name = instr.op.name
    best: KernelImpl | None = None
    for d in dialects_:
        for impl in _DIALECTS[d].kernels.get(name, ()):
            if impl.accepts(instr) and (best is None or impl.priority > best.priority):
                best = impl
                break  # impls are sorted by priority within a dialect
    if best is None:
        have = [n for n, d in _DIALECTS.items() if name in d.kernels]
        types = ", ".join(str(v.type) for v in instr.operands) or "no operands"
        raise NoKernelError(
            f"no enabled dialect can run '{name}' ({types}); enabled dialects: {', '.join(dialects_) or 'none'}; "
            f"dialects with a '{name}' kernel: {', '.join(have) or 'none'}"
            + ("" if not have else " (their checkers may refuse this dtype or these attributes)")
            + ("" if instr.op.decompose is None else
               f"; '{name}' has a decomposition into other ops: run the program through "
               "remat.passes.decompose.decompose_unclaimed (remat.compile and the DSL do)"))
    return best


def claims(instr: Instruction, dialects_: Sequence[str]) -> bool:
    """Whether one of ``dialects_`` has an implementation that accepts ``instr`` (composites that
    none claims run through their decomposition: ``remat.passes.decompose``)."""
    _load()
    name = instr.op.name
    return any(impl.accepts(instr) for d in dialects_ for impl in _DIALECTS[d].kernels.get(name, ()))


def kernel_for(instr: Instruction, dialect: str) -> KernelImpl:
    """The implementation of ``instr`` in the given dialect (the one assigned to it)."""
    return select(instr, (dialect,))


def assign_dialects(module: Module, enabled: Sequence[str] | str | None = None) -> Module:
    """A copy of ``module`` with each instruction's ``dialect`` set to the best enabled implementation.

    Control ops (call, br, cond_br, return, free) get no dialect. Raises :class:`NoKernelError`
    naming the op, the enabled dialects and the dialects that do have it.
    """
    names = resolve(enabled)
    out = module.clone()
    for f in out:
        for ins in f.instructions():
            if ins.op.has("control"):
                ins.dialect = None
            else:
                ins.dialect = select(ins, names).dialect
    return out


register_dialect("numpy", priority=0)
try:
    import importlib.util as _u

    _has_torch = _u.find_spec("torch") is not None
except (ImportError, ValueError):  # pragma: no cover
    _has_torch = False
register_dialect("torch", priority=10, available=_has_torch, why_unavailable="" if _has_torch else "torch is not installed")
try:
    _has_numba = _u.find_spec("numba") is not None
except (ImportError, ValueError):  # pragma: no cover
    _has_numba = False
# Generated kernels for ``fused`` element-wise bodies (the only op it claims), above torch.
register_dialect("numba", priority=20, available=_has_numba, why_unavailable="" if _has_numba else "numba is not installed")

__all__ = ["Dialect", "KernelImpl", "NoKernelError", "assign_dialects", "claims", "dialects", "disable",
           "enable", "enabled", "has_out_variant", "inplace", "kernel", "kernel_for", "only", "out_kernel",
           "register_dialect", "reset", "resolve", "select"]
