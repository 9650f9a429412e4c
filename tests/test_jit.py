"""remat's own Numba helpers (the planners' kernels, ``remat._jit.njit``) and the per-step kernels'
loader (``njit_cached``) on a damaged cache and where Numba finds nowhere to write one."""
from __future__ import annotations

import importlib.util
import shutil
import sys
import uuid
import warnings

import numba
import numpy as np
import pytest

from remat import _jit
from remat.backends import numba_kernels as nk

SOURCE = '''
import numpy as np
from remat._jit import njit


@njit
def total(x):
    s = 0.0
    for v in x:
        s += v
    return s
'''


def _load(directory):
    """A fresh import of a module holding one planner-style kernel (Numba caches by source file)."""
    name = f"jitmod_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, directory / "jitmod.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("how", ["truncated", "garbage", "directory"])
def test_a_damaged_cache_of_a_planner_kernel_is_removed_and_compiled_again(tmp_path, how):
    (tmp_path / "jitmod.py").write_text(SOURCE)
    x = np.arange(5.0)
    assert _load(tmp_path).total(x) == 10.0  # compiled and cached
    index = sorted((tmp_path / "__pycache__").glob("jitmod.total-*.nbi"))
    assert index
    for f in index:
        if how == "truncated":
            f.write_bytes(f.read_bytes()[:10])
        elif how == "garbage":
            f.write_bytes(b"\x80\x04not a pickle at all")
        else:
            f.unlink()
            f.mkdir()
    with pytest.warns(RuntimeWarning, match=r"cached code of total .* could not be loaded"):
        module = _load(tmp_path)
    assert module.total(x) == 10.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt cache loads without a word
        assert _load(tmp_path).total(x) == 10.0


def _no_locator(monkeypatch):
    """Numba as on a read-only install whose user has no writable home: caching raises at decoration."""
    real = numba.njit

    def njit(*args, **options):
        if options.get("cache"):
            def deco(fn):
                raise RuntimeError(f"cannot cache function {fn.__name__!r}: no locator available for file "
                                   f"{fn.__code__.co_filename!r}")
            return deco(args[0]) if args and callable(args[0]) else deco
        return real(*args, **options)

    monkeypatch.setattr(numba, "njit", njit)


def test_where_numba_cannot_cache_the_kernels_compile_per_process(tmp_path, monkeypatch):
    _no_locator(monkeypatch)

    def double(x):
        return x * 2

    with pytest.warns(RuntimeWarning, match="compiled in each process instead"):
        f = _jit.njit(double)
    assert f(3) == 6
    with pytest.warns(RuntimeWarning, match="compiled in each process instead"):
        g = nk.njit_cached(double, "int64(int64)")
    assert g(4) == 8


def test_a_directory_in_place_of_a_step_kernels_cache_file_is_removed(tmp_path, monkeypatch):
    (tmp_path / "stepmod.py").write_text("def triple(x):\n    return x * 3\n")
    spec = importlib.util.spec_from_file_location(f"stepmod_{uuid.uuid4().hex}", tmp_path / "stepmod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert nk.njit_cached(module.triple, "int64(int64)")(2) == 6
    for f in (tmp_path / "__pycache__").glob("stepmod.triple-*"):
        if f.suffix in (".nbi", ".nbc"):
            f.unlink()
            f.mkdir()
    with pytest.warns(RuntimeWarning, match="could not be loaded"):
        assert nk.njit_cached(module.triple, "int64(int64)")(5) == 15
    assert not any(p.is_dir() for p in (tmp_path / "__pycache__").glob("stepmod.triple-*"))
    shutil.rmtree(tmp_path / "__pycache__")
