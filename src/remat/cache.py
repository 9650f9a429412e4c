"""Where remat's on-disk caches live: ``$REMAT_CACHE_DIR``, else ``~/.cache/remat``.

A module of its own (importing nothing) so that every layer can find the caches without importing
the layer that fills them (the Numba kernels, the workspaces, the captured models)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """remat's on-disk caches: ``$REMAT_CACHE_DIR``, else ``~/.cache/remat``."""
    root = os.environ.get("REMAT_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "remat"
