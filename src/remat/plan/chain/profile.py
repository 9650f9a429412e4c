"""Per-stage costs of a chain: compute times measured on the VM, bytes from the IR.

Bytes come from IR types (exact); times are medians over repeats of each stage's
forward-with-tape and backward run on the VM. Transient peaks inside a stage's forward and
backward (its workspace) come from the static liveness simulation of those functions, the same
accounting the VM measures.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from ...ir import Function, Instruction, Value
from ...ir.core import BlockArg
from .costs import ChainCosts
from .executor import ChainStage

WorkspaceFn = Callable[[Function], Mapping[Instruction, int]]  # a function -> its kernels' workspaces (bytes)


@dataclass
class StageProfile:
    """Measured costs of one stage. Times in seconds, sizes in bytes."""

    name: str
    fwd_time: float
    bwd_time: float
    out_bytes: int        # f_s: the stage output
    input_grad_bytes: int  # b_s: gradient wrt the stage input
    tape_bytes: int       # what the backward keeps beyond the output
    fwd_overhead: int     # transient bytes while the forward runs, beyond output + tape
    bwd_overhead: int     # transient bytes while the backward runs, beyond b_s
    param_bytes: int
    param_grad_bytes: int
    out_unread: int = 0   # bytes of the output the backward does not read (freed before it runs)
    tape_input: int = 0   # bytes of the tape that are the stage's input (the previous stage's output)

    def as_dict(self) -> dict:
        return asdict(self)


def _internal_peak(fn: Function, workspace_fn: WorkspaceFn | None = None, donated: Sequence[int] = ()) -> int:
    """Peak bytes of ``fn`` beyond its arguments (which the caller already holds); with
    ``workspace_fn``, of the allocator bound (high-water marks plus kernels' workspaces). ``donated``:
    arguments ``fn`` releases at their last use (``partition.Split.donated``), so the peak may be
    less than the arguments (negative)."""
    from ..simulator import predict_peak
    from ..workspace import allocator_bound

    args = sum(p.type.nbytes for p in fn.params)
    peak = predict_peak(fn, donated) if workspace_fn is None else allocator_bound(fn, workspace_fn(fn), donated)
    return peak - args


def _tape_input(stage: ChainStage) -> int:
    """Bytes of the stage's tape that are its input, the previous stage's output (0 when the
    tape does not hold it, or holds it as an output too)."""
    ret = stage.split.forward.entry.instrs[-1]
    x = stage.split.forward.params[stage.n_params]
    held = ret.operands[1 + stage.n_aux:]
    return x.type.nbytes if any(v is x for v in held) and not any(v is x for v in ret.operands[:1 + stage.n_aux]) else 0


def _tape_bytes(stage: ChainStage) -> int:
    fwd = stage.split.forward
    ret = fwd.entry.instrs[-1]
    out = ret.operands[0]
    seen = set(ret.operands[:1 + stage.n_aux])
    total = 0
    for v in ret.operands[1 + stage.n_aux:]:
        if v not in seen:
            seen.add(v)
            total += v.type.nbytes
    return total


def output_unread(stage: ChainStage) -> int:
    """Bytes of the stage output's own storage that its backward never reads (0 when the output is
    a view, a side output or read through its tape, or ``executor.FREE_UNREAD_OUTPUTS`` is off): the
    executor frees them before the backward."""
    from . import executor

    fwd = stage.split.forward
    ret = fwd.entry.instrs[-1]
    y = ret.operands[0]
    if not executor.FREE_UNREAD_OUTPUTS or isinstance(y, BlockArg) or y in ret.operands[1:1 + stage.n_aux]:
        return 0
    root: dict[Value, Value] = {}
    for ins in fwd.entry.instrs[:-1]:
        for k, r in enumerate(ins.results):
            src = ins.op.aliases.get(k)
            root[r] = root.get(ins.operands[src], ins.operands[src]) if src is not None else r
    if root.get(y, y) is not y or any(root.get(v, v) is y for v in ret.operands[1 + stage.n_aux:]):
        return 0
    return y.type.nbytes


def _median_time(fn: Function, args: Sequence, repeats: int, dialects) -> tuple[float, tuple]:
    """Median seconds of ``repeats`` runs of ``fn`` after an untimed one (its kernels compile or load
    on their first call: a block's numba kernels took 227 ms there against 2.3 ms after), and the outputs."""
    from ...runtime.vm import run

    run(fn, *args, dialects=dialects)
    times, outs = [], None
    for _ in range(repeats):
        outs, stats = run(fn, *args, dialects=dialects)
        times.append(stats.total_seconds)
    return statistics.median(times), outs


def profile_stages(stages: list[ChainStage], params: list[list], x, upstream_grad, repeats: int = 5,
                   dialects=None, measure: bool = True, kinds: Sequence[int] | None = None,
                   workspace_fn: WorkspaceFn | None = None) -> list[StageProfile]:
    """Run every stage's forward (with tape) and backward on the VM and record its costs.
    With ``measure=False`` nothing runs: times are 0 (for a caller supplying its own estimates)
    and bytes come from the IR as always, computed once per kind when ``kinds`` says which stages
    are the same block (``remat.plan.blocks.Blocks.kinds``). ``workspace_fn``: kernels' own bytes
    per instruction; the transient terms then bound PyTorch's allocator, not only the VM's count."""
    profiles: list[StageProfile] = []
    if not measure:
        if kinds is None:
            return [_profile(s, 0.0, 0.0, workspace_fn) for s in stages]
        first: dict[int, StageProfile] = {}
        for s, k in zip(stages, kinds):
            if k not in first:
                first[k] = _profile(s, 0.0, 0.0, workspace_fn)
            profiles.append(replace(first[k], name=s.name))
        return profiles
    tapes, xs = [], []
    cur = x
    fwd_times = []
    for s, ps in zip(stages, params):
        t, outs = _median_time(s.split.forward, list(ps) + [cur], repeats, dialects)
        fwd_times.append(t)
        xs.append(cur)
        tapes.append(list(outs[1 + s.n_aux:]))
        cur = outs[0]
    g = upstream_grad
    bwd_times = [0.0] * len(stages)
    for k in range(len(stages) - 1, -1, -1):
        s, ps = stages[k], params[k]
        sp = s.split
        bargs = [ps[j] for j in sp.backward_primals] + tapes[k] + [g]
        t, outs = _median_time(sp.backward, bargs, repeats, dialects)
        bwd_times[k] = t
        if len(outs) > len(s.grad_params):
            g = outs[len(s.grad_params)]
    for k, s in enumerate(stages):
        profiles.append(_profile(s, fwd_times[k], bwd_times[k], workspace_fn))
    return profiles


def _profile(s: ChainStage, fwd_time: float, bwd_time: float, workspace_fn: WorkspaceFn | None = None) -> StageProfile:
    """A stage's profile: the given times, and bytes from the IR (exact; with ``workspace_fn`` the
    transient terms include kernels' workspaces)."""
    out_b = s.output_type.nbytes + sum(t.nbytes for t in s.aux_types)
    tape_b = _tape_bytes(s)
    grad_b = s.input_type.nbytes if len(s.split.backward.result_types) > len(s.grad_params) else 0
    fo = max(0, _internal_peak(s.split.forward, workspace_fn) - out_b - tape_b)
    bo = max(0, _internal_peak(s.split.backward, workspace_fn, s.split.donated) - grad_b)
    return StageProfile(s.name, fwd_time, bwd_time, out_b, grad_b, tape_b, fo, bo,
                        sum(t.nbytes for t in s.param_types), sum(t.nbytes for t in s.grad_types), output_unread(s),
                        _tape_input(s))


def chain_costs(profiles: list[StageProfile], compute: str = "profiled", memory: str = "profiled",
                compute_costs: dict | None = None, memory_costs: dict | None = None) -> ChainCosts:
    """Thesis-indexed costs from stage profiles (Listing 3.3: each of compute and memory is
    ``"profiled"``, ``"uniform"`` (averaged) or ``"given"`` through ``compute_costs`` /
    ``memory_costs`` dicts of thesis arrays).

    The chain input ``f_0`` and upstream gradient ``b_{N+1}`` are caller-owned arguments that
    stay live throughout; they are accounted for outside the chain model (zero here).
    """
    n = len(profiles)
    alpha_f = np.array([0.0] + [p.fwd_time for p in profiles])
    alpha_b = np.array([0.0] + [p.bwd_time for p in profiles] + [0.0])
    beta_f = np.array([0] + [p.out_bytes for p in profiles], dtype=np.int64)
    beta_b = np.array([0] + [p.input_grad_bytes for p in profiles] + [0], dtype=np.int64)
    tape = np.array([0] + [p.tape_bytes for p in profiles], dtype=np.int64)
    fo = np.array([0] + [p.fwd_overhead for p in profiles], dtype=np.int64)
    bo = np.array([0] + [p.bwd_overhead for p in profiles] + [0], dtype=np.int64)
    unread = np.array([0] + [p.out_unread for p in profiles], dtype=np.int64)
    share = np.array([0] + [p.tape_input for p in profiles], dtype=np.int64)
    if compute == "uniform":
        alpha_f[1:] = alpha_f[1:].mean()
        alpha_b[1:n + 1] = alpha_b[1:n + 1].mean()
    elif compute == "given":
        if not compute_costs:
            raise ValueError("compute='given' needs compute_costs={'alpha_f': [...], 'alpha_b': [...]}")
        alpha_f = np.asarray(compute_costs["alpha_f"], dtype=np.float64)
        alpha_b = np.asarray(compute_costs["alpha_b"], dtype=np.float64)
    elif compute != "profiled":
        raise ValueError(f"compute costs must be 'profiled', 'uniform' or 'given', got {compute!r}")
    if memory == "uniform":
        for arr, sl in ((beta_f, slice(1, None)), (beta_b, slice(1, n + 1)), (tape, slice(1, None)),
                        (fo, slice(1, None)), (bo, slice(1, n + 1))):
            arr[sl] = int(np.ceil(arr[sl].mean()))
        unread[1:] = np.minimum(int(unread[1:].min()), beta_f[1:])  # never more than any stage frees
        share[1:] = int(share[1:].min())  # never more than any tape shares
    elif memory == "given":
        if not memory_costs:
            raise ValueError("memory='given' needs memory_costs={'beta_f': [...], 'beta_b': [...]}")
        beta_f = np.asarray(memory_costs["beta_f"], dtype=np.int64)
        beta_b = np.asarray(memory_costs["beta_b"], dtype=np.int64)
        tape = np.asarray(memory_costs.get("tape_bytes", np.zeros(n + 1)), dtype=np.int64)
        fo = np.asarray(memory_costs.get("fwd_overhead", np.zeros(n + 1)), dtype=np.int64)
        bo = np.asarray(memory_costs.get("bwd_overhead", np.zeros(n + 2)), dtype=np.int64)
        unread = np.asarray(memory_costs.get("out_unread", np.zeros(n + 1)), dtype=np.int64)
    elif memory != "profiled":
        raise ValueError(f"memory costs must be 'profiled', 'uniform' or 'given', got {memory!r}")
    if memory == "given":
        share = np.asarray(memory_costs.get("tape_input", np.zeros(n + 1)), dtype=np.int64)
    else:  # a tape shares at most itself and the previous output
        share[1:] = np.minimum(share[1:], np.minimum(tape[1:], beta_f[:-1]))
    return ChainCosts(alpha_f=alpha_f, alpha_b=alpha_b, beta_f=beta_f, beta_b=beta_b,
                      tape_bytes=tape, fwd_overhead=fo, bwd_overhead=bo, out_unread=unread, tape_input=share)
