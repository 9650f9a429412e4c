"""Storage-based accounting: views, aliases and zero-copy numpy<->torch conversions count once."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from remat.backends.torch_kernels import to_numpy, to_torch
from remat.runtime.memory import MemoryTracker, storage_of


def test_numpy_views_share_the_root_storage():
    a = np.zeros((10, 10), np.float32)
    for v in (a.reshape(100), a[2:5], a.T, a[::2, ::3]):
        assert storage_of(v)[:2] == storage_of(a)[:2] == (a.__array_interface__["data"][0], 400)


def test_torch_views_and_conversions_share_storage():
    t = torch.zeros(4, 6, dtype=torch.float64)
    key, n, _ = storage_of(t)
    assert n == 192
    assert storage_of(t.view(24))[0] == key and storage_of(t[1:, 2:])[0] == key
    assert storage_of(t.numpy())[0] == key          # numpy array backed by the tensor
    assert storage_of(t[1:].numpy())[0] == key      # ... even at an offset
    a = np.ones((3, 5), np.float32)
    assert storage_of(torch.from_numpy(a))[:2] == storage_of(a)[:2]


def test_bf16_round_trip_is_zero_copy():
    a = np.ones((8,), ml_dtypes.bfloat16)
    t = to_torch(a)
    assert t.dtype == torch.bfloat16 and storage_of(t)[:2] == storage_of(a)[:2] == (storage_of(a)[0], 16)
    b = to_numpy(t)
    assert b.dtype == ml_dtypes.bfloat16 and np.shares_memory(a, b)


def test_tracker_counts_each_storage_once():
    tr = MemoryTracker()
    a = np.zeros(1000, np.float32)
    k1 = tr.acquire(a)
    k2 = tr.acquire(a.reshape(10, 100))
    k3 = tr.acquire(torch.from_numpy(a))
    assert k1 == k2 == k3 and tr.live_bytes == 4000 and tr.refs(k1) == 3
    b = np.zeros(10, np.float64)
    kb = tr.acquire(b)
    assert tr.live_bytes == 4080 and tr.peak_bytes == 4080
    tr.release(k1)
    tr.release(k2)
    assert tr.live_bytes == 4080  # one reference left
    tr.release(k3)
    assert tr.live_bytes == 80 and not tr.is_live(k1)
    tr.release(kb)
    assert tr.live_bytes == 0 and tr.peak_bytes == 4080 and tr.num_storages == 0


def test_rank0_and_empty_tensors():
    tr = MemoryTracker()
    tr.acquire(np.array(1.0))
    tr.acquire(torch.tensor(1, dtype=torch.int32))
    tr.acquire(np.zeros((0, 3), np.float32))
    assert tr.live_bytes == 8 + 4
