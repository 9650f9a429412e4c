"""Per-stage profile of a sequential (chain) network, in the thesis's notation: the data the chain
DP plans on. It is not a second cost model: its times come from the one cost model
(:mod:`remat.plan.costmodel`, or measured), and the chain's model of a schedule is
:func:`.schedule.evaluate_chain`.

Notation (thesis §2.4.3 / §3.1.1): a chain of N layers has forward tensors
``f_0 .. f_N`` (``f_0`` is the network input, ``f_i`` the output of layer i) and
backward tensors ``b_0 .. b_{N+1}`` (``b_{N+1}`` is the seed / targets, ``b_i`` is
computed by backward operator i from ``f_i`` and ``b_{i+1}``).

* ``alpha_f[i]`` – compute time (any unit, e.g. seconds) of producing ``f_i``
  (``alpha_f[0]`` is never charged: ``f_0`` is given).
* ``beta_f[i]``  – bytes of ``f_i`` (everything ``b_i`` needs from the forward
  in the thesis model).
* ``alpha_b[i]`` – compute time of producing ``b_i`` (``alpha_b[N+1]`` is never
  charged: ``b_{N+1}`` is given).
* ``beta_b[i]``  – bytes of ``b_i``.

Extended fields (used by the ``extended`` solver; all zero by default, and the
thesis-model solvers fold them in conservatively via :meth:`ChainCosts.folded`):

* ``tape_bytes[i]`` – bytes that backward ``i`` needs *beyond* ``f_i``'s output
  (saved residuals).  They are produced by the forward computing ``f_i``, kept
  only if that forward runs in tape mode (``FT(i)``), and freed with ``f_i``.
* ``fwd_overhead[i]`` – transient bytes live only while ``f_i`` is computed
  (workspace).
* ``bwd_overhead[i]`` – transient bytes live only while ``b_i`` is computed.
* ``out_unread[i]`` – bytes of ``f_i``'s output that ``b_i`` does not read (a batch norm's
  output, whose backward reads its input): the executor frees them before ``b_i`` runs, so
  computing ``b_i`` needs ``beta_b[i] + bwd_overhead[i] - out_unread[i]`` beyond what is live
  (at least 0; :meth:`backward_transient`).
* ``tape_input[i]`` – bytes of ``tape_bytes[i]`` that are ``f_{i-1}``'s output (a stage whose
  backward reads its own input: a convolution's weight gradient). They are one tensor: counted
  once while both are live, and held until both are freed (:func:`.schedule.evaluate_chain`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = ["ChainCosts", "BudgetTooSmall"]


from ...errors import BudgetTooSmall  # noqa: E402  (re-exported: the one public error)


def _as_array(name: str, values, length: int, integer: bool) -> np.ndarray:
    """Validate one cost array: right length, finite, >= 0 (and integral bytes)."""
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.shape[0] != length:
        raise ValueError(f"{name} has length {arr.shape[0]}, expected {length}")
    for idx, v in enumerate(arr):
        if not math.isfinite(v):
            raise ValueError(f"{name}[{idx}] = {v} is not finite; costs must be finite and >= 0")
        if v < 0:
            raise ValueError(f"{name}[{idx}] = {v} is negative; costs must be finite and >= 0")
        if integer and v != math.floor(v):
            raise ValueError(f"{name}[{idx}] = {v} is not a whole number of bytes")
    if integer:
        return arr.astype(np.int64)
    return arr


@dataclass(frozen=True, eq=False)
class ChainCosts:
    """A chain's profile: validated per-layer compute (time) and memory (bytes) of each stage.

    ``alpha_f``/``beta_f`` have N+1 entries (f_0..f_N); ``alpha_b``/``beta_b`` have
    N+2 entries (b_0..b_{N+1}).  Byte arrays must hold whole numbers.  The
    optional per-forward arrays ``tape_bytes`` / ``fwd_overhead`` have N+1 entries
    and ``bwd_overhead`` has N+2 entries (``None`` means all zero).
    """

    alpha_f: np.ndarray
    alpha_b: np.ndarray
    beta_f: np.ndarray
    beta_b: np.ndarray
    tape_bytes: np.ndarray | None = None
    fwd_overhead: np.ndarray | None = None
    bwd_overhead: np.ndarray | None = None
    out_unread: np.ndarray | None = None
    names: tuple[str, ...] | None = field(default=None)
    tape_input: np.ndarray | None = None

    def __post_init__(self) -> None:
        af = np.asarray(self.alpha_f, dtype=np.float64).reshape(-1)
        n_plus_1 = af.shape[0]
        if n_plus_1 < 2:
            raise ValueError(f"alpha_f has length {n_plus_1}; a chain needs N >= 1 layers (N+1 >= 2 entries)")
        n = n_plus_1 - 1
        set_ = object.__setattr__
        set_(self, "alpha_f", _as_array("alpha_f", self.alpha_f, n + 1, False))
        set_(self, "beta_f", _as_array("beta_f", self.beta_f, n + 1, True))
        set_(self, "alpha_b", _as_array("alpha_b", self.alpha_b, n + 2, False))
        set_(self, "beta_b", _as_array("beta_b", self.beta_b, n + 2, True))
        for nm, ln in (("tape_bytes", n + 1), ("fwd_overhead", n + 1), ("bwd_overhead", n + 2), ("out_unread", n + 1),
                       ("tape_input", n + 1)):
            v = getattr(self, nm)
            set_(self, nm, np.zeros(ln, np.int64) if v is None else _as_array(nm, v, ln, True))
        if self.names is not None and len(self.names) != n + 1:
            raise ValueError(f"names has length {len(self.names)}, expected {n + 1}")
        bad = [i for i in range(n + 1) if self.out_unread[i] > self.beta_f[i]]
        if bad:
            raise ValueError(f"out_unread[{bad[0]}] = {self.out_unread[bad[0]]} exceeds beta_f[{bad[0]}] = "
                             f"{self.beta_f[bad[0]]}: a backward cannot leave unread more than the output")
        bad = [i for i in range(n + 1) if self.tape_input[i] > min(self.tape_bytes[i], self.beta_f[i - 1] if i else 0)]
        if bad:
            i = bad[0]
            raise ValueError(f"tape_input[{i}] = {self.tape_input[i]} exceeds tape_bytes[{i}] = {self.tape_bytes[i]} or "
                             f"beta_f[{i - 1}] = {self.beta_f[i - 1] if i else 0}: a tape holds at most the previous output")
        for a in (self.alpha_f, self.alpha_b, self.beta_f, self.beta_b,
                  self.tape_bytes, self.fwd_overhead, self.bwd_overhead, self.out_unread, self.tape_input):
            a.setflags(write=False)

    # ------------------------------------------------------------------ basics
    @property
    def n(self) -> int:
        """Number of layers N (forwards f_1..f_N)."""
        return self.alpha_f.shape[0] - 1

    @property
    def has_extended(self) -> bool:
        """True when any tape / overhead bytes are non-zero."""
        return bool(self.tape_bytes.any() or self.fwd_overhead.any() or self.bwd_overhead.any()
                    or self.out_unread.any())

    def backward_transient(self) -> np.ndarray:
        """Bytes computing ``b_i`` needs beyond what is live, in the extended model (N+2 entries):
        ``beta_b + bwd_overhead``, less the output bytes of ``f_i`` freed before it runs (at least 0,
        which still bounds the real peak: what is live counts those bytes until ``f_i`` is freed)."""
        unread = np.append(self.out_unread, 0)
        return np.maximum(self.beta_b + self.bwd_overhead - unread, 0)

    def no_recompute_cost(self) -> float:
        """Compute of one plain forward+backward pass: sum alpha_f[1..N] + alpha_b[0..N]."""
        return float(self.alpha_f[1:].sum() + self.alpha_b[:-1].sum())

    def folded(self) -> "ChainCosts":
        """Thesis-model costs with the extended fields folded in conservatively.

        ``beta_f[i] += tape_bytes[i] + fwd_overhead[i]`` (the tape is always kept,
        workspace is charged for as long as f_i lives) and
        ``beta_b[i] += bwd_overhead[i]``.  Any thesis-model schedule is valid in the
        extended model with a peak no higher than predicted on folded costs.
        """
        if not self.has_extended:
            return self
        return ChainCosts(
            self.alpha_f, self.alpha_b,
            self.beta_f + self.tape_bytes + self.fwd_overhead,
            self.beta_b + self.bwd_overhead,
            names=self.names,
        )

    def without_tape_input(self) -> "ChainCosts":
        """The same costs with no tape holding its stage's input (``tape_input`` all zero): every
        tape counted whole, as if it copied the previous output."""
        return ChainCosts(self.alpha_f, self.alpha_b, self.beta_f, self.beta_b, self.tape_bytes, self.fwd_overhead,
                          self.bwd_overhead, self.out_unread, names=self.names)

    def __repr__(self) -> str:
        return (f"ChainCosts(N={self.n}, fwd_time={self.alpha_f[1:].sum():.4g}, "
                f"bwd_time={self.alpha_b[:-1].sum():.4g}, fwd_bytes={int(self.beta_f.sum()):,}, "
                f"bwd_bytes={int(self.beta_b.sum()):,}, extended={self.has_extended})")

    # ------------------------------------------------------------ constructors
    @classmethod
    def uniform(
        cls,
        n: int | None = None,
        *,
        like: "ChainCosts | None" = None,
        compute: Literal["uniform", "profiled", "given"] = "uniform",
        memory: Literal["uniform", "profiled", "given"] = "uniform",
        alpha_f: float = 1.0,
        alpha_b: float = 1.0,
        beta_f: int = 1,
        beta_b: int = 1,
        given_compute: tuple | None = None,
        given_memory: tuple | None = None,
    ) -> "ChainCosts":
        """Uniform / averaged costs (thesis Listing 3.3 switches).

        Without ``like``: an N-layer chain where every forward costs ``alpha_f``
        time and ``beta_f`` bytes and every backward ``alpha_b`` / ``beta_b``.
        With ``like`` (profiled costs): ``compute`` and ``memory`` independently
        choose ``"profiled"`` (keep ``like``'s arrays), ``"uniform"`` (replace by
        the mean over the chargeable entries, bytes rounded to the nearest whole
        byte) or ``"given"`` (take ``given_compute=(alpha_f, alpha_b)`` /
        ``given_memory=(beta_f, beta_b)``).  The boundary tensors f_0 and b_{N+1}
        keep their profiled sizes (they are the real input / seed).
        """
        if like is None:
            if n is None or n < 1:
                raise ValueError("uniform() needs n >= 1 or like=")
            return cls(np.full(n + 1, float(alpha_f)), np.full(n + 2, float(alpha_b)),
                       np.full(n + 1, int(beta_f)), np.full(n + 2, int(beta_b)))
        c = like
        n = c.n
        if compute == "profiled":
            af, ab = c.alpha_f, c.alpha_b
        elif compute == "uniform":
            af = np.full(n + 1, c.alpha_f[1:].mean())
            ab = np.full(n + 2, c.alpha_b[:-1].mean())
        elif compute == "given":
            if given_compute is None:
                raise ValueError("compute='given' needs given_compute=(alpha_f, alpha_b)")
            af, ab = given_compute
        else:
            raise ValueError(f"unknown compute mode {compute!r}")
        if memory == "profiled":
            bf, bb = c.beta_f, c.beta_b
        elif memory == "uniform":
            bf = np.full(n + 1, int(round(c.beta_f[1:].mean())), np.int64)
            bb = np.full(n + 2, int(round(c.beta_b[:-1].mean())), np.int64)
            bf[0] = c.beta_f[0]
            bb[-1] = c.beta_b[-1]
        elif memory == "given":
            if given_memory is None:
                raise ValueError("memory='given' needs given_memory=(beta_f, beta_b)")
            bf, bb = given_memory
        else:
            raise ValueError(f"unknown memory mode {memory!r}")
        return cls(af, ab, bf, bb, c.tape_bytes if memory == "profiled" else None,
                   c.fwd_overhead if memory == "profiled" else None,
                   c.bwd_overhead if memory == "profiled" else None,
                   c.out_unread if memory == "profiled" else None, names=c.names,
                   tape_input=c.tape_input if memory == "profiled" else None)

    @classmethod
    def random(
        cls,
        n: int,
        seed: int = 0,
        *,
        max_bytes: int = 1000,
        extended: bool = False,
    ) -> "ChainCosts":
        """Heterogeneous random chain for tests / benchmarks (deterministic in ``seed``).

        Byte sizes are integers in ``[1, max_bytes]`` drawn log-uniformly per layer
        (so some layers are much bigger than others, as in real networks); times
        correlate loosely with sizes.  ``extended=True`` also draws tapes and
        transient overheads.
        """
        rng = np.random.default_rng(seed)
        lo = max(1, max_bytes // 50)

        def sizes(k: int) -> np.ndarray:
            return np.exp(rng.uniform(np.log(lo), np.log(max_bytes), k)).round().astype(np.int64).clip(1, max_bytes)

        bf = sizes(n + 1)
        bb = sizes(n + 2)
        af = np.round(bf / max_bytes * rng.uniform(0.5, 2.0, n + 1) + 0.05, 3)
        ab = np.round(bb / max_bytes * rng.uniform(1.0, 3.0, n + 2) + 0.05, 3)
        tape = fo = bo = share = None
        if extended:
            tape = (bf * rng.uniform(0.0, 2.0, n + 1)).round().astype(np.int64)
            tape[0] = 0
            fo = (bf * rng.uniform(0.0, 0.5, n + 1)).round().astype(np.int64)
            bo = (bb * rng.uniform(0.0, 0.5, n + 2)).round().astype(np.int64)
            # about half the stages' tapes hold their input (the previous output), whole or in part
            share = np.zeros(n + 1, np.int64)
            share[1:] = np.minimum(tape[1:], bf[:-1]) * (rng.uniform(0.0, 1.0, n) < 0.5)
        return cls(af, ab, bf, bb, tape, fo, bo, tape_input=share)
