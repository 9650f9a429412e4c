"""Every op's VJP rule against central finite differences in float64, generated from the op
registry's samples, plus the completeness check (a VJP or ``nondiff`` for every op)."""
from __future__ import annotations

import numpy as np
import pytest

from remat.autodiff import STRUCTURAL_OPS, DifferentiationError
from remat.ir import OPS
from remat.ir.ops._vjp import VARIANTS

from _util import check_vjp, float_indices, op_function

DIFF_OPS = sorted(n for n, o in OPS.items() if o.vjp is not None)
CASES = [(n, k) for n in DIFF_OPS for k in range(len(OPS[n].sample(np.random.default_rng(0))))]


def test_every_op_has_a_vjp_or_is_nondiff():
    missing = [n for n, o in OPS.items() if o.vjp is None and not o.nondiff and n not in STRUCTURAL_OPS]
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
    f = op_function("f", name, args, s.attrs)
    out = f.result_types[0]
    rtol = 1e-6 if out.dtype.value == "f64" else 1e-3
    eps = 1e-6 if out.dtype.value == "f64" else 1e-3
    a = s.attrs
    if name == "max_pool2d_grad" and tuple(a.get("stride") or a["kernel"]) != tuple(a["kernel"]):
        with pytest.raises(DifferentiationError, match="non-overlapping windows"):
            check_vjp(f, args, rng)
        return
    if name in ("layer_norm_grad", "batch_norm_grad"):  # native backward kernels: first order only
        with pytest.raises(DifferentiationError, match="second-order differentiation through"):
            check_vjp(f, args, rng)
        return
    check_vjp(f, args, rng, eps=eps, rtol=rtol)


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
