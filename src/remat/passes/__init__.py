"""IR -> IR passes (simplify, fold, cse, dce, …), listed by name, and the pipelines made of them.

``PASSES`` names the passes of this package; :mod:`remat.pipeline` adds the passes of the packages
above (``grad``, ``insert-frees``, ``fuse``) and is the registry users and ``remat opt`` see.
"""
from __future__ import annotations

from typing import Sequence

from ..ir import Module
from .attention import attention_pass, fold_head_transposes_pass, fold_kv_repeats_pass
from .autocast import autocast_f16_pass, autocast_pass
from .batchnorm import split_batch_norm, split_batch_norm_grad
from .concatconv import split_concat_conv_pass
from .convblock import split_conv_bn_relu_pool, tile_conv_bn_pool_pass
from .crossentropy import cross_entropy_pass, logits_cross_entropy_pass
from .cse import cse
from .dce import dce
from .decompose import decompose_pass
from .fold import fold
from .gelu import gelu_pass
from .inline import inline
from .layout import channels_last
from .pipeline import PassFn, PassRecord, PipelineResult, lookup, run_passes
from .simplify import simplify

PASSES: dict[str, PassFn] = {
    "inline": inline,
    "simplify": simplify,
    "fold": fold,
    "cse": cse,
    "dce": dce,
    "attention": attention_pass,
    "fold-head-transposes": fold_head_transposes_pass,
    "fold-kv-repeats": fold_kv_repeats_pass,
    "gelu": gelu_pass,
    "decompose": decompose_pass,
    "cross-entropy": logits_cross_entropy_pass,
    "linear-cross-entropy": cross_entropy_pass,
    "split-batch-norm": split_batch_norm,
    "split-batch-norm-grad": split_batch_norm_grad,
    "split-concat-conv": split_concat_conv_pass,
    "split-conv-bn-relu-pool": split_conv_bn_relu_pool,
    "tile-conv-bn-pool": tile_conv_bn_pool_pass,
    "channels-last": channels_last,
    "autocast": autocast_pass,
    "autocast-f16": autocast_f16_pass,
}
"""The passes of this package by name."""

CLEANUP: list[str] = ["inline", "simplify", "fold", "cse", "dce"]
"""The clean-up pipeline run after differentiation: one flat function, simplified, folded,
common subexpressions merged, dead code removed."""

PRE_DIFFERENTIATION: list[str] = ["simplify", "fold-kv-repeats", "simplify", "dce", "fold-head-transposes", "simplify",
                                  "dce"]
"""The passes run on a forward before it is differentiated. Simplifying first builds the backward
from the simplified forward (e.g. a matmul reading a transposed weight through its flags gets
flagged-matmul cotangents, not a cotangent transposed back by a materialised copy); attention
reading heads-transposed operands in place gets a backward that writes its gradients in that layout;
grouped-query attention reading its shared key/value heads keeps no repeated copies for the backward."""


def run(module: Module, names: Sequence[str], verify_each: bool | None = None) -> PipelineResult:
    """Run passes of this package by name (the packages above use :func:`remat.pipeline.run_pipeline`)."""
    return run_passes(module, lookup(PASSES, names, " in remat.passes"), verify_each)


__all__ = ["CLEANUP", "PASSES", "PRE_DIFFERENTIATION", "PassFn", "PassRecord", "PipelineResult", "lookup", "run", "run_passes"]
