"""Every op's VJP rule against central finite differences in float64, generated from the op
registry's samples, plus the completeness check (a VJP or ``nondiff`` for every op)."""
from __future__ import annotations

import numpy as np
import pytest

from remat.autodiff import DifferentiationError
from remat.ir import OPS, Builder, DType, Function, TensorType
from remat.ir.ops._vjp import VARIANTS

from _interp import evaluate
from _util import check_vjp, float_indices, grad_module, op_function, ttype

DIFF_OPS = sorted(n for n, o in OPS.items() if o.vjp is not None)
CASES = [(n, k) for n in DIFF_OPS for k in range(len(OPS[n].sample(np.random.default_rng(0))))]


def test_every_op_has_a_vjp_or_is_nondiff():
    missing = [n for n, o in OPS.items() if o.vjp is None and not o.nondiff and not o.has("control")]
    assert not missing, f"ops without a VJP rule and not marked nondiff: {missing}"
    both = [n for n, o in OPS.items() if o.vjp is not None and o.nondiff]
    assert not both, f"ops marked nondiff that also have a VJP: {both}"


def test_every_differentiable_op_has_samples():
    assert all(OPS[n].sample is not None for n in DIFF_OPS)


def test_saves_declarations_follow_flexible_adjoints():
    for n in ("relu", "tanh", "sigmoid", "exp", "softmax", "log_softmax"):
        assert OPS[n].vjp_saves == "outputs", n
        assert VARIANTS[(n, "inputs")][1] == "inputs", n
    for n in ("add", "sub", "neg"):
        assert OPS[n].vjp_saves == "none", n
    for n in ("mul", "matmul"):
        assert OPS[n].vjp_saves == "inputs", n


def _sample(name, k, seed=0):
    rng = np.random.default_rng(seed + 17 * k)
    s = OPS[name].sample(rng)[k]
    return s, rng


@pytest.mark.parametrize("name,k", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_vjp_matches_finite_differences(name, k):
    s, rng = _sample(name, k)
    args = [np.asarray(a) for a in s.args]
    if not float_indices(args):
        pytest.skip("no floating-point operand")
    f = op_function("f", name, args, s.attrs, results=(0,) if name in ("attention", "dropout_attention", "linear_cross_entropy", "cross_entropy", "conv_bn_relu_pool", "group_norm") else None)  # logsumexp, statistics: not differentiable
    out = f.result_types[0]
    rtol = 1e-6 if out.dtype.value == "f64" else 1e-3
    eps = 1e-6 if out.dtype.value == "f64" else 1e-3
    a = s.attrs
    if name == "max_pool2d_grad" and tuple(a.get("stride") or a["kernel"]) != tuple(a["kernel"]):
        with pytest.raises(DifferentiationError, match="non-overlapping windows"):
            check_vjp(f, args, rng)
        return
    if name in ("layer_norm_grad", "batch_norm_grad", "group_norm_grad", "attention_grad", "max_pool2d_index_grad",
                "linear_cross_entropy_grad", "cross_entropy_grad", "dropout_attention_grad", "conv_bn_relu_pool_grad",
                "conv_bn_relu_pool_sums"):  # native backward kernels: first order only
        with pytest.raises(DifferentiationError, match="second-order differentiation through"):
            check_vjp(f, args, rng)
        return
    if name == "conv2d_grads":  # made by lowering, after differentiation
        with pytest.raises(DifferentiationError, match="made by lowering"):
            check_vjp(f, args, rng)
        return
    check_vjp(f, args, rng, eps=eps, rtol=rtol)


MIXED_BN = {"batch_norm": 1, "batch_norm_stats": 1}
"""The differentiable batch-norm ops of the mixed-dtype form (a half-precision input, float32
per-channel operands: ATen's mixed kernel under ``torch.autocast``): their leading activations."""
MIXED_CASES = [(n, k) for n in sorted(MIXED_BN) for k, s in enumerate(OPS[n].sample(np.random.default_rng(0)))
               if len(s.args) > MIXED_BN[n]]


@pytest.mark.parametrize("dt", [DType.bf16, DType.f16], ids=str)
@pytest.mark.parametrize("name,k", MIXED_CASES, ids=[f"{n}-{k}" for n, k in MIXED_CASES])
def test_mixed_dtype_vjp_is_the_float32_vjp(name, k, dt):
    """The mixed form differentiates as the one-dtype op on a float32 copy of its input (the cast it
    replaces) does: every cotangent within rounding, the input's in its own dtype and the
    per-channel ones in float32; the backward reads the half-precision input, not a copy."""
    s, rng = _sample(name, k)
    n = MIXED_BN[name]
    lo = [np.asarray(a).astype(dt.numpy if i < n else np.float32) for i, a in enumerate(s.args)]
    wide = [a.astype(np.float32) for a in lo]
    fm, fw = op_function("f", name, lo, s.attrs), op_function("f", name, wide, s.attrs)
    assert [t.dtype for t in fm.result_types][n:] == [DType.f32] * (len(fm.result_types) - n)
    mm, mw = grad_module(fm, list(range(len(lo)))), grad_module(fw, list(range(len(lo))))
    if name == "batch_norm":  # through y to x, weight, bias (a model's use): no float32 copy of the input
        from remat.passes.dce import dce

        g = dce(grad_module(op_function("f", name, lo, s.attrs, results=(0,)), list(range(min(len(lo), 3)))))["f_grad"]
        widened = [i for i in g.instructions() if i.op.name == "cast" and i.results[0].type.dtype == DType.f32
                   and i.results[0].type.shape == lo[0].shape]
        assert not widened, f"a float32 copy of the input: {widened}"
    ys = evaluate(fm, lo, mm)
    vs = [rng.standard_normal(y.shape).astype(y.dtype) for y in ys]
    gm = evaluate(mm["f_grad"], lo + vs, mm)
    gw = evaluate(mw["f_grad"], wide + [v.astype(np.float32) for v in vs], mw)
    for i, (a, b) in enumerate(zip(gm, gw)):
        assert a.dtype == lo[i].dtype, f"cotangent {i}: {a.dtype}, operand {lo[i].dtype}"
        tol = {DType.bf16: 1e-2, DType.f16: 2e-3}[dt] if i < n else 1e-4
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol * scale,
                                   err_msg=f"cotangent {i}")


def test_attention_saves_exactly_its_operands_and_results():
    from remat.ir.ops._vjp import Saves, saved_indices

    saves = OPS["attention"].vjp_saves
    assert saves == Saves(operands=(0, 1, 2, 3), results=(0, 1))
    assert saved_indices(saves, 3, 2) == ({0, 1, 2}, {0, 1})  # no mask: the optional operand is skipped
    assert saved_indices(saves, 4, 2) == ({0, 1, 2, 3}, {0, 1})


def test_attention_logsumexp_is_not_differentiable():
    from remat.ir import Builder, Function

    s, _ = _sample("attention", 0)
    f = Function("f", [ttype(a) for a in s.args])
    b = Builder(f.entry)
    out, lse = b.op("attention", *f.params, **s.attrs)
    tot = b.op("add", b.op("reduce_sum", out, axes=[0, 1, 2]), b.op("reduce_sum", lse, axes=[0, 1]))
    f.result_types = [tot.type]
    b.ret(tot)
    with pytest.raises(DifferentiationError, match="logsumexp result of 'attention' is not differentiable"):
        grad_module(f, [0])


VARIANT_CASES = [(n, k) for (n, pol) in sorted(VARIANTS) for k in range(len(OPS[n].sample(np.random.default_rng(0))))]


@pytest.mark.parametrize("name,k", VARIANT_CASES, ids=[f"{n}-{k}" for n, k in VARIANT_CASES])
def test_input_keeping_variants_match_finite_differences(name, k):
    from _util import grad_module
    from _interp import evaluate

    s, rng = _sample(name, k, seed=5)
    args = [np.asarray(a) for a in s.args]
    f = op_function("f", name, args, s.attrs)
    a = grad_module(f, [0], adjoints="outputs")
    b = grad_module(f.clone(), [0], adjoints="inputs")
    v = rng.standard_normal(f.result_types[0].shape)
    ga = evaluate(a["f_grad"], args + [v], a)[0]
    gb = evaluate(b["f_grad"], args + [v], b)[0]
    np.testing.assert_allclose(ga, gb, rtol=1e-10, atol=1e-12)
    check_vjp(f, args, rng)


def test_normalisation_saves_statistics_not_the_output():
    """layer_norm / batch_norm backward ops read input, weight and statistics, never the output."""
    from remat.ir.ops._vjp import saved_indices

    assert saved_indices(OPS["layer_norm"].vjp_saves, 3, 3) == ({0, 1}, {1, 2})
    assert saved_indices(OPS["layer_norm"].vjp_saves, 1, 3) == ({0}, {1, 2})  # no weight: index 1 ignored
    bn = OPS["batch_norm"].vjp_saves
    assert saved_indices(bn, 5, 5, {"training": True, "affine": True}) == ({0, 1}, {1, 2})
    assert saved_indices(bn, 5, 1, {"training": False, "affine": True}) == ({0, 1, 3, 4}, set())
    assert saved_indices(bn, 3, 1, {"training": False, "affine": False}) == ({0, 1, 2}, set())
    rng = np.random.default_rng(0)
    for op, args, attrs in [("layer_norm", [rng.standard_normal((4, 6)), np.ones(6), np.zeros(6)], {"axis": 1}),
                            ("batch_norm", [rng.standard_normal((4, 3, 2)), np.ones(3), np.zeros(3)], {})]:
        f = Function("f", [TensorType(DType.f64, a.shape) for a in args])
        b = Builder(f.entry)
        y = b.op(op, *f.params, **attrs)[0]
        f.result_types = [y.type]
        b.ret(y)
        from _util import grad_module

        g = grad_module(f, [0, 1, 2])["f_grad"]
        fwd = next(i for i in g.instructions() if i.op.name == op)
        readers = [i for i in g.instructions() if any(o in fwd.results for o in i.operands)]
        assert [i.op.name for i in readers] == [op + "_grad"], readers
        assert fwd.results[0] not in readers[0].operands and set(fwd.results[1:3]) <= set(readers[0].operands)
