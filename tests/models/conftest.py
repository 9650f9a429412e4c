"""``hf_zoo`` importable; one torch thread per test (as in ``tests/train``)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs: nothing to download

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny kernels on a shared 2-core machine: intra-op threads only add contention (a step of a
    tiny U-Net takes ~1 s with 2 busy-waiting threads under load, ~25 ms with one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
