"""A straight-line function's run as generated Python: the VM's lean run (``record="peak"``) without
its interpreter loop.

A training step is one block of kernel calls run thousands of times, and interpreting it costs a few
microseconds per instruction: reading the step's fields, unpacking its attributes, calling the
tracker's methods. :func:`generate` writes the same run out as the source of one Python function,
instruction by instruction, with each operand slot, attribute, expected dtype, shape and byte count a
constant of it and the byte count kept in local variables, and compiles it once per function. It
does exactly what :meth:`VM._exec <remat.runtime.vm.VM._exec>` does on its lean top-level path, in
the same order: the same contract checks on every result of every run (the interpreter's fast path,
with its general path, ``VM._store``, for anything else), the same counting by storage, the same
releases after each instruction, the same peak and the instruction that first reached it, and the
same error for a failing kernel. Functions with control flow or calls, or results off the CPU, are
left to the interpreter, as are runs that record more (a timeline, bytes by kind) or donate their
arguments.
"""
from __future__ import annotations

import keyword
from typing import Any, Callable

from .steps import K_FREE, K_KERNEL, K_RETURN

MAX_INSTRUCTIONS = 50_000
"""Functions longer than this are left to the interpreter. Generating costs about 0.13 ms per
instruction, almost all of it Python compiling the source (a 5,736-instruction step: 0.75 s)."""

INTERPRETED_RUNS = 1
"""Lean runs of a function interpreted before its straight-line form is generated, so that a
function run once (a probe, a test's single step) never pays for generating it; a training loop
pays once, at its third step (a step's first run counts bytes by kind, and is interpreted)."""


def eligible(plan: Any) -> bool:
    """Whether :func:`generate` can write ``plan``'s function out: one block of kernels (their results
    checked on the fast path: torch tensors on the CPU), frees and the return."""
    if len(plan.blocks) != 1 or len(plan.instrs) > MAX_INSTRUCTIONS:
        return False
    for st in plan.blocks[0].steps:
        if st.kind == K_KERNEL:
            if not st.fast:
                return False
        elif st.kind not in (K_FREE, K_RETURN):
            return False
    return True


def generate(plan: Any, store: Callable, kernel_error: Callable) -> Callable:
    """The lean top-level run of ``plan`` (:func:`eligible`) as a compiled function
    ``run(xs, stor, tracker, rec) -> (outs, keys)``, with the signature and effects of
    ``VM._exec(plan, xs, stor, tracker, False, rec)`` for a ``_PeakRecorder`` ``rec``.
    ``store(plan, st, r, o, frame, keys, tracker)``: the general path for a result; ``kernel_error(plan,
    st, e)``: the exception to raise for a kernel's exception ``e``."""
    import torch

    def slow(st, r: int, o, frame: list, keys: list, tracker, live: int, peak: int) -> tuple[int, int]:
        """The general path for result ``r`` of ``st`` (``VM._store``), the counts handed over and back."""
        tracker.live_bytes, tracker.peak_bytes = live, peak
        store(plan, st, r, o, frame, keys, tracker)
        return tracker.live_bytes, tracker.peak_bytes

    def release(refs: dict, key) -> int:
        """One reference to ``key`` dropped (``StorageCounter.release``); the bytes freed with it."""
        e = refs[key]
        e[0] -= 1
        if e[0]:
            return 0
        del refs[key]
        return e[1]

    g: dict[str, Any] = {"T": torch.Tensor, "slow": slow, "rel": release, "kerr": kernel_error, "plan": plan}
    lines = ["def run(xs, stor, tracker, rec):",
             "    refs = tracker._refs",
             f"    frame = [None] * {plan.nslots}",
             f"    keys = [None] * {plan.nslots}",
             "    add = tracker.add"]
    emit = lines.append

    def const(name: str, value: Any) -> str:
        g[name] = value
        return name

    for i, s in enumerate(plan.param_slots):
        emit(f"    k, n, w = stor[{i}]; add(k, n, w, {plan.param_kinds[i]}); frame[{s}] = xs[{i}]; keys[{s}] = k")
    emit("    live = tracker.live_bytes; peak = tracker.peak_bytes")
    emit("    rec.arg_bytes = rec.peak = live; pk = peak; pk_at = None")  # _PeakRecorder.start

    def releases(slots: tuple) -> None:
        for s in slots:
            emit(f"    live -= rel(refs, keys[{s}]); frame[{s}] = keys[{s}] = None")

    bp = plan.blocks[0]
    releases(bp.dead_top)
    for st in bp.steps:
        i = st.index
        if st.kind == K_FREE:
            releases(st.rel_top)
            continue
        if st.kind == K_RETURN:
            emit(f"    outs = [{', '.join(f'frame[{s}]' for s in st.ins_slots)}]")
            emit(f"    okeys = [{', '.join(f'keys[{s}]' for s in st.ins_slots)}]")
            emit("    for k in okeys: refs[k][0] += 1")
            emit(f"    if peak > pk: pk, pk_at = peak, {i}")
            emit("    rec.peak, rec.peak_index = pk, pk_at")
            emit("    tracker.live_bytes = live; tracker.peak_bytes = peak")
            emit("    return outs, okeys")
            break
        step = const(f"S{i}", st)
        convs = st.convs or (None,) * len(st.ins_slots)
        args = [f"frame[{s}]" if c is None else f"{const(f'C{i}_{j}', c)}(frame[{s}])"
                for j, (s, c) in enumerate(zip(st.ins_slots, convs))]
        if all(k.isidentifier() and not keyword.iskeyword(k) for k in st.attrs):
            args += [f"{k}={const(f'A{i}_{k}', v)}" for k, v in st.attrs.items()]
        elif st.attrs:
            args.append(f"**{const(f'A{i}', dict(st.attrs))}")
        # The kernel is read at each call, as the interpreter reads it (a kernel may be replaced).
        emit(f"    try: out = {step}.fn({', '.join(args)})")
        emit(f"    except Exception as ex: raise kerr(plan, {step}, ex) from ex")
        if st.post is not None:
            post = const(f"P{i}", st.post)
            emit(f"    out = {post}(out)" if st.single else f"    out = tuple(map({post}, out))")
        for r in range(len(st.out_slots)):
            _, tdt, shape, nbytes = st.expect[r]
            dt, sh = const(f"D{i}_{r}", tdt), const(f"H{i}_{r}", shape)
            s = st.out_slots[r]
            a = st.alias[r]
            emit("    o = out" if st.single else f"    o = out[{r}]")
            # VM._exec's fast path: a plain CPU tensor of the result's dtype and shape that is either
            # fresh (contiguous, alone in a storage of exactly its bytes, not live) or a view of its
            # aliased operand's storage; anything else takes the general path.
            fast = f"type(o) is T and o.dtype is {dt} and o.shape == {sh} and o.is_cpu and "
            if a < 0:
                emit(f"    if {fast}(k := (sto := o.untyped_storage()).data_ptr()) not in refs "
                     f"and sto.nbytes() == {nbytes} and o.is_contiguous():")
                emit(f"        refs[k] = [1, {nbytes}, sto, {st.kinds[r]}]; live += {nbytes}; frame[{s}] = o; keys[{s}] = k")
                emit("        if live > peak: peak = live")
            else:
                emit(f"    if {fast}(k := o.untyped_storage().data_ptr()) == keys[{st.ins_slots[a]}]:")
                emit(f"        refs[k][0] += 1; frame[{s}] = o; keys[{s}] = k")
            emit(f"    else: live, peak = slow({step}, {r}, o, frame, keys, tracker, live, peak)")
        # No reference to a released result: a local would keep its memory past the counted release.
        emit("    out = o = sto = None")
        releases(st.rel_top)
        emit(f"    if peak > pk: pk, pk_at = peak, {i}")
    else:
        raise ValueError(f"@{plan.fn.name} ends without a return")
    code = compile("\n".join(lines) + "\n", f"<remat straight-line @{plan.fn.name}>", "exec")
    exec(code, g)  # noqa: S102 - source generated above from the plan's own constants
    return g["run"]


__all__ = ["MAX_INSTRUCTIONS", "eligible", "generate"]
