"""Suite-wide settings, also seen by the subprocesses the tests start:

- every pass's result is verified (``REMAT_VERIFY_EACH_PASS``; a compile alone verifies each
  stage's result only);
- the capture cache is on, as it is for users (a model compiled again is translated from its entry,
  after the check on use), with its entries in a directory of this run's own, removed when the run
  ends (``REMAT_CACHE_DIR``): each run fills it from empty and leaves no entries of its source
  version behind. Compiled kernels and measured workspaces are kept where a user's compiles keep
  them (``~/.cache/remat``; content-addressed and checked on load), linked into that directory, so
  a run does not compile every kernel again. Tests that are about the caches give them a directory
  of their own;
- one torch thread per test: the suite runs one worker per core, and tiny kernels gain nothing
  from intra-op threads, which busy-wait against the other worker (a step of a tiny U-Net takes
  ~1 s with 2 threads under load, ~25 ms with one). Tests about threads set their own count.
"""
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("REMAT_VERIFY_EACH_PASS", "1")

# Made once, by the first process of the run (pytest-xdist's workers inherit the variable).
_OWN_CACHE = None
if "REMAT_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="remat-tests-")
    from remat.cache import cache_root  # the user's cache (REMAT_CACHE_DIR is not set here)

    for name in ("kernels", "workspaces"):
        shared = cache_root() / name
        try:
            shared.mkdir(parents=True, exist_ok=True)
            os.symlink(shared, Path(_OWN_CACHE) / name)
        except OSError:  # no writable home: this run's directory holds them too
            pass
    os.environ["REMAT_CACHE_DIR"] = _OWN_CACHE


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)  # removes the links, not what they point to


@pytest.fixture(autouse=True)
def _one_torch_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
