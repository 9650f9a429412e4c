"""The cross-entropy rewrites: ``log_softmax -> nll_loss`` becomes one ``cross_entropy`` (the import
pipeline's ``cross-entropy`` pass), and a bias-free head's matmul and loss become one chunked
``linear_cross_entropy``; anything else stays as it was."""
from __future__ import annotations

import pytest

from remat.ir import Builder, DType, Function, Module, TensorType, verify
from remat.passes.crossentropy import default_chunk, fuse_cross_entropy, fuse_log_softmax_nll
from remat.pipeline import run_pipeline

F32, I64 = DType.f32, DType.i64


def _head(transpose_b: bool = True, extra_use: bool = False, rows3d: bool = True) -> Function:
    """loss = nll_loss(log_softmax(reshape(matmul(x, w)))) for x [2, 3, 4] (or [6, 4]) and 5 classes."""
    xt = TensorType(F32, (2, 3, 4) if rows3d else (6, 4))
    wt = TensorType(F32, (5, 4) if transpose_b else (4, 5))
    f = Function("f", [xt, wt, TensorType(I64, (6,))])
    b = Builder(f.entry)
    x, w, t = f.params
    z = b.op("matmul", x, w, transpose_b=transpose_b)
    if rows3d:
        z = b.op("reshape", z, shape=(6, 5))
    return _finish_with_loss(f, b, z, t, 1, "sum", extra_use)


def _finish_with_loss(f: Function, b: Builder, z, t, axis: int, reduction: str, extra_use: bool) -> Function:
    """``f`` returns nll_loss(log_softmax(z, axis), t) (ignore_index 3); ``extra_use`` adds a second
    reader of the log-probabilities (which keeps them from being fused away)."""
    logp = b.op("log_softmax", z, axis=axis)
    loss = b.op("nll_loss", logp, t, reduction=reduction, ignore_index=3)
    if extra_use:
        loss = b.op("add", loss, b.op("reduce_sum", logp, axes=[0, 1]))
    f.result_types = [loss.type]
    b.ret(loss)
    return f


def _ops(f: Function) -> list[str]:
    return [i.op.name for i in f.entry.instrs]


@pytest.mark.parametrize("rows3d", [True, False])
def test_head_and_loss_become_one_op(rows3d):
    g, sites = fuse_cross_entropy(_head(rows3d=rows3d), chunk=2)
    verify(Module([g]))
    assert [s.rows for s in sites] == [6] and sites[0].vocab == 5 and sites[0].chunk == 2
    ops = _ops(g)
    assert "linear_cross_entropy" in ops and not {"matmul", "log_softmax", "nll_loss"} & set(ops)
    ce = next(i for i in g.entry.instrs if i.op.name == "linear_cross_entropy")
    assert ce.attrs["reduction"] == "sum" and ce.attrs["ignore_index"] == 3 and ce.attrs["chunk"] == 2


@pytest.mark.parametrize("case", [dict(transpose_b=False), dict(extra_use=True)])
def test_other_patterns_are_left_alone(case):
    f = _head(**case)
    g, sites = fuse_cross_entropy(f)
    assert sites == [] and _ops(g) == _ops(f)


def test_registered_as_a_pass():
    out = run_pipeline(Module([_head()]), ["linear-cross-entropy"]).module["f"]
    assert "linear_cross_entropy" in _ops(out)


def test_default_chunk_bounds_the_chunk_logits():
    assert default_chunk(2048, 8000, 4) == 256          # 256 rows x 8000 x 4 B = 7.8 MiB <= 8 MiB
    assert default_chunk(32, 64, 4) == 32               # never more rows than there are
    assert default_chunk(10_000, 250_000, 4) == 16      # a huge vocabulary: the 16-row floor


# ---------------------------------------------------------------- log_softmax -> nll_loss as one cross_entropy
def _pair(axis: int = 1, extra_use: bool = False) -> Function:
    """loss = nll_loss(log_softmax(z, axis), t) for z [6, 5]."""
    f = Function("f", [TensorType(F32, (6, 5)), TensorType(I64, (6,))])
    b = Builder(f.entry)
    z, t = f.params
    return _finish_with_loss(f, b, z, t, axis, "mean", extra_use)


def test_log_softmax_and_nll_loss_become_one_cross_entropy():
    g, n = fuse_log_softmax_nll(_pair())
    verify(Module([g]))
    assert n == 1 and _ops(g) == ["cross_entropy", "return"]
    ce = g.entry.instrs[0]
    assert ce.operands == list(g.params) and ce.attrs["reduction"] == "mean" and ce.attrs["ignore_index"] == 3
    out = run_pipeline(Module([_pair()]), ["cross-entropy"]).module["f"]
    assert _ops(out) == ["cross_entropy", "return"]


@pytest.mark.parametrize("case", [dict(axis=0), dict(extra_use=True)])
def test_log_probabilities_read_elsewhere_or_another_axis_are_left_alone(case):
    f = _pair(**case)
    g, n = fuse_log_softmax_nll(f)
    assert n == 0 and _ops(g) == _ops(f)


def test_the_head_rewrite_also_matches_cross_entropy():
    f, _ = fuse_log_softmax_nll(_head())
    assert "cross_entropy" in _ops(f)
    g, sites = fuse_cross_entropy(f, chunk=2)
    verify(Module([g]))
    assert len(sites) == 1 and sites[0].held == 1
    assert "linear_cross_entropy" in _ops(g) and not {"matmul", "cross_entropy"} & set(_ops(g))
    assert fuse_cross_entropy(_head(), chunk=2)[1][0].held == 3


# ---------------------------------------------------------------- low-precision logits read as they are
BF16 = DType.bf16


def _upcast_loss(dtype: DType = BF16, to: DType = F32, reshaped: bool = False, extra_use: bool = False,
                 reduction: str = "mean") -> Function:
    """cross_entropy(cast(z, to)) of logits z [6, 5] (or [2, 3, 5] cast, then reshaped to rows)."""
    f = Function("f", [TensorType(dtype, (2, 3, 5) if reshaped else (6, 5)), TensorType(I64, (6,))])
    b = Builder(f.entry)
    z, t = f.params
    zf = b.op("cast", z, dtype=to)
    rows = b.op("reshape", zf, shape=(6, 5)) if reshaped else zf
    loss, _ = b.op("cross_entropy", rows, t, reduction=reduction, ignore_index=3)
    if extra_use:
        loss = b.op("add", loss, b.op("reduce_sum", zf, axes=[0, 1] if not reshaped else [0, 1, 2]))
    f.result_types = [loss.type]
    b.ret(loss)
    return f


@pytest.mark.parametrize("reshaped", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cast_logits_fold_into_an_upcast_cross_entropy(reshaped, reduction):
    """The f32 copy of bf16 logits goes: the loss reads them as they are, and gives the same loss,
    bit for bit, on the torch and numpy dialects; its text round-trips."""
    import numpy as np
    import torch

    import remat
    from remat.ir import parse
    from remat.passes.crossentropy import fold_upcast

    f = _upcast_loss(reshaped=reshaped, reduction=reduction)
    g, n = fold_upcast(f)
    verify(Module([g]))
    assert n == 1 and "cast" not in _ops(g)
    ce = next(i for i in g.entry.instrs if i.op.name == "cross_entropy")
    assert ce.attrs["upcast"] and ce.operands[0].type.dtype == BF16 and ce.results[0].type == f.result_types[0]
    assert ce.attrs["reduction"] == reduction and ce.attrs["ignore_index"] == 3
    assert str(parse(str(Module([g])))) == str(Module([g])) and "upcast" in str(g)
    z = torch.randn(f.param_types[0].shape, generator=torch.Generator().manual_seed(0)).mul(4).to(torch.bfloat16)
    t = torch.tensor([0, 3, 4, 1, 2, 3])
    for dialect in ("torch", "numpy"):
        want = remat.run(f, z, t, dialects=(dialect,), outputs="torch")[0][0]
        got = remat.run(g, z, t, dialects=(dialect,), outputs="torch")[0][0]
        assert got.dtype == want.dtype == torch.float32
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("case", [dict(dtype=F32), dict(to=DType.f64), dict(extra_use=True),
                                  dict(reshaped=True, extra_use=True)])
def test_other_casts_into_a_loss_are_left_alone(case):
    """An f32 copy read elsewhere, logits already f32 (a cast from f32), or a cast to f64 stay as they are."""
    from remat.passes.crossentropy import fold_upcast

    f = _upcast_loss(**case) if case.get("to") != DType.f64 else _upcast_loss(dtype=F32, to=DType.f64)
    g, n = fold_upcast(f)
    assert n == 0 and str(g) == str(f)


def test_upcast_needs_low_precision_logits():
    f = Function("f", [TensorType(F32, (6, 5)), TensorType(I64, (6,))])
    b = Builder(f.entry)
    with pytest.raises(TypeError, match="upcast computes bf16 or f16 logits in f32, got f32"):
        b.op("cross_entropy", *f.params, upcast=True)


def test_the_head_rewrite_keeps_an_upcast_loss_in_f32():
    """A bf16 head whose loss upcasts becomes a chunked head with an f32 loss: the same result type."""
    from remat.passes.crossentropy import fold_upcast

    f = Function("f", [TensorType(BF16, (6, 4)), TensorType(BF16, (5, 4)), TensorType(I64, (6,))])
    b = Builder(f.entry)
    x, w, t = f.params
    loss, _ = b.op("cross_entropy", b.op("cast", b.op("matmul", x, w, transpose_b=True), dtype=F32), t)
    f.result_types = [loss.type]
    b.ret(loss)
    g, n = fold_upcast(f)
    assert n == 1
    h, sites = fuse_cross_entropy(g)
    verify(Module([h]))
    assert len(sites) == 1 and _ops(h) == ["linear_cross_entropy", "return"]
    lce = h.entry.instrs[0]
    assert lce.attrs["upcast"] and lce.results[0].type == TensorType(F32, ())


def test_upcast_loss_decomposes_into_f32_primitives():
    """The decomposition of an upcast loss and its gradient converts the logits to f32 first and
    rounds the gradient back: the same dtypes and, here, the same values as the fused ops."""
    import torch

    import remat
    from remat.pipeline import run_pipeline

    f = Function("f", [TensorType(BF16, (6, 5)), TensorType(I64, (6,)), TensorType(F32, ())])
    b = Builder(f.entry)
    z, t, g = f.params
    loss, lse = b.op("cross_entropy", z, t, upcast=True, ignore_index=3)
    dz = b.op("cross_entropy_grad", g, z, lse, t, upcast=True, ignore_index=3)
    f.result_types = [loss.type, dz.type]
    b.ret(loss, dz)
    d = run_pipeline(Module([f]), ["decompose"]).module
    verify(d)
    assert not {"cross_entropy", "cross_entropy_grad"} & set(_ops(d["f"]))
    args = (torch.randn(6, 5, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16),
            torch.tensor([0, 3, 2, 3, 4, 1]), torch.tensor(0.5))
    want = remat.run(f, *args, dialects=("torch",), outputs="torch")[0]
    got = remat.run(d["f"], *args, dialects=("torch",), outputs="torch")[0]
    assert [x.dtype for x in got] == [x.dtype for x in want] == [torch.float32, torch.bfloat16]
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-7)
