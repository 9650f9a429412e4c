"""Numba's on-disk cache for remat's own compiled helpers (the planners' kernels), made safe.

``numba.njit(cache=True)`` keeps compiled code next to the source (its ``__pycache__``) or, where that
is read-only, under the user's home. Two things went wrong with it: an install where neither is
writable (a read-only site-packages in a container whose ``$HOME`` is not writable) made Numba raise
"no locator available" when the module was imported, so no compile could start; and a damaged cache
file (a process killed while writing, a disk error) made every later compile fail with Numba's
``UnpicklingError`` until the file was removed by hand. :func:`njit` compiles without the on-disk
cache in the first case and repairs the cache in the second (each said once with a warning), and
returns Numba's own dispatcher, so jitted helpers still call each other in nopython code.
(The kernels generated per step are cached by :func:`remat.backends.numba_kernels.njit_cached`.)
"""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any, Callable


def njit(py_func: Callable) -> Any:
    """``numba.njit(cache=True)(py_func)``, with the cache files checked now (an index or data file
    that cannot be read is removed: the function compiles again on its first call), or without the
    on-disk cache where Numba finds nowhere to write it."""
    import numba

    try:
        dispatcher = numba.njit(cache=True)(py_func)
    except RuntimeError as e:
        if not no_locator(e):
            raise
        warn_uncached(py_func, e, stacklevel=3)
        return numba.njit(py_func)
    _repair(dispatcher, py_func)
    return dispatcher


def no_locator(e: BaseException) -> bool:
    """Whether ``e`` is Numba's "cannot cache function ...: no locator available" (nowhere to write)."""
    return isinstance(e, RuntimeError) and "no locator available" in str(e)


def warn_uncached(py_func: Callable, e: BaseException, stacklevel: int) -> None:
    warnings.warn(f"remat: Numba cannot cache {py_func.__qualname__} ({str(e).strip()[:160]}); it is compiled "
                  "in each process instead (set NUMBA_CACHE_DIR to a writable directory to cache it)",
                  RuntimeWarning, stacklevel=stacklevel)


def remove_files(paths) -> list[str]:
    """Remove each of ``paths`` (a directory too, where a cache file should be); the names removed."""
    removed = []
    for f in paths:
        try:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
            removed.append(f.name)
        except OSError:
            pass
    return removed


def cache_files(dispatcher: Any) -> list[Path]:
    """The index and data files of a Numba dispatcher's on-disk cache that exist (where Numba's
    locator puts them); none where Numba's internals moved."""
    try:
        cache = dispatcher._cache
        directory = Path(cache._cache_path)
        index = cache._cache_file._index_name
    except Exception:  # noqa: BLE001  Numba's internals moved: nothing to find
        return []
    base = index[:-len(".nbi")]
    return sorted(f for f in [directory / index, *directory.glob(f"{base}.*.nbc")] if f.exists())


def _repair(dispatcher: Any, py_func: Callable) -> None:
    """Remove ``dispatcher``'s cache files when its index or a data file it lists cannot be read."""
    paths = cache_files(dispatcher)
    if not paths:
        return
    try:
        files = dispatcher._cache._cache_file
        for name in files._load_index().values():
            files._load_data(name)
        return
    except Exception as e:  # noqa: BLE001  truncated, garbage, a directory: any of them stops every call
        error = e
    directory = paths[0].parent
    removed = remove_files(paths)
    warnings.warn(f"remat: Numba's cached code of {py_func.__qualname__} in {directory} could not be loaded "
                  f"({type(error).__name__}: {str(error).strip()[:160]}); removed {', '.join(removed) or 'nothing'}: "
                  "it compiles again on its first call", RuntimeWarning, stacklevel=3)


__all__ = ["cache_files", "njit", "no_locator", "remove_files", "warn_uncached"]
