"""The benchmark's CPU peak-memory measurement (bench/_measure.py) on hand-computable programs."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _measure import measure_peak, peak_of_trace, resident_bytes, tensor_bytes  # noqa: E402

F32 = 4  # bytes per float32 element


def test_peak_of_trace_by_hand() -> None:
    # alloc 10, alloc 5 (15), free 10 (5), alloc 7 (12), free of pre-existing memory (-3 → 9)
    events = [(1, 10), (2, 5), (3, -10), (4, 7), (5, -3)]
    assert peak_of_trace(events) == (15, 9, 22)
    assert peak_of_trace([]) == (0, 0, 0)
    assert peak_of_trace([(0, -8)]) == (0, -8, 0)  # freeing only: the peak is the start


def test_sequence_of_allocations_has_known_peak() -> None:
    def program():
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = torch.empty(2000, dtype=torch.float32)  # 8000 B, live: 12000
        del a                                       # live: 8000
        c = torch.empty(500, dtype=torch.float64)   # 4000 B, live: 12000
        d = torch.empty(3000, dtype=torch.int8)     # 3000 B, live: 15000 (peak)
        del b, d                                    # live: 4000
        return c

    m = measure_peak(program, resident=123)
    assert m.peak_net_bytes == 15000
    assert m.peak_bytes == 15000 + 123
    assert m.end_net_bytes == 4000  # c is returned
    assert m.allocated_bytes == 4000 + 8000 + 4000 + 3000
    assert m.num_allocations == 4
    assert m.result.numel() == 500


def test_views_allocate_nothing_and_ops_allocate_outputs() -> None:
    x = torch.randn(64, 32)

    def program():
        v = x.view(32, 64).transpose(0, 1)  # views: no allocation
        y = x + x                            # 64*32*4 = 8192 B (no scalar operand: it would allocate a 0-d tensor)
        z = y.sum()                          # 4 B
        del y
        return v, z

    m = measure_peak(program)
    assert m.peak_net_bytes == 64 * 32 * F32 + F32
    assert m.end_net_bytes == F32


def test_frees_of_memory_allocated_before_the_call_are_not_counted() -> None:
    holder = [torch.empty(10_000)]

    def program():
        holder.pop()                  # frees 40000 B allocated before profiling: invisible
        return torch.empty(100)      # 400 B

    m = measure_peak(program, resident=40_000)
    # The 40000 B free is not counted (else the peak would be 0). Once in about seven full runs (stop
    # 30) the profiler also reported the free of a 4-byte block from before the window: 396 B.
    assert 400 - 16 <= m.peak_net_bytes <= 400
    assert m.peak_bytes == 40_000 + m.peak_net_bytes   # an upper bound: the resident block stays counted


def test_backward_allocations_are_seen() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=False)
    x = torch.randn(32, 256)

    def step():
        loss = lin(x).square().sum()
        loss.backward()
        return float(loss)

    m = measure_peak(step)
    grad_bytes = 128 * 256 * F32
    assert lin.weight.grad is not None
    # the weight gradient is allocated in the autograd engine and kept in .grad
    assert m.end_net_bytes >= grad_bytes
    # at some point the output (32x128) and the gradient both existed
    assert m.peak_net_bytes >= grad_bytes + 32 * 128 * F32


def test_tensor_bytes_counts_each_storage_once() -> None:
    a = torch.empty(100)                  # 400 B
    b = torch.empty(10, dtype=torch.int64)  # 80 B
    assert tensor_bytes([a, a.view(10, 10), a[5:], {"k": (b,)}, 3, None]) == 480


def test_resident_bytes_of_model_optimizer_and_inputs() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.BatchNorm1d(20))
    # parameters: 10*20 + 20 + 20 + 20 floats; buffers: running mean/var (20 + 20 floats) + num_batches (int64)
    params = (200 + 20 + 20 + 20) * F32
    buffers = 40 * F32 + 8
    x = torch.randn(4, 10)
    assert resident_bytes(model, None, [x]) == params + buffers + 40 * F32
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(x).sum().backward()
    opt.step()
    # now: .grad of every parameter and one momentum buffer per parameter (+ no step counter for SGD)
    assert resident_bytes(model, opt, [x]) == 3 * params + buffers + 40 * F32
    for p in model.parameters():
        p.grad = None
    assert resident_bytes(model, opt) == 2 * params + buffers


def test_tied_parameters_count_once() -> None:
    emb = torch.nn.Embedding(50, 8)
    head = torch.nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    assert resident_bytes(model) == 50 * 8 * F32


def test_negative_resident_is_rejected() -> None:
    with pytest.raises(ValueError, match="resident bytes must be >= 0"):
        measure_peak(lambda: None, resident=-1)
