"""Integrations with other libraries' training loops: tiny models from configs (random weights,
nothing downloaded), one torch thread per test (as in ``tests/models``)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
