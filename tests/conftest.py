"""Suite-wide settings: every pass's result is verified (``REMAT_VERIFY_EACH_PASS``; a compile
alone verifies each stage's result only), and models are captured afresh (``REMAT_CAPTURE_CACHE``
off: the capture cache is tested by its own tests, with a cache directory of their own), also in
the subprocesses the tests start."""
import os

os.environ.setdefault("REMAT_VERIFY_EACH_PASS", "1")
os.environ.setdefault("REMAT_CAPTURE_CACHE", "0")
