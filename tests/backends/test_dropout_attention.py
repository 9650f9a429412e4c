"""Memory-efficient attention with dropout (issue 10) against the explicit form the frontend writes
(scores, softmax, ``bernoulli`` keep mask from a seed, ``select``, matmul): the rewrite
``recognise_dropout_attention`` finds it, ``dropout_attention`` gives the same values and gradients
(f64, tight tolerance) in every dialect with the same keep mask, the VM measures what liveness
predicts and far less than the explicit form, and the torch kernels' temporaries stay within the
declared per-matrix bound."""
from __future__ import annotations

import numpy as np
import pytest

from remat.backends import numpy_kernels as npk
from remat.ir import OPS, Builder, DType, Function, GradientSpec, Module, TensorType, verify
from remat.ir.ops._vjp import const
from remat.ir.ops.attention import workspace_bytes
from remat.passes.attention import recognise_attention, recognise_dropout_attention
from remat.pipeline import run_pipeline
from remat.plan.simulator import predict_peak
from remat.runtime.allocator import kernel_workspace
from remat.runtime.vm import VM

SEED = 1234567


def _explicit(shape, d: int, p: float, *, causal: bool = True, mask: str | None = None,
              dtype: DType = DType.f64) -> Function:
    """``(q, k, v, seed[, mask], w) -> sum(attention_with_dropout(q, k, v) * w)`` written as the frontend
    writes it (``remat.frontend._aten._explicit_attention``)."""
    *batch, t, s = shape
    qt, kt = TensorType(dtype, (*batch, t, d)), TensorType(dtype, (*batch, s, d))
    extra = [TensorType(DType.bool if mask == "bool" else dtype, (t, s))] if mask else []
    f = Function("f", [qt, kt, kt, TensorType(DType.i64, ())] + extra + [TensorType(dtype, (*batch, t, d))])
    b = Builder(f.entry)
    q, k, v, seed = f.params[:4]
    r = len(shape)
    sc = b.op("mul", b.op("matmul", q, b.op("transpose", k, perm=list(range(r - 2)) + [r - 1, r - 2])),
              const(b, 0.5, dtype))
    if causal:
        keep = b.op("ge", b.op("iota", shape=(t, s), axis=0), b.op("iota", shape=(t, s), axis=1))
        sc = b.op("select", keep, sc, const(b, float("-inf"), dtype))
    if mask == "bool":
        sc = b.op("select", f.params[4], sc, const(b, float("-inf"), dtype))
    elif mask == "float":
        sc = b.op("add", sc, f.params[4])
    prob = b.op("softmax", sc, axis=r - 1)
    keep = b.op("bernoulli", b.op("fold_seed", seed, salt=0), shape=tuple(shape), p=1.0 - p)
    prob = b.op("select", keep, b.op("mul", prob, const(b, 1.0 / (1.0 - p), dtype)), const(b, 0.0, dtype))
    out = b.op("mul", b.op("matmul", prob, v), f.params[-1])
    tot = b.op("reduce_sum", out, axes=list(range(r)))
    f.result_types = [tot.type]
    b.ret(tot)
    return f


def _grad(f: Function, wrt=(0, 1, 2)) -> Function:
    m = Module([f, Function("g", gradient=GradientSpec("f", tuple(wrt), True))])
    return run_pipeline(m, "differentiate").module["g"]


def _args(rng, shape, d, mask):
    *batch, t, s = shape
    args = [rng.standard_normal((*batch, t, d)), rng.standard_normal((*batch, s, d)),
            rng.standard_normal((*batch, s, d)), np.array(SEED, dtype=np.int64)]
    if mask == "bool":
        m = rng.random((t, s)) > 0.4
        m[:, 0] = True
        args.append(m)
    elif mask == "float":
        args.append(rng.standard_normal((t, s)))
    return args + [rng.standard_normal((*batch, t, d))]


def _ops(f: Function) -> list[str]:
    return [i.op.name for i in f.entry.instrs]


def test_the_rewrite_finds_attention_with_dropout_and_only_with_it():
    f = _explicit((2, 3, 5, 5), 4, 0.25)
    g, sites = recognise_dropout_attention(f)
    verify(Module([g]))
    assert [s.shape for s in sites] == [(2, 3, 5, 5)] and sites[0].p == pytest.approx(0.25)
    assert sites[0].scores_bytes == 2 * 3 * 5 * 5 * 8
    assert "dropout_attention" in _ops(g) and not {"softmax", "bernoulli", "select"} & set(_ops(g))
    # the import pass (no dropout) leaves it explicit: the default keeps the reference algorithm
    h, n = recognise_attention(f)
    assert n == 0 and _ops(h) == _ops(f)


def test_a_scale_that_is_not_the_dropout_scale_is_left_alone():
    f = _explicit((1, 4, 4), 2, 0.5, causal=False)
    mul = next(i for i in f.entry.instrs if i.op.name == "mul" and i.operands[0].instr.op.name == "softmax")
    c = mul.operands[1].instr
    c.attrs = {**c.attrs, "value": 3.0}  # not 1/(1-p): inverted dropout as no torch module writes it
    g, sites = recognise_dropout_attention(f)
    assert sites == [] and "dropout_attention" not in _ops(g)


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
@pytest.mark.parametrize("shape,mask,causal", [((2, 3, 5, 5), None, True), ((3, 4, 6), "bool", False),
                                                ((2, 2, 4, 5), "float", False), ((3, 3, 5), None, False)],
                         ids=["causal4d", "bool3d", "float4d", "odd3d"])
def test_values_and_gradients_equal_the_explicit_form(shape, mask, causal, dialect):
    rng = np.random.default_rng(len(shape) + (mask or "").__len__())
    d = 3
    f = _explicit(shape, d, 0.3, causal=causal, mask=mask)
    lean, sites = recognise_dropout_attention(f)
    assert len(sites) == 1
    wrt = (0, 1, 2, 4) if mask == "float" else (0, 1, 2)
    args = _args(rng, shape, d, mask)
    outs = {}
    for name, fn in (("explicit", f), ("lean", lean)):
        g = _grad(fn, wrt)
        assert ("dropout_attention_grad" in _ops(g)) == (name == "lean")
        res, _ = VM(Module([g]), dialects=(dialect, "numpy")).run("g", *args, outputs="numpy")
        outs[name] = [np.asarray(r, dtype=np.float64) for r in res]
    assert len(outs["lean"]) == 1 + len(wrt)
    for a, b in zip(outs["lean"], outs["explicit"]):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    # dropout really dropped something, and the lean op drew the explicit form's mask (else the loss differs)
    no_drop, _ = VM(Module([_grad(_explicit(shape, d, 0.0, causal=causal, mask=mask), wrt)]),
                    dialects=("numpy",)).run("g", *args, outputs="numpy")
    assert not np.allclose(np.asarray(no_drop[0]), outs["lean"][0])


def test_the_vm_measures_what_liveness_predicts_and_far_less_than_the_explicit_form():
    shape, d = (2, 4, 32, 32), 4
    rng = np.random.default_rng(7)
    args = _args(rng, shape, d, None)
    f = _explicit(shape, d, 0.2)
    peaks = {}
    for name, fn in (("explicit", f), ("lean", recognise_dropout_attention(f)[0])):
        g = _grad(fn)
        _, st = VM(Module([g]), dialects=("torch", "numpy")).run("g", *args)
        assert st.peak_bytes == predict_peak(g), name
        peaks[name] = st.peak_bytes
    scores = int(np.prod(shape)) * 8
    assert peaks["explicit"] - peaks["lean"] >= 2 * scores  # it holds scores-sized values at once; the op none
    inputs = sum(np.asarray(a).nbytes for a in args)
    assert peaks["lean"] <= inputs + 6 * 2 * 4 * 32 * d * 8  # q, k, v, out, their gradients; no [.., T, S]


@pytest.mark.parametrize("op", ["dropout_attention", "dropout_attention_grad"])
def test_torch_kernel_temporaries_stay_within_the_declared_bound(op):
    """The allocator sees at most one batch element's matrices, far under one whole scores tensor."""
    bh, t, s, d = 16, 64, 64, 8
    f32 = DType.f32
    q, k = TensorType(f32, (bh, t, d)), TensorType(f32, (bh, s, d))
    seed = TensorType(DType.i64, ())
    types = ([q, k, k, seed] if op == "dropout_attention"
             else [q, q, k, k, q, TensorType(f32, (bh, t)), seed])
    f = Function("k", types)
    b = Builder(f.entry)
    ins = b.create(op, list(f.params), OPS[op].check_attrs(types, {"scale": 0.3, "p": 0.1}), dialect="torch")
    b.ret(*ins.results)
    ws = kernel_workspace(ins)
    bound = workspace_bytes(t, s, 4)
    assert ws <= bound, f"{op}: {ws} B of temporaries, declared at most {bound} B"
    assert bound < bh * t * s * 4 / 2


@pytest.mark.parametrize("start,n", [(0, 7), (1, 6), (5, 9), (10, 1), (3, 0)])
def test_a_range_of_the_keep_mask_is_drawn_alone(start, n):
    whole = npk.sample_bernoulli(SEED, (start + n + 3,), 0.6)
    np.testing.assert_array_equal(npk.sample_bernoulli_range(SEED, start, n, 0.6), whole[start:start + n])
