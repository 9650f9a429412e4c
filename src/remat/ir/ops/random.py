"""Random ops. Each is a deterministic function of an explicit i64 seed operand, so a
recomputation (rematerialisation) replays exactly the same values."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, OpDef, Sample, declare
from ..types import DType, TensorType
from ._util import ints, max_numel

SEED = TensorType(DType.i64, ())


def _check_seed(name, types):
    (s,) = types
    if s != SEED:
        raise TypeError(f"'{name}' takes a seed operand of type i64[], got {s}")


def _float_random_infer(name):
    def infer(types, attrs):
        _check_seed(name, types)
        if not attrs["dtype"].is_float:
            raise TypeError(f"'{name}' produces floats; dtype must be f16, bf16, f32 or f64, got {attrs['dtype']}")
        return TensorType(attrs["dtype"], attrs["shape"])

    return infer


def _seed(r):
    return np.array(r.integers(0, 2**31), dtype=np.int64)


declare(OpDef("uniform", 1, (ints("shape"), Attr("dtype", "dtype", DType.f32), Attr("low", "float", 0.0),
                             Attr("high", "float", 1.0)), _float_random_infer("uniform"), frozenset({"random"}),
              nondiff=True, doc="uniform samples in [low, high) from the seed", flops=max_numel,
              sample=lambda r: [Sample([_seed(r)], {"shape": (3, 4)})]))
declare(OpDef("normal", 1, (ints("shape"), Attr("dtype", "dtype", DType.f32), Attr("mean", "float", 0.0),
                            Attr("std", "float", 1.0)), _float_random_infer("normal"), frozenset({"random"}),
              nondiff=True, doc="normal samples from the seed", flops=max_numel,
              sample=lambda r: [Sample([_seed(r)], {"shape": (2, 5), "std": 2.0})]))


def _bernoulli_infer(types, attrs):
    _check_seed("bernoulli", types)
    if not 0.0 <= attrs["p"] <= 1.0:
        raise TypeError(f"'bernoulli': p must be in [0, 1], got {attrs['p']}")
    return TensorType(DType.bool, attrs["shape"])


declare(OpDef("bernoulli", 1, (ints("shape"), Attr("p", "float")), _bernoulli_infer, frozenset({"random"}),
              nondiff=True, doc="bool mask, true with probability p, from the seed (dropout masks)", flops=max_numel,
              sample=lambda r: [Sample([_seed(r)], {"shape": (4, 4), "p": 0.7})]))


def _fold_infer(types, attrs):
    _check_seed("fold_seed", types)
    return SEED


declare(OpDef("fold_seed", 1, (Attr("salt", "int"),), _fold_infer, frozenset(), nondiff=True,
              doc="derive an independent seed from a seed and a constant salt", flops=max_numel,
              sample=lambda r: [Sample([_seed(r)], {"salt": 7})]))
