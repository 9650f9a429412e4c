"""Lowering a planned program for execution.

``fuse``: element-wise instruction DAGs become ``fused`` instructions run by one backend kernel,
keeping only the groups that leave the planned peak (``remat.plan.liveness.predict_peak``) where it
was. It sits above ``plan/`` because it is checked by the memory simulator of record.
"""
from __future__ import annotations

from .fuse import FuseStats, Group, find_groups, fuse, fuse_function, fuse_pass

__all__ = ["FuseStats", "Group", "find_groups", "fuse", "fuse_function", "fuse_pass"]
