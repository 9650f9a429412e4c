"""An on-disk cache of HiGHS's node-limited solves, so that a step compiled again in another process
(a restarted run, a second script, every rank of a ZeRO run) does not solve its windows and block
MILPs again.

A node-limited solve (:func:`.milp._solve` with a ``node_limit``: the windows of the neighbourhood
search, the block MILP, the whole-graph MILP under ``"auto"``) is a function of its model and
options alone: HiGHS runs single-threaded, its work is bounded by a count of branch-and-bound
nodes, and a solve its wall-clock guard stopped is discarded by the planner and never kept here.
So an answer read from the cache is the answer the solve would give: plans do not depend on the
cache, only planning time does.

The key (:func:`key`) is a SHA-256 of everything HiGHS reads: the objective, the constraint matrix
(CSR: shape, offsets, columns, values, dtypes included), the row and column bounds, the
integrality, the options other than the time guard, SciPy's version (which fixes the HiGHS built
into it) and this module's :data:`FORMAT`. The entry holds SciPy's result fields (status, message,
objective, solution, node count, dual bound, gap), floats as Python writes them (exact).
Solves quicker than :data:`MIN_SECONDS` are not kept: reading an entry costs about as much.

Entries live in ``$REMAT_CACHE_DIR/solves`` (default ``~/.cache/remat``), one file per key, written
atomically with a header holding the format version and a SHA-256 of the content
(:mod:`remat.cache`): a truncated, corrupted, foreign or other-version file is ignored with a
warning naming it, removed and written again. ``REMAT_SOLVE_CACHE=0`` turns the cache off.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..cache import cache_root, read_entry, switched_on, warn_bad_entry, write_entry

FORMAT = 1
"""The entry format; part of the key."""

MIN_SECONDS = 0.2
"""Solves that took HiGHS less than this many seconds are not written (most windows take
milliseconds); every node-limited solve is still looked up."""

_WHAT = "solve cache"
_FIELDS = ("status", "message", "fun", "success", "mip_node_count", "mip_dual_bound", "mip_gap")


def enabled() -> bool:
    """Whether node-limited solves are cached: ``$REMAT_SOLVE_CACHE`` (default on; "0" off)."""
    return switched_on("REMAT_SOLVE_CACHE")


def cache_dir() -> Path:
    return cache_root() / "solves"


def key(c: np.ndarray, A, row_lb: np.ndarray, row_ub: np.ndarray, lb: np.ndarray, ub: np.ndarray,
        integrality: np.ndarray, options: dict) -> str:
    """The key of a solve of the MILP ``min c x, row_lb <= A x <= row_ub, lb <= x <= ub`` (``A``: a
    SciPy CSR matrix) under HiGHS ``options`` (the time guard left out: it decides only whether
    an answer is kept)."""
    import scipy

    h = hashlib.sha256()
    h.update(repr((FORMAT, scipy.__version__, A.shape, sorted((k, repr(v)) for k, v in options.items()
                                                              if k != "time_limit"))).encode())
    for a in (c, A.indptr, A.indices, A.data, row_lb, row_ub, lb, ub, integrality):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _path(k: str) -> Path:
    return cache_dir() / f"{k}.json"


def load(k: str):
    """The result kept under ``k`` (a SciPy ``OptimizeResult``, as ``scipy.optimize.milp`` returns
    it), or None."""
    from scipy.optimize import OptimizeResult

    payload = read_entry(_path(k), f"solve:{k}", FORMAT, _WHAT)
    if payload is None:
        return None
    try:
        d = json.loads(payload)
        x = None if d["x"] is None else np.asarray(d["x"], dtype=np.float64)
        return OptimizeResult(x=x, **{f: d[f] for f in _FIELDS})
    except (ValueError, KeyError, TypeError) as e:  # a whole entry of this version, yet not a solve's
        warn_bad_entry(_path(k), _WHAT, f"its content is not a solve ({type(e).__name__}: {e})")
        return None


def reject(k: str, why: str) -> None:
    """Warn that the entry kept under ``k`` is not a solution of its model (``why``); the caller solves
    again, and its result replaces the entry."""
    warn_bad_entry(_path(k), _WHAT, f"it is not a solution of its model ({why})")


def store(k: str, res) -> None:
    """Keep ``res`` (``scipy.optimize.milp``'s result) under ``k``. A failure to write leaves no entry
    and is not an error."""
    def plain(v):
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, np.integer)):
            return int(v)
        return float(v)  # Python's JSON writes and reads inf and nan too (Infinity, NaN)

    d = {f: plain(res.get(f)) for f in _FIELDS}
    d["x"] = None if res.get("x") is None else [float(v) for v in res.x]
    try:
        write_entry(_path(k), f"solve:{k}", FORMAT, json.dumps(d).encode())
    except OSError:
        pass


__all__ = ["FORMAT", "MIN_SECONDS", "cache_dir", "enabled", "key", "load", "store"]
