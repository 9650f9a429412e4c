"""remat: a training compiler that fits deep-learning training into a memory budget
with the least recomputation.

The pipeline, by folder: ``ir`` (typed SSA tensor IR, text format, verifier) ←
``frontend`` (staged DSL, PyTorch importer) → ``autodiff`` → ``passes`` → ``step`` (the training
graph and optimizer updates as IR) → ``plan`` (cost model, memory simulator, chain DP and graph
solvers, block cutting, portfolio) → ``lower`` (fusion) → ``backends`` (dialects) → ``runtime``
(the VM). ``train`` runs them as the stages of ``remat.compile``, one function each over one
record (``train/compilation.py``)::

    capture → layout → bind → training graph → prepare → [profile] → plan → lower → fuse
            → [compile kernels] → prepare VM

and ``TrainStep`` (``train/api.py``) runs the result; ``distributed`` rewrites a step for data
parallelism on ``torch.distributed``.
"""
from __future__ import annotations

import importlib
from typing import Any

from .errors import BudgetTooSmall, NonFiniteStep, StepFailed, format_bytes
from .ir import (DType, Function, Module, ParseError, TensorType, VerificationError, parse, verify)
from .ir.types import DType as _D, _TypeMaker

bool_ = _TypeMaker(_D.bool)
i32 = _TypeMaker(_D.i32)
i64 = _TypeMaker(_D.i64)
f16 = _TypeMaker(_D.f16)
bf16 = _TypeMaker(_D.bf16)
f32 = _TypeMaker(_D.f32)
f64 = _TypeMaker(_D.f64)

__version__ = "0.1.0"

# Public names provided by later stages of the pipeline, imported on first use so that
# ``import remat`` stays light and the IR never depends on them.
_LAZY = {
    "function": "remat.frontend.dsl",
    "Staged": "remat.frontend.dsl",
    "cond": "remat.frontend.dsl",
    "ops": "remat.frontend.dsl",
    "run": "remat.runtime.vm",
    "RunStats": "remat.runtime.vm",
    "VM": "remat.runtime.vm",
    "dialects": "remat.backends",
    "grad": "remat.autodiff.api",
    "autocast": "remat.passes.autocast",  # mixed precision over the IR (a staged function or a Function)
    "value_and_grad": "remat.autodiff.api",
    "compile": "remat.train.api",
    "max_batch": "remat.train.max_batch",
    "MicroBatchingRefused": "remat.train.microbatch",
    "UnsupportedOpError": "remat.frontend.torch_import",  # what a capture raises, to catch by name
    "CaptureError": "remat.frontend.torch_import",
    "DeviceSpec": "remat.plan.device",    # planning for a device (dry runs: remat.compile(..., dry_run=True))
    "DEVICES": "remat.plan.device",
    "DryRunStep": "remat.train.dry_run",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod = _LAZY[name]
        value = getattr(importlib.import_module(mod), name) if name != "dialects" else importlib.import_module(mod)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'remat' has no attribute '{name}'")


__all__ = ["BudgetTooSmall", "NonFiniteStep", "StepFailed", "DType", "Function", "Module", "ParseError", "TensorType", "VerificationError",
           "bf16", "bool_", "f16", "f32", "f64", "format_bytes", "i32", "i64", "parse", "verify", *_LAZY]
