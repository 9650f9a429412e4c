"""Byte accounting of reference-counted storages: the one count behind predicted and measured peaks.

The simulator of record (``remat.plan.simulator``) drives it with IR types (each storage a fresh
integer key and its type's bytes); the VM's tracker (``remat.runtime.memory``) drives it with real
tensors (each storage keyed by its address, the owning buffer kept alive while counted). Both count
through the same methods here, so a predicted peak and a measured one cannot disagree by the rules
of counting, only by the storages the two are given.

It lives at the top of the package, beside ``errors``, because it depends on nothing of remat
(neither the IR nor NumPy nor torch): ``plan`` needs it without the VM, and ``runtime`` without the
planner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Sequence

OTHER = "other"
"""The kind of values no label was given for (index 0 of every kind list)."""


class TimelineEntry(NamedTuple):
    """After executing the instruction at ``index`` (its position in ``fn.instructions()``):
    live bytes, and the high-water mark during it (outputs allocated, operands still live)."""

    index: int
    live_bytes: int
    high_water: int


@dataclass
class KindBytes:
    """Bytes by kind of storage (the kinds a caller gave the values, e.g. parameters, gradients,
    optimizer state; ``OTHER`` for values it did not label). A storage has the kind of the value
    that allocated it (views and in-place results share it)."""

    at_peak: dict[str, int]    # live when the run's peak was first reached
    peaks: dict[str, int]      # each kind's own high-water mark over the run
    allocated: dict[str, int]  # fresh storages over the run (arguments included)


class StorageCounter:
    """Reference counts per storage; ``live_bytes`` is the sum of the bytes of storages in use (bytes).

    ``add`` counts one reference to a storage (allocating it, with its bytes, on the first),
    ``acquire_key`` one more to a storage already live (a view, an alias, a value passed on),
    ``release`` drops one and frees the storage's bytes with the last. ``peak_bytes`` is the
    high-water mark of ``live_bytes`` since the last ``reset_peak``. ``kind`` arguments (an index
    into the caller's kind list) are stored with the storage and ignored here; :class:`KindCounter`
    counts by them. Every method is on the VM's per-instruction path: plain ints and lists, slots.
    """

    __slots__ = ("_refs", "live_bytes", "peak_bytes")

    def __init__(self) -> None:
        # key -> [references, bytes, owner kept alive while counted (or None), kind index]. The VM's
        # run loop tests membership here directly (``key in counter._refs``) on its per-result fast path.
        self._refs: dict[Hashable, list] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def add(self, key: Hashable, nbytes: int, owner: Any = None, kind: int = 0) -> None:
        """One reference to storage ``key`` of ``nbytes`` bytes, counted fresh if not live."""
        e = self._refs.get(key)
        if e is None:
            self._refs[key] = [1, nbytes, owner, kind]
            self.live_bytes += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
        else:
            e[0] += 1

    def acquire_key(self, key: Hashable) -> None:
        """One more reference to a storage already live (a value passed on unchanged, a view)."""
        self._refs[key][0] += 1

    def release(self, key: Hashable) -> None:
        """Drop one reference; the storage's bytes stop counting with its last."""
        e = self._refs[key]
        e[0] -= 1
        if e[0] == 0:
            del self._refs[key]
            self.live_bytes -= e[1]

    def is_live(self, key: Hashable) -> bool:
        return key in self._refs

    def refs(self, key: Hashable) -> int:
        e = self._refs.get(key)
        return 0 if e is None else e[0]

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def begin_instruction(self) -> int:
        """Start measuring one instruction's high-water mark; returns the peak so far, for
        :meth:`end_instruction`."""
        saved = self.peak_bytes
        self.peak_bytes = self.live_bytes
        return saved

    def end_instruction(self, saved: int) -> int:
        """The instruction's high-water mark (bytes) since :meth:`begin_instruction`, which returned
        ``saved``; ``peak_bytes`` is again the peak over everything counted."""
        hw = self.peak_bytes
        if saved > hw:
            self.peak_bytes = saved
        return hw

    @property
    def num_storages(self) -> int:
        return len(self._refs)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} live={self.live_bytes} B in {len(self._refs)} storages, "
                f"peak={self.peak_bytes} B>")


class KindCounter(StorageCounter):
    """A :class:`StorageCounter` that also counts bytes by kind: live, each kind's peak, the split
    at the first moment of the overall peak, and bytes allocated. Used only when asked (the VM's
    ``run(..., by_kind=True)``, ``simulate(..., kinds=...)``), so the plain counter stays lean."""

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

    def add(self, key: Hashable, nbytes: int, owner: Any = None, kind: int = 0) -> None:
        # StorageCounter.add inlined, plus the kind's live, peak and allocated bytes.
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

    def release(self, key: Hashable) -> None:
        # StorageCounter.release inlined (a call to it costs the VM's by-kind step ~15%), plus the kind.
        e = self._refs[key]
        e[0] -= 1
        if e[0] == 0:
            del self._refs[key]
            self.live_bytes -= e[1]
            self.kind_live[e[3]] -= e[1]

    def by_kind(self) -> KindBytes:
        """The split so far, by kind name."""
        return KindBytes(dict(zip(self.names, self.at_top)), dict(zip(self.names, self.kind_peaks)),
                         dict(zip(self.names, self.kind_allocated)))


__all__ = ["OTHER", "KindBytes", "KindCounter", "StorageCounter", "TimelineEntry"]
