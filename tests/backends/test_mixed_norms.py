"""Layer and group norm of an f16/bf16 input with f32 weight and bias (what ``torch.autocast`` leaves it, as
ATen's mixed-type kernels take it: f32 statistics, the output in the input's dtype): the op's types,
its torch kernels against eager PyTorch, the NumPy reference and the decomposition against them, and
a clear error for other mixes."""
from __future__ import annotations

import pytest
import torch

from remat.ir import OPS, DType, Module, TensorType
from remat.passes.decompose import decompose
from remat.runtime.vm import VM
from test_decompositions import op_module as _module


def _t(x: torch.Tensor) -> TensorType:
    return TensorType({torch.bfloat16: DType.bf16, torch.float16: DType.f16, torch.float32: DType.f32}[x.dtype],
                      tuple(x.shape))


@pytest.fixture
def case():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 16, generator=g).bfloat16()
    w, b = torch.randn(16, generator=g) * 0.5 + 1, torch.randn(16, generator=g)
    return x, w, b, torch.randn(4, 8, 16, generator=g).bfloat16()


def _run(m: Module, dialects: str, args) -> list[torch.Tensor]:
    outs, _ = VM(m, dialects=dialects).run("f", *[a.clone() for a in args], outputs="torch")
    return [torch.as_tensor(o) for o in outs]


def test_types_follow_atens_mixed_kernels(case):
    x, w, b, _ = case
    y, mean, rstd = OPS["layer_norm"].result_types([_t(x), _t(w), _t(b)], {"axis": 2})
    assert (y.dtype, mean.dtype, rstd.dtype) == (DType.bf16, DType.f32, DType.f32)
    gx, gw, gb = OPS["layer_norm_grad"].result_types([_t(x), _t(x), mean, rstd, _t(w)], {"axis": 2})
    assert (gx.dtype, gw.dtype, gb.dtype) == (DType.bf16, DType.f32, DType.f32)
    # all-bf16 stays all-bf16, as ATen's kernel
    assert OPS["layer_norm"].result_types([_t(x), _t(w.bfloat16())], {"axis": 2})[1].dtype == DType.bf16


def test_kernels_match_eager_and_the_reference(case):
    """The torch kernels are ATen's (as eager autocast runs them); the NumPy reference and the
    decomposition compute in f32 throughout, so they match the f32 math on the bf16 values closer
    than ATen's backward, which sums the weight's and bias's gradients less exactly."""
    x, w, b, gy = case
    xr = x.clone().requires_grad_()
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    want = torch.nn.functional.layer_norm(xr, (16,), wr, br)
    want.backward(gy)
    fwd = _module("layer_norm", [_t(x), _t(w), _t(b)], {"axis": 2})
    y, mean, rstd = _run(fwd, "torch", [x, w, b])
    assert y.dtype == torch.bfloat16 and mean.dtype == torch.float32
    torch.testing.assert_close(y, want.detach(), rtol=0, atol=0)
    bwd = _module("layer_norm_grad", [_t(gy), _t(x), _t(mean), _t(rstd), _t(w)], {"axis": 2})
    grads = _run(bwd, "torch", [gy, x, mean, rstd, w])
    for got, ref in zip(grads, (xr.grad, wr.grad, br.grad)):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    x32 = x.float().requires_grad_()
    w32, b32 = w.clone().requires_grad_(), b.clone().requires_grad_()
    y32 = torch.nn.functional.layer_norm(x32, (16,), w32, b32)
    y32.backward(gy.float())
    for m, args, ref, dts in ((fwd, [x, w, b], (y32,), (torch.bfloat16,)),
                              (bwd, [gy, x, mean, rstd, w], (x32.grad, w32.grad, b32.grad),
                               (torch.bfloat16, torch.float32, torch.float32))):
        for variant in (m, decompose(m)):  # the NumPy reference, and the decomposition on it
            got = _run(variant, "numpy", args)
            for g, r, dt in zip(got, ref, dts):
                assert g.dtype == dt
                tol = 1e-2 if dt == torch.bfloat16 else 1e-5  # f32 results: the same math in f32
                torch.testing.assert_close(g.float(), r.detach(), rtol=tol, atol=tol)


def test_other_mixes_are_refused_clearly(case):
    x, w, b, _ = case
    with pytest.raises(TypeError, match=r"weight f16\[16\] must be bf16\[16\] \(or f32, for an f16/bf16 input\)"):
        OPS["layer_norm"].result_types([_t(x), _t(w.half()), _t(b)], {"axis": 2})
    with pytest.raises(TypeError, match=r"bias bf16\[16\] must be f32\[16\]"):
        OPS["layer_norm"].result_types([_t(x), _t(w), _t(b.bfloat16())], {"axis": 2})
    with pytest.raises(TypeError, match=r"weight f32\[16\] must be f64\[16\]"):
        OPS["layer_norm"].result_types([TensorType(DType.f64, (4, 8, 16)), _t(w)], {"axis": 2})


def test_group_norm_takes_the_same_mix():
    g = torch.Generator().manual_seed(1)
    x, gy = (torch.randn(2, 8, 4, 4, generator=g).bfloat16() for _ in range(2))
    w, b = torch.randn(8, generator=g) * 0.5 + 1, torch.randn(8, generator=g)
    fwd = _module("group_norm", [_t(x), _t(w), _t(b)], {"groups": 2})
    y, mean, rstd = _run(fwd, "torch", [x, w, b])
    assert (y.dtype, mean.dtype, rstd.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    want = torch.nn.functional.group_norm(xr, 2, wr, br)
    want.backward(gy)
    torch.testing.assert_close(y, want.detach(), rtol=0, atol=0)
    bwd = _module("group_norm_grad", [_t(gy), _t(x), _t(mean), _t(rstd), _t(w)], {"groups": 2})
    for got, ref in zip(_run(bwd, "torch", [gy, x, mean, rstd, w]), (xr.grad, wr.grad, br.grad)):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for got, ref in zip(_run(fwd, "numpy", [x, w, b]), (y, mean, rstd)):  # the reference, in f32
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)
