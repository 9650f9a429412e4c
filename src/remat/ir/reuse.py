"""Buffer reuse: element-wise results written over an operand that dies with them (issue 10's in-place variants).

An element-wise instruction whose operand has the result's type and is read by nothing after it can
write its result into that operand's buffer instead of a fresh one: the activation is overwritten by
its consumer. ``relu_grad(g, y)`` over ``g``, batch norm's element-wise gradient over the gradient it
reads, a residual ``add`` over one of its summands, cross-entropy's gradient over the logits. The program's values stay SSA: the reuse is a
storage decision, like an allocator's, made by :func:`buffer_reuse` from the program alone. The memory
simulator of record (``remat.plan.simulator``) and the VM (``remat.runtime.vm``) both ask it, so every
peak a planner judges, and the VM's measured peak, count the result in the operand's storage: exactly
the same bytes on both sides. Kernels write in place through their dialect's out-variant
(``remat.backends.inplace``); the bits are those of the out-of-place kernel.

Not reused: function parameters (the caller's buffers) and anything sharing their storage, values
whose storage is read after the instruction (by the value itself, a view of it, or a result already
written over it), an operand whose storage another operand of the same instruction reads through a
different value (a view), and functions with several blocks or calls (their order is not static).
"""
from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import Iterator

from .core import Function, Instruction, Value
from .opdef import OPS

_enabled = True
NOT_REUSED = frozenset({"copy", "cast"})  # element-wise, but their point is a new buffer (or another dtype)


@lru_cache(maxsize=None)
def reuses_operand(op_name: str) -> bool:
    """Whether results of this op may take a dying operand's buffer (element-wise ops, ``fused``, and
    ops tagged "overwrite": element-wise in that operand, as ``cross_entropy_grad`` in its logits)."""
    op = OPS.get(op_name)
    if op is None or op_name in NOT_REUSED or op.aliases or op.tags & {"random", "effect", "inplace", "view"}:
        return False
    return op_name == "fused" or bool(op.tags & {"elementwise", "overwrite"})


def buffer_reuse(fn: Function) -> dict[Instruction, int]:
    """For each instruction of ``fn`` whose first result takes an operand's buffer: that operand's index.

    Deterministic in the program alone (see the module docstring); the first eligible operand wins."""
    if not _enabled or fn.is_declaration or len(fn.blocks) != 1:
        return {}
    instrs = fn.entry.instrs
    last: dict[Value, int] = {}  # last use by anything but ``free`` (the return counts: outputs stay)
    for i, ins in enumerate(instrs):
        name = ins.op.name
        if name == "call":
            return {}
        if name != "free":
            for v in ins.operands:
                last[v] = i
    root: dict[Value, Value] = {p: p for p in fn.params}
    group_last: dict[Value, int] = {p: last.get(p, -1) for p in fn.params}
    pinned = set(fn.params)  # roots of storages owned by the caller
    out: dict[Instruction, int] = {}
    for i, ins in enumerate(instrs):
        name = ins.op.name
        if name in ("free", "return") or not ins.results:
            continue
        k = None
        if reuses_operand(name):
            t = ins.results[0].type
            for j, v in enumerate(ins.operands):
                if v.type != t:
                    continue
                g = root.get(v, v)
                if g in pinned or group_last.get(g, -1) > i:
                    continue
                if any(u is not v and root.get(u, u) is g for u in ins.operands):
                    continue
                k = j
                break
        aliases = ins.op.aliases
        for r_idx, r in enumerate(ins.results):
            src = k if (r_idx == 0 and k is not None) else aliases.get(r_idx)
            if src is None:
                root[r] = r
                group_last[r] = last.get(r, -1)
            else:
                g = root.get(ins.operands[src], ins.operands[src])
                root[r] = g
                group_last[g] = max(group_last.get(g, -1), last.get(r, -1))
        if k is not None:
            out[ins] = k
    return out


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block nothing is reused: steps compiled and VMs built meanwhile run every kernel out
    of place (the VM decides when it is built). For A/B measurements (``bench/buffer_reuse.py``);
    a program's peaks must be predicted under the same setting it runs under."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


__all__ = ["NOT_REUSED", "buffer_reuse", "disabled", "reuses_operand"]
