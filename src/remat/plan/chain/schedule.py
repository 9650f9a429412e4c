"""Chain schedules, their steps, and the chain's model of memory and time that evaluates them.

:func:`evaluate_chain` is the DP's model of a chain schedule; the simulator of record for the
compiled program is :func:`remat.plan.simulator.simulate`, which the planner checks every
plan against.

Memory model replayed by :func:`evaluate_chain` (bytes; this is what an executor with
exact byte accounting must reproduce).  Initially live: ``f_0`` (with its tape)
and ``b_{N+1}``.  ``live`` is the sum of the bytes of live tensors.

* ``F(i)`` / ``FT(i)`` (1 <= i <= N): needs ``f_{i-1}`` live and ``f_i`` not live.
  While it runs, ``live + out_i + tape_i + fwd_overhead_i`` bytes are in use (the
  step's peak).  Afterwards ``f_i``'s output (``beta_f[i]`` bytes) is live; ``FT``
  also keeps its tape (``tape_bytes[i]``), ``F`` drops it.
* ``B(i)`` (0 <= i <= N): needs ``f_i``, its tape (model ``"extended"`` only;
  ``f_0``'s tape counts as given), and ``b_{i+1}`` live, ``b_i`` not live.  Peak
  ``live + beta_b[i] + bwd_overhead[i] - out_unread[i]`` (at least ``live``: the executor frees
  the output bytes ``b_i`` does not read before it runs); afterwards ``b_i`` is live.
* ``Free("f", i)`` frees ``f_i`` (and its tape if kept); ``Free("b", i)`` frees
  ``b_i``.  Frees are explicit: nothing is freed implicitly, so the schedule
  states exactly what an executor must keep.
* ``tape_input[i]`` bytes of ``f_i``'s tape are ``f_{i-1}``'s output: one tensor, counted
  once while both are live (``F``/``FT(i)`` count them with ``f_{i-1}``, which is live),
  released when the later of the two is freed.

Model ``"thesis"`` replays the thesis cost model on :meth:`ChainCosts.folded`
costs (tape and workspaces folded into ``beta_f`` / ``beta_b``; ``F`` and ``FT``
are then identical in memory and tapes are not tracked).  Model ``"extended"``
uses the extended fields as above.  With all extended fields zero, both models
coincide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Union

import numpy as np

from ..record import ScheduleError, Solution
from .costs import ChainCosts

__all__ = ["F", "FT", "B", "Free", "ChainStep", "evaluate_chain", "n_recomputed"]


@dataclass(frozen=True, slots=True)
class F:
    """Compute f_i from f_{i-1}, keeping only the output (tape dropped)."""

    i: int

    def __str__(self) -> str:
        return f"F({self.i})"


@dataclass(frozen=True, slots=True)
class FT:
    """Compute f_i from f_{i-1} keeping everything b_i needs (output + tape): a checkpoint."""

    i: int

    def __str__(self) -> str:
        return f"FT({self.i})"


@dataclass(frozen=True, slots=True)
class B:
    """Compute b_i from f_i (+ tape) and b_{i+1}."""

    i: int

    def __str__(self) -> str:
        return f"B({self.i})"


@dataclass(frozen=True, slots=True)
class Free:
    """Free a live tensor: kind ``"f"`` (f_i with its tape) or ``"b"`` (b_i)."""

    kind: Literal["f", "b"]
    i: int

    def __str__(self) -> str:
        return f"Free({self.kind}{self.i})"


ChainStep = Union[F, FT, B, Free]


def n_recomputed(solution: Solution, costs: ChainCosts) -> int:
    """Forward evaluations of a chain solution beyond one per layer."""
    return sum(isinstance(s, (F, FT)) for s in solution.schedule) - costs.n


def evaluate_chain(
    costs: ChainCosts,
    schedule: Iterable[ChainStep],
    model: Literal["thesis", "extended"] = "thesis",
    *,
    strict: bool = True,
) -> tuple[float, int]:
    """Replay ``schedule`` and return ``(total compute cost, peak bytes)``.

    Raises :class:`ScheduleError` if a step's inputs are not live, a tensor is
    computed while already live, a free targets a dead tensor, or (``strict``)
    the schedule does not end with exactly ``f_0`` and ``b_0`` live.
    """
    n = costs.n
    if model == "thesis":
        c = costs.folded()
        out = c.beta_f
        tape = share = np.zeros(n + 1, np.int64)
        fx = c.beta_f  # transient bytes while computing f_i
        bx = c.beta_b
    elif model == "extended":
        c = costs
        out = c.beta_f
        tape = c.tape_bytes
        share = c.tape_input
        fx = c.beta_f + c.tape_bytes + c.fwd_overhead - share
        bx = c.backward_transient()
    else:
        raise ValueError(f"unknown model {model!r}")
    bsz = c.beta_b
    track_tape = model == "extended"
    f_live = [False] * (n + 1)
    t_live = [False] * (n + 1)
    b_live = [False] * (n + 2)
    f_live[0] = t_live[0] = True
    b_live[n + 1] = True
    live = int(out[0] + tape[0] + bsz[n + 1])
    peak = live
    cost = 0.0
    for pos, s in enumerate(schedule):
        if isinstance(s, (F, FT)):
            i = s.i
            if not 1 <= i <= n:
                raise ScheduleError(f"step {pos} {s}: index out of range 1..{n}")
            if not f_live[i - 1]:
                raise ScheduleError(f"step {pos} {s}: input f_{i - 1} is not live")
            if f_live[i]:
                raise ScheduleError(f"step {pos} {s}: f_{i} is already live")
            peak = max(peak, live + int(fx[i]))
            f_live[i] = True
            live += int(out[i])
            if isinstance(s, FT):
                t_live[i] = True
                live += int(tape[i] - share[i])  # the shared part is f_{i-1}'s, live
            cost += float(c.alpha_f[i])
        elif isinstance(s, B):
            i = s.i
            if not 0 <= i <= n:
                raise ScheduleError(f"step {pos} {s}: index out of range 0..{n}")
            if not f_live[i]:
                raise ScheduleError(f"step {pos} {s}: f_{i} is not live")
            if track_tape and not t_live[i]:
                raise ScheduleError(f"step {pos} {s}: the tape of f_{i} is not live (use FT({i}))")
            if not b_live[i + 1]:
                raise ScheduleError(f"step {pos} {s}: b_{i + 1} is not live")
            if b_live[i]:
                raise ScheduleError(f"step {pos} {s}: b_{i} is already live")
            peak = max(peak, live + int(bx[i]))
            b_live[i] = True
            live += int(bsz[i])
            cost += float(c.alpha_b[i])
        elif isinstance(s, Free):
            i = s.i
            if s.kind == "f":
                if not (0 <= i <= n and f_live[i]):
                    raise ScheduleError(f"step {pos} {s}: f_{i} is not live")
                f_live[i] = False
                live -= int(out[i])
                if i < n and t_live[i + 1]:
                    live += int(share[i + 1])  # still held by f_{i+1}'s tape
                if t_live[i]:
                    t_live[i] = False
                    live -= int(tape[i] - share[i])
                    if i > 0 and not f_live[i - 1]:
                        live -= int(share[i])  # the tape held the last of f_{i-1}'s shared bytes
            elif s.kind == "b":
                if not (0 <= i <= n + 1 and b_live[i]):
                    raise ScheduleError(f"step {pos} {s}: b_{i} is not live")
                b_live[i] = False
                live -= int(bsz[i])
            else:
                raise ScheduleError(f"step {pos} {s}: unknown free kind {s.kind!r}")
        else:
            raise ScheduleError(f"step {pos}: unknown step {s!r}")
    if not b_live[0]:
        raise ScheduleError("schedule does not compute b_0")
    if strict:
        extra = [f"f_{i}" for i in range(1, n + 1) if f_live[i]]
        extra += [f"b_{i}" for i in range(1, n + 2) if b_live[i]]
        if extra or not f_live[0]:
            raise ScheduleError(f"schedule ends with unexpected live set: {extra or 'f_0 freed'}")
    return cost, peak
