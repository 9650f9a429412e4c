"""Exact accounting of live tensor bytes, by storage.

A value's bytes are those of its root buffer: for a NumPy array, the array at the end of its
``.base`` chain (or, for an array made from a tensor, that tensor's storage); for a torch tensor,
its ``untyped_storage()``. Each storage is counted once while any live reference holds it, so
views, aliases and zero-copy NumPy↔torch conversions count once. Storages are keyed by device and
start address; the tracker keeps the owning object alive while counted, so addresses cannot be
reused under it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

try:  # torch is optional for the numpy dialect
    import torch as _torch
except ImportError:  # pragma: no cover
    _torch = None

StorageKey = Any  # an int (CPU address) or a (device type, device index, address) tuple


class TimelineEntry(NamedTuple):
    """After executing the instruction at ``index`` (its position in ``fn.instructions()``):
    live bytes, and the high-water mark during it (outputs allocated, operands still live)."""

    index: int
    live_bytes: int
    high_water: int



def storage_of(x: Any) -> tuple[StorageKey, int, Any]:
    """(key, bytes, owner) of the root buffer backing ``x`` (a NumPy array or torch tensor)."""
    if isinstance(x, np.ndarray):
        r = x
        while isinstance(r.base, np.ndarray):
            r = r.base
        b = r.base
        if b is not None and _torch is not None and isinstance(b, _torch.Tensor):
            return storage_of(b)
        return r.__array_interface__["data"][0], r.nbytes, r
    if _torch is not None and isinstance(x, _torch.Tensor):
        s = x.untyped_storage()
        ptr = s.data_ptr()
        if x.is_cpu:  # (``is_cpu`` is several times cheaper than ``device.type``)
            return ptr, s.nbytes(), s
        d = x.device
        return (d.type, d.index, ptr), s.nbytes(), s
    raise TypeError(f"cannot account memory of {type(x).__name__}; expected a numpy array or torch tensor")


@dataclass
class KindBytes:
    """Bytes by kind of storage (the kinds a caller gave the values, e.g. parameters, gradients,
    optimizer state; ``OTHER`` for values it did not label). A storage has the kind of the value
    that allocated it (views and in-place results share it)."""

    at_peak: dict[str, int]    # live when the run's peak was first reached
    peaks: dict[str, int]      # each kind's own high-water mark over the run
    allocated: dict[str, int]  # fresh storages over the run (arguments included)


OTHER = "other"
"""The kind of values no label was given for (index 0 of every kind list)."""


class MemoryTracker:
    """Reference counts per storage; ``live_bytes`` is the sum of the bytes of storages in use (bytes).

    ``acquire`` adds one reference (a VM slot now holds the value) and returns the storage key,
    ``release`` drops one. ``peak_bytes`` is the high-water mark of ``live_bytes`` since the last
    ``reset_peak``. ``kind`` arguments (an index into the caller's kind list) are stored with the
    storage and ignored here; :class:`KindTracker` counts by them.
    """

    __slots__ = ("_refs", "live_bytes", "peak_bytes")

    def __init__(self) -> None:
        # key -> [references, bytes, owner object kept alive while counted]. The VM's run loop tests
        # membership here directly (``key in tracker._refs``) on its per-result fast path.
        self._refs: dict[StorageKey, list] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def acquire(self, x: Any, kind: int = 0) -> StorageKey:
        key, nbytes, owner = storage_of(x)
        self.add(key, nbytes, owner, kind)
        return key

    def add(self, key: StorageKey, nbytes: int, owner: Any, kind: int = 0) -> None:
        """``acquire`` for a storage already looked up with :func:`storage_of`."""
        e = self._refs.get(key)
        if e is None:
            self._refs[key] = [1, nbytes, owner, kind]
            self.live_bytes += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
        else:
            e[0] += 1

    def acquire_key(self, key: StorageKey) -> None:
        """One more reference to a storage already live (a value passed on unchanged)."""
        self._refs[key][0] += 1

    def release(self, key: StorageKey) -> None:
        e = self._refs[key]
        e[0] -= 1
        if e[0] == 0:
            del self._refs[key]
            self.live_bytes -= e[1]

    def is_live(self, key: StorageKey) -> bool:
        return key in self._refs

    def refs(self, key: StorageKey) -> int:
        e = self._refs.get(key)
        return 0 if e is None else e[0]

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    @property
    def num_storages(self) -> int:
        return len(self._refs)

    def __repr__(self) -> str:
        return f"<MemoryTracker live={self.live_bytes} B in {len(self._refs)} storages, peak={self.peak_bytes} B>"


class KindTracker(MemoryTracker):
    """A :class:`MemoryTracker` that also counts bytes by kind: live, each kind's peak, the split
    at the first moment of the overall peak, and bytes allocated. Used only when a run asks for
    it (``VM.run(..., by_kind=True)``), so the plain tracker stays as cheap as it was."""

    __slots__ = ("names", "kind_live", "kind_peaks", "kind_allocated", "top", "at_top")

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__()
        self.names = tuple(names)
        n = len(self.names)
        self.kind_live = [0] * n
        self.kind_peaks = [0] * n
        self.kind_allocated = [0] * n
        # The overall high-water mark, kept apart from ``peak_bytes`` (which a recorder may reset
        # per instruction), and the per-kind split when it was first reached.
        self.top = 0
        self.at_top = [0] * n

    def add(self, key: StorageKey, nbytes: int, owner: Any, kind: int = 0) -> None:
        e = self._refs.get(key)
        if e is None:
            self._refs[key] = [1, nbytes, owner, kind]
            live = self.live_bytes = self.live_bytes + nbytes
            if live > self.peak_bytes:
                self.peak_bytes = live
            kl = self.kind_live
            v = kl[kind] = kl[kind] + nbytes
            self.kind_allocated[kind] += nbytes
            if v > self.kind_peaks[kind]:
                self.kind_peaks[kind] = v
            if live > self.top:
                self.top = live
                self.at_top = kl.copy()
        else:
            e[0] += 1

    def release(self, key: StorageKey) -> None:
        e = self._refs[key]
        e[0] -= 1
        if e[0] == 0:
            del self._refs[key]
            self.live_bytes -= e[1]
            self.kind_live[e[3]] -= e[1]

    def by_kind(self) -> KindBytes:
        """The measurement so far."""
        return KindBytes(dict(zip(self.names, self.at_top)), dict(zip(self.names, self.kind_peaks)),
                         dict(zip(self.names, self.kind_allocated)))
