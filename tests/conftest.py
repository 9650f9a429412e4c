"""Suite-wide settings, also seen by the subprocesses the tests start:

- every pass's result is verified (``REMAT_VERIFY_EACH_PASS``; a compile alone verifies each
  stage's result only);
- remat's on-disk caches (captures, kernels, workspaces) live in a directory of this run's own
  (``REMAT_CACHE_DIR``), removed when the run ends: a test run neither reads what another run or a
  user left in ``~/.cache/remat`` nor leaves entries there. Within the run the capture cache is on,
  as it is for users: a model compiled again is translated from its entry, after the check on use
  (its cached program against the model's eager forward). Tests that are about the caches give
  them a directory of their own.
"""
import os
import shutil
import tempfile

os.environ.setdefault("REMAT_VERIFY_EACH_PASS", "1")

# Made once, by the first process of the run (pytest-xdist's workers inherit the variable).
_OWN_CACHE = None
if "REMAT_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="remat-tests-")
    os.environ["REMAT_CACHE_DIR"] = _OWN_CACHE


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
