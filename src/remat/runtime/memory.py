"""Exact accounting of live tensor bytes, by storage: the VM's side of ``remat.accounting``.

A value's bytes are those of its root buffer: for a NumPy array, the array at the end of its
``.base`` chain (or, for an array made from a tensor, that tensor's storage); for a torch tensor,
its ``untyped_storage()``. Each storage is counted once while any live reference holds it, so
views, aliases and zero-copy NumPy↔torch conversions count once. Storages are keyed by device and
start address; the tracker keeps the owning object alive while counted, so addresses cannot be
reused under it. The counting itself is :class:`remat.accounting.StorageCounter`'s, the same the
simulator of record (``remat.plan.simulator``) drives from IR types.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..accounting import OTHER, KindBytes, KindCounter, StorageCounter, TimelineEntry

try:  # torch is optional for the numpy dialect
    import torch as _torch
except ImportError:  # pragma: no cover
    _torch = None

StorageKey = Any  # an int (CPU address) or a (device type, device index, address) tuple


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


class _Acquire:
    """``acquire``: count a real array or tensor by its storage (:func:`storage_of`)."""

    __slots__ = ()

    def acquire(self, x: Any, kind: int = 0) -> StorageKey:
        """One reference to the storage behind ``x``; returns its key (for ``release``)."""
        key, nbytes, owner = storage_of(x)
        self.add(key, nbytes, owner, kind)
        return key


class MemoryTracker(_Acquire, StorageCounter):
    """The VM's byte count: a :class:`~remat.accounting.StorageCounter` of real storages (bytes)."""

    __slots__ = ()


class KindTracker(_Acquire, KindCounter):
    """A :class:`MemoryTracker` that also counts bytes by kind (``VM.run(..., by_kind=True)``):
    a :class:`~remat.accounting.KindCounter` of real storages."""

    __slots__ = ()


__all__ = ["OTHER", "KindBytes", "KindTracker", "MemoryTracker", "StorageKey", "TimelineEntry", "storage_of"]
