"""Index-carrying kernels (gather, scatter_add, nll_loss, nll_loss_grad) refuse out-of-range
indices in every dialect with an IndexError naming the op, the value and the valid range."""
from __future__ import annotations

import numpy as np
import pytest

import remat
from remat.ir import parse

CASES = {
    "gather": ("func @f(%0: f32[5,3], %1: i64[4]) -> f32[4,3] {\n  %2 = gather %0, %1 : f32[4,3]\n  return %2\n}\n",
               lambda idx: [np.zeros((5, 3), np.float32), idx], 5, "index (axis 0)", ""),
    "scatter_add": ("func @f(%0: i64[4], %1: f32[4,3]) -> f32[5,3] {\n  %2 = scatter_add %0, %1 {shape=[5, 3]} : f32[5,3]\n"
                    "  return %2\n}\n", lambda idx: [idx, np.ones((4, 3), np.float32)], 5, "index (axis 0)", ""),
    "nll_loss": ("func @f(%0: f32[4,5], %1: i64[4]) -> f32[] {\n  %2 = nll_loss %0, %1 : f32[]\n  return %2\n}\n",
                 lambda idx: [np.zeros((4, 5), np.float32), idx], 5, "target", " or equal ignore_index (-100)"),
    "nll_loss_grad": ("func @f(%0: f32[], %1: i64[4]) -> f32[4,5] {\n  %2 = nll_loss_grad %0, %1 {num_classes=5} : f32[4,5]\n"
                      "  return %2\n}\n", lambda idx: [np.ones((), np.float32), idx], 5, "target",
                      " or equal ignore_index (-100)"),
}


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
@pytest.mark.parametrize("op", sorted(CASES))
@pytest.mark.parametrize("bad", [5, 99, -1, -5])
def test_out_of_range_index_names_op_value_and_range(op: str, dialect: str, bad: int) -> None:
    text, args, n, what, also = CASES[op]
    f = parse(text)["f"]
    idx = np.array([0, bad, 1, 2], np.int64)
    with pytest.raises(IndexError) as e:
        remat.run(f, *args(idx), dialects=dialect)
    msg = str(e.value)
    assert f"{dialect}.{op}" in msg and f"'{op}': {what} {bad} is out of range; valid: [0, {n}){also}" in msg, msg
    ok = np.array([0, 4, 1, 2], np.int64)
    remat.run(f, *args(ok), dialects=dialect)  # in range: runs


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_ignore_index_is_allowed_even_out_of_range(dialect: str) -> None:
    f = parse("func @f(%0: f32[3,5], %1: i64[3]) -> f32[] {\n  %2 = nll_loss %0, %1 {ignore_index=-7} : f32[]\n"
              "  return %2\n}\n")["f"]
    logp = np.log(np.full((3, 5), 0.2, np.float32))
    (out,), _ = remat.run(f, logp, np.array([1, -7, 4]), dialects=dialect)
    assert np.allclose(np.asarray(out), -np.log(0.2))  # the mean over the two kept rows


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
@pytest.mark.parametrize("op", sorted(n for n, d in remat.ir.OPS.items() if d.index_bounds is not None))
def test_every_op_declaring_index_bounds_checks_them(op: str, dialect: str) -> None:
    """Generated from the registry: each sample of an op with ``index_bounds``, its index set one
    past the valid range, raises IndexError naming the op and the value in every dialect."""
    from remat.ir import Builder, DType, Function, TensorType

    opdef = remat.ir.OPS[op]
    for sample in opdef.sample(np.random.default_rng(0)):
        types = [TensorType(DType.from_numpy(np.asarray(a).dtype), np.shape(a)) for a in sample.args]
        attrs = opdef.check_attrs(types, sample.attrs)
        bounds = opdef.index_bounds(types, attrs)
        args = [np.array(a, copy=True) for a in sample.args]
        args[bounds.operand].reshape(-1)[0] = bounds.size
        f = Function("f", types, list(opdef.result_types(types, attrs)))
        b = Builder(f.entry)
        out = b.op(op, *f.params, **sample.attrs)
        b.ret(*(out if isinstance(out, tuple) else (out,)))
        with pytest.raises(IndexError, match=rf"{dialect}\.{op}(?s:.*)'{op}': \w+.* {bounds.size} is out of range; "
                                             rf"valid: \[0, {bounds.size}\)"):
            remat.run(f, *args, dialects=dialect)
