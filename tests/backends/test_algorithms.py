"""Memory-lean alternative algorithms against their reference (issue 10): the chunked
``linear_cross_entropy`` gives the values and gradients of ``matmul -> log_softmax -> nll_loss``
(f64, tight tolerance) in every dialect, for every registry sample; its memory is what the VM
measures (IR values) plus kernel temporaries within its declared bound, far below the reference's."""
from __future__ import annotations

import numpy as np
import pytest

from remat.ir import OPS, Builder, DType, Function, GradientSpec, Module, TensorType
from remat.ir.ops.crossentropy import workspace_bytes
from remat.pipeline import run_pipeline
from remat.plan.simulator import predict_peak
from remat.runtime.allocator import kernel_workspace
from remat.runtime.vm import VM

SAMPLES = OPS["linear_cross_entropy"].sample(np.random.default_rng(0))


def _ttype(a) -> TensorType:
    return TensorType(DType.from_numpy(np.asarray(a).dtype), np.asarray(a).shape)


def _loss_and_grads(args, attrs, lean: bool) -> Function:
    """``(x, w, target, v) -> (sum(loss * v), dx, dw)`` straight-line, with the lean op or the reference."""
    x, w, t = args
    v = np.ones(()) if attrs.get("reduction", "mean") != "none" else np.ones(x.shape[0])
    f = Function("f", [_ttype(a) for a in (x, w, t, v)])
    b = Builder(f.entry)
    px, pw, pt, pv = f.params
    nll = {k: attrs[k] for k in ("reduction", "ignore_index") if k in attrs}
    if lean:
        loss, _ = b.op("linear_cross_entropy", px, pw, pt, **attrs)
    else:
        logp = b.op("log_softmax", b.op("matmul", px, pw, transpose_b=True), axis=1)
        loss = b.op("nll_loss", logp, pt, **nll)
    out = b.op("mul", loss, pv)
    if out.type.rank:
        out = b.op("reduce_sum", out, axes=[0])
    f.result_types = [out.type]
    b.ret(out)
    m = Module([f, Function("g", gradient=GradientSpec("f", (0, 1), True))])
    return run_pipeline(m, "differentiate").module["g"]


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
@pytest.mark.parametrize("k", range(len(SAMPLES)))
def test_linear_cross_entropy_equals_the_reference(k, dialect):
    s = SAMPLES[k]
    rng = np.random.default_rng(k)
    v = rng.standard_normal(() if s.attrs.get("reduction", "mean") != "none" else s.args[0].shape[0])
    outs = {}
    for lean in (True, False):
        g = _loss_and_grads(s.args, s.attrs, lean)
        res, _ = VM(Module([g]), dialects=(dialect, "numpy")).run("g", *s.args, v, outputs="numpy")
        outs[lean] = [np.asarray(r, dtype=np.float64) for r in res]
    assert len(outs[True]) == 3  # loss, dx, dw
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


def test_vm_measures_the_declared_memory_and_less_than_the_reference():
    """Predicted == measured peak for both algorithms; the lean one holds no [N, V] tensor."""
    rng = np.random.default_rng(3)
    n, d, v = 96, 8, 300
    args = [rng.standard_normal((n, d)), rng.standard_normal((v, d)), rng.integers(0, v, n)]
    attrs = {"chunk": 16}
    peaks = {}
    for lean in (True, False):
        g = _loss_and_grads(args, attrs, lean)
        _, st = VM(Module([g]), dialects=("torch", "numpy")).run("g", *args, np.ones(()))
        assert st.peak_bytes == predict_peak(g)
        peaks[lean] = st.peak_bytes
    logits = n * v * 8
    assert peaks[False] - peaks[True] >= 2 * logits  # the reference holds at least two [N, V] at once
    inputs = sum(np.asarray(a).nbytes for a in args) + 8
    results = 8 + n * d * 8 + v * d * 8  # loss, dx, dw (the lean step's only large values)
    assert peaks[True] <= inputs + results + n * 8 * 4  # plus the [N] logsumexp and scalars


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_cross_entropy_grad"])
def test_torch_kernel_temporaries_stay_within_the_declared_bound(op):
    """The allocator sees at most the declared chunk workspace, well under one [N, V] logits tensor."""
    n, d, v, chunk = 1024, 16, 2000, 64
    f32 = DType.f32
    x, w, t = TensorType(f32, (n, d)), TensorType(f32, (v, d)), TensorType(DType.i64, (n,))
    types = [x, w, t] if op == "linear_cross_entropy" else [TensorType(f32, ()), x, w, t, TensorType(f32, (n,))]
    f = Function("k", types)
    b = Builder(f.entry)
    ins = b.create(op, list(f.params), OPS[op].check_attrs(types, {"chunk": chunk}), dialect="torch")
    b.ret(*ins.results)
    ws = kernel_workspace(ins)
    bound = workspace_bytes(n, v, 4, chunk)
    assert ws <= bound, f"{op}: {ws} B of temporaries, declared at most {bound} B"
    assert bound < n * v * 4 / 4


@pytest.mark.parametrize("op", ["conv_bn_relu_pool", "conv_bn_relu_pool_grad"])
def test_tiled_stem_temporaries_are_a_few_tiles(op):
    """conv_bn_relu_pool's kernels hold one tile's full-resolution temporaries, not the batch's: the
    allocator sees well under one full-resolution activation beyond their results."""
    n, tile = 64, 2
    f32 = DType.f32
    x, w, vec = TensorType(f32, (n, 3, 32, 32)), TensorType(f32, (16, 3, 3, 3)), TensorType(f32, (16,))
    attrs = {"padding": (1, 1), "pool_kernel": (3, 3), "pool_stride": (2, 2), "pool_padding": (1, 1), "tile": tile,
             "input_grad": False}
    gy = TensorType(f32, (n, 16, 16, 16))
    types = [x, w, vec, vec] if op == "conv_bn_relu_pool" else [x, gy, w, vec, vec, vec, vec, vec, vec]
    f = Function("k", types)
    b = Builder(f.entry)
    ins = b.create(op, list(f.params), OPS[op].check_attrs(types, attrs), dialect="torch")
    b.ret(*ins.results)
    activation = n * 16 * 32 * 32 * 4
    ws = kernel_workspace(ins)
    assert 0 < ws <= 8 * activation * tile // n, f"{op}: {ws} B of temporaries, one activation is {activation} B"


@pytest.mark.parametrize("upcast", [True, False])
def test_low_precision_head_computes_its_logits_in_bf16_and_its_loss_in_f32(upcast):
    """A bf16 chunked head gives what the reference head gives under autocast (bf16 product, the loss
    in f32 from it; the logits' gradient rounded to bf16): loss and dx as the reference's to f32
    rounding, dw (summed chunk by chunk in f32) to bf16 rounding; its temporaries within the bound."""
    import torch

    from remat.backends import torch_kernels as tk

    n, d, v, chunk = 300, 32, 700, 64
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=gen).to(torch.bfloat16)
    w = (torch.randn(v, d, generator=gen) * 0.3).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=gen)
    t[::5] = -100
    loss, lse = tk.linear_cross_entropy(x, w, t, chunk=chunk, upcast=upcast)
    assert loss.dtype == lse.dtype == (torch.float32 if upcast else torch.bfloat16)
    z = (x @ w.t()).float().requires_grad_()
    want = torch.nn.functional.cross_entropy(z, t)
    torch.testing.assert_close(loss.float(), want.detach(), rtol=1e-5 if upcast else 1e-2, atol=0)
    want.backward()
    gz = z.grad.to(torch.bfloat16)
    dx, dw = tk.linear_cross_entropy_grad(torch.ones((), dtype=loss.dtype), x, w, t, lse, chunk=chunk, upcast=upcast)
    assert dx.dtype == dw.dtype == torch.bfloat16
    for got, ref in ((dx, gz @ w), (dw, gz.float().t() @ x.float())):
        assert float((got.double() - ref.double()).norm() / ref.double().norm()) < 1e-2
    f = Function("k", [TensorType(DType.bf16, (n, d)), TensorType(DType.bf16, (v, d)), TensorType(DType.i64, (n,))])
    b = Builder(f.entry)
    ins = b.create("linear_cross_entropy", list(f.params),
                   OPS["linear_cross_entropy"].check_attrs([p.type for p in f.params], {"chunk": chunk, "upcast": upcast}),
                   dialect="torch")
    b.ret(*ins.results)
    assert kernel_workspace(ins) <= workspace_bytes(n, v, 2, chunk, d)
