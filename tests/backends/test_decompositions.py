"""Generated per-op tests of the decompositions (from the registry: an op that declares one gets its
test for free): the decomposed program verifies, holds no composite any more, and gives the op's own
values (reference kernels, f64). Then the decompositions in use: a dialect without kernels for the
composites runs programs, DSL functions and a compiled training step through them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import remat
from remat import backends
from remat.ir import OPS, Builder, DType, Function, Module, TensorType, verify
from remat.passes.dce import dce
from remat.passes.decompose import decompose, decompose_unclaimed
from remat.pipeline import get_pass
from remat.runtime.vm import VM

DECOMPOSED = sorted(n for n, o in OPS.items() if o.decompose is not None)

# The composites with native kernels whose decompositions are promised (a dropped one fails here).
COMPOSITES = {"linear", "softmax", "log_softmax", "softmax_grad", "log_softmax_grad", "gelu", "gelu_grad",
              "silu", "silu_grad", "relu_grad", "nll_loss", "nll_loss_grad", "layer_norm", "layer_norm_grad", "batch_norm",
              "batch_norm_grad", "attention", "attention_grad", "max_pool2d", "max_pool2d_grad",
              "max_pool2d_with_indices", "max_pool2d_index_grad", "avg_pool2d", "avg_pool2d_grad", "fused"}


def one_op(name: str, args: list[np.ndarray], attrs: dict) -> Module:
    """A module whose function ``f`` applies ``name`` once to its parameters and returns every result."""
    return op_module(name, [TensorType(DType.from_numpy(a.dtype), a.shape) for a in args], attrs)


def op_module(name: str, types: list[TensorType], attrs: dict) -> Module:
    """``one_op`` on parameters of ``types``."""
    op = OPS[name]
    attrs = op.check_attrs(types, attrs)
    f = Function("f", types, list(op.result_types(types, attrs)))
    ins = Builder(f.entry).create(name, f.params, attrs)
    Builder(f.entry).ret(*ins.results)
    return Module([f])


def _count(m: Module) -> int:
    return sum(1 for _ in m["f"].instructions())


def test_the_composites_declare_their_decompositions():
    assert COMPOSITES <= set(DECOMPOSED), f"composites without a decomposition: {sorted(COMPOSITES - set(DECOMPOSED))}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", DECOMPOSED)
def test_decomposition_matches_the_op(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    for si, s in enumerate(OPS[name].sample(rng)):
        m = one_op(name, s.args, s.attrs)
        d = decompose(m)
        verify(d)
        assert _count(dce(d)) == _count(d), f"{name}: its decomposition emits dead instructions"
        left = sorted({i.op.name for i in d["f"].instructions() if i.op.decompose is not None})
        assert not left, f"{name}: composites left after decomposing: {left}"
        want, _ = VM(m, dialects="numpy").run("f", *[a.copy() for a in s.args])
        got, _ = VM(d, dialects="numpy").run("f", *[a.copy() for a in s.args])
        assert len(got) == len(want)
        for k, (a, b) in enumerate(zip(want, got)):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{name} sample {si} result {k}"
            if a.dtype.kind in "biu":
                assert np.array_equal(a, b), f"{name} sample {si} result {k}"
            else:
                np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12, equal_nan=True,
                                           err_msg=f"{name} sample {si} result {k}")


MIXED_BN = {"batch_norm": 1, "batch_norm_stats": 1, "batch_norm_grad": 2}


@pytest.mark.parametrize("name", sorted(MIXED_BN))
def test_mixed_dtype_batch_norm_decomposes_in_float32(name):
    """The mixed form (bf16 activations, f32 per-channel operands) decomposes into primitives that
    normalise a float32 copy of the input, each result in the op's dtype, its values the op's."""
    rng = np.random.default_rng(sum(map(ord, name)))
    n = MIXED_BN[name]
    for si, s in enumerate(OPS[name].sample(rng)):
        if len(s.args) <= n:
            continue
        args = [a.astype(DType.bf16.numpy if k < n else np.float32) for k, a in enumerate(s.args)]
        m = one_op(name, args, s.attrs)
        d = decompose(m)
        verify(d)
        assert not [i for i in d["f"].instructions() if i.op.decompose is not None]
        want, _ = VM(m, dialects="numpy").run("f", *[a.copy() for a in args])
        got, _ = VM(d, dialects="numpy").run("f", *[a.copy() for a in args])
        for k, (a, b) in enumerate(zip(want, got)):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{name} sample {si} result {k}"
            a, b = a.astype(np.float64), b.astype(np.float64)
            tol = 1e-2 if k == 0 and name != "batch_norm_stats" else 1e-4
            np.testing.assert_allclose(b, a, rtol=tol, atol=tol * max(1.0, float(np.abs(a).max())),
                                       err_msg=f"{name} sample {si} result {k}")


def test_decompose_keeps_source_locations_and_other_ops():
    from remat.ir import Loc

    m = one_op("linear", [np.ones((2, 3)), np.ones((4, 3)), np.ones(4)], {})
    ins = m["f"].entry.instrs[0]
    ins.loc = Loc("model.py", 7, "fc1")
    d = decompose(m, ops={"softmax"})  # only softmax: the linear stays
    assert [i.op.name for i in d["f"].instructions()] == ["linear", "return"]
    d = get_pass("decompose")(m)
    body = [i for i in d["f"].instructions() if i.op.name != "return"]
    assert [i.op.name for i in body] == ["matmul", "add"]
    assert all(i.loc == ins.loc for i in body)
    assert str(m["f"].entry.instrs[0].op.name) == "linear"  # the pass is pure


def test_decomposed_nll_loss_checks_its_targets():
    m = decompose(one_op("nll_loss", [np.log(np.full((3, 4), 0.25)), np.array([0, 4, 1])], {}))
    with pytest.raises(IndexError, match="out of range"):
        VM(m, dialects="numpy").run("f", np.log(np.full((3, 4), 0.25)), np.array([0, 4, 1]))


# ---------------------------------------------------------------- a dialect without the composites
@pytest.fixture
def torch_without_composites(monkeypatch):
    """The torch dialect with its kernels for every composite op removed (restored after the test)."""
    kernels = backends.dialects()["torch"].kernels
    for name in DECOMPOSED:
        if name in kernels:
            monkeypatch.delitem(kernels, name)
    return ("torch",)


def test_unclaimed_composites_are_expanded(torch_without_composites):
    m = one_op("layer_norm", [np.ones((2, 3))], {"axis": 1})
    with pytest.raises(backends.NoKernelError, match="has a decomposition"):
        VM(m, dialects=torch_without_composites)
    d = decompose_unclaimed(m, torch_without_composites)
    assert "layer_norm" not in {i.op.name for i in d["f"].instructions()}
    assert decompose_unclaimed(m, ("numpy",)) is m  # the reference dialect claims every op
    x = np.random.default_rng(0).normal(size=(2, 3))
    got, _ = VM(d, dialects=torch_without_composites).run("f", x)
    want, _ = VM(m, dialects="numpy").run("f", x)
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


def test_dsl_function_runs_on_a_dialect_without_the_composite(torch_without_composites):
    @remat.function
    def f(x: remat.f64[4, 5]):
        return remat.ops.softmax(x, axis=1)

    x = np.random.default_rng(1).normal(size=(4, 5))
    got, _ = f.run(x, dialects=torch_without_composites)
    want, _ = f.run(x, dialects=("numpy",))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12)


def test_training_step_on_a_dialect_without_the_composites(torch_without_composites):
    """remat.compile plans and runs the decomposed step; loss and updates match the native step."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                                   torch.nn.Linear(8, 3)).double()

    x, y = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])
    losses, params = [], []
    for dialects in (torch_without_composites, None):
        model = make()
        step = remat.compile(model, (x, y), torch.nn.functional.cross_entropy,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dialects=dialects)
        ops = {i.op.name for i in step.program.instructions()}
        if dialects is not None:
            assert not ops & set(DECOMPOSED), sorted(ops & set(DECOMPOSED))
        losses.append(float(step(x, y)))
        assert step.last_stats.peak_bytes == step.predicted_peak
        params.append([p.detach().clone() for p in model.parameters()])
    assert abs(losses[0] - losses[1]) < 1e-12
    for a, b in zip(*params):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
