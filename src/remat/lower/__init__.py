"""Lowering a planned program for execution.

``fuse``: element-wise instruction DAGs become ``fused`` instructions run by one backend kernel;
``siblings``: a convolution's input and weight gradients become one ``conv2d_grads`` call;
``small_values``: a small recomputed value is read from its first run instead; ``bn_recompute``: a
recomputed batch norm output is normalised from the first run's statistics. All keep only the
rewrites whose peak (``remat.plan.simulator.predict_peak``) stays within the budget, or where it
was. They sit above ``plan/`` because they are checked by the memory simulator of record.
"""
from __future__ import annotations

from .fuse import FuseStats, Group, find_groups, fuse, fuse_function, fuse_pass
from .small_values import find_small, reuse_small, reuse_small_pass
from .siblings import Pair, find_pairs, merge_conv_grads, merge_conv_grads_pass

__all__ = ["FuseStats", "Group", "Pair", "find_groups", "find_pairs", "find_small", "fuse", "fuse_function", "fuse_pass",
           "merge_conv_grads", "merge_conv_grads_pass", "reuse_small", "reuse_small_pass"]
