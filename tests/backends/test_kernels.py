"""Generated per-op kernel tests: every op's ``sample`` generator (from the registry, so a new op
gets its test for free) drives the numpy and torch kernels, which must agree, produce exactly the
IR result type, and honour the buffer contract (fresh contiguous storage, or the aliased operand's)."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from remat import backends
from remat.backends import torch_kernels as tk
from remat.ir import OPS, Builder, DType, Function, TensorType
from remat.ir.ops.optim import HYPER
from remat.ir.reuse import reuses_operand
from remat.runtime.memory import storage_of
from remat.step.optim import hyper_values, updates_from_torch

KERNEL_OPS = sorted(n for n, o in OPS.items() if not o.has("control"))
SAMPLED = [n for n in KERNEL_OPS if OPS[n].sample is not None]


def build(name: str, args: list[np.ndarray], attrs: dict):
    """A one-instruction function for a sample; returns (instruction, normalised attrs)."""
    types = [TensorType(DType.from_numpy(a.dtype), a.shape) for a in args]
    op = OPS[name]
    attrs = op.check_attrs(types, attrs)
    f = Function("f", types, list(op.result_types(types, attrs)))
    ins = Builder(f.entry).create(name, f.params, attrs)
    Builder(f.entry).ret(*ins.results)
    return ins, attrs


def cast_sample(args, dt: DType, name: str = ""):
    """The sample's float arguments in ``dt``, but for operands whose dtype the op fixes (an
    optimizer update's f64 hyperparameters)."""
    fixed = {len(args) - 2} if name in HYPER else set()
    return [a.astype(dt.numpy) if a.dtype.kind == "f" and k not in fixed else a.copy() for k, a in enumerate(args)]


def run_kernel(ins, attrs, args, dialect):
    impl = backends.kernel_for(ins, dialect)
    ops = [a.copy() for a in args] if dialect == "numpy" else [tk.to_torch(a.copy()) for a in args]
    out = impl.fn(*ops, **attrs)
    outs = out if isinstance(out, tuple) else (out,)
    return ops, outs


def check_contract(ins, ops, outs, dialect):
    """Exact IR type; aliased results share the operand's storage, others own fresh contiguous bytes."""
    assert len(outs) == len(ins.results)
    in_keys = {storage_of(o)[0] for o in ops}
    for k, (o, r) in enumerate(zip(outs, ins.results)):
        t = r.type
        if dialect == "numpy":
            assert type(o) is np.ndarray, f"{ins.op.name}: result {k} is {type(o).__name__}, not an ndarray"
            assert o.dtype == t.dtype.numpy and o.shape == t.shape, f"{ins.op.name}: {o.dtype}{o.shape} != {t}"
            contiguous = o.flags.c_contiguous
        else:
            assert isinstance(o, torch.Tensor)
            assert o.dtype == tk.TORCH_DTYPE[t.dtype] and tuple(o.shape) == t.shape, f"{ins.op.name}: {o.dtype}{tuple(o.shape)} != {t}"
            contiguous = o.is_contiguous()
        key, nbytes, _ = storage_of(o)
        if k in ins.op.aliases:
            assert key == storage_of(ops[ins.op.aliases[k]])[0], f"{ins.op.name}: result {k} must alias its operand"
        else:
            assert contiguous, f"{ins.op.name} ({dialect}): result {k} is not contiguous"
            assert nbytes == t.nbytes, f"{ins.op.name} ({dialect}): result {k} owns {nbytes} bytes, type needs {t.nbytes}"
            assert key not in in_keys or t.nbytes == 0, f"{ins.op.name} ({dialect}): result {k} shares an operand's storage"


def as_f64(x):
    x = tk.to_numpy(x) if isinstance(x, torch.Tensor) else x
    return x.astype(np.float64) if x.dtype != np.bool_ else x


TOL = {DType.f64: 1e-10, DType.f32: 2e-5}


def test_every_kernel_op_has_a_sample():
    missing = [n for n in KERNEL_OPS if OPS[n].sample is None]
    assert not missing, f"ops without a sample generator (no generated kernel test): {missing}"


def test_every_op_has_a_numpy_kernel():
    numpy = backends.dialects()["numpy"]
    missing = [n for n in KERNEL_OPS if n not in numpy.kernels]
    assert not missing, f"ops without a reference (numpy) kernel: {missing}"


def test_control_ops_have_no_kernels():
    for d in backends.dialects().values():
        assert not [n for n in d.kernels if OPS[n].has("control")]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # pow samples include negative bases (NaN)
@pytest.mark.parametrize("name", SAMPLED)
@pytest.mark.parametrize("dt", [DType.f64, DType.f32], ids=str)
def test_numpy_and_torch_agree(name, dt):
    rng = np.random.default_rng(sum(map(ord, name)))
    for si, s in enumerate(OPS[name].sample(rng)):
        args = cast_sample(s.args, dt, name)
        ins, attrs = build(name, args, s.attrs)
        ops_np, out_np = run_kernel(ins, attrs, args, "numpy")
        check_contract(ins, ops_np, out_np, "numpy")
        try:
            impl = backends.kernel_for(ins, "torch")
        except backends.NoKernelError:
            continue
        assert impl.dialect == "torch"
        ops_t, out_t = run_kernel(ins, attrs, args, "torch")
        check_contract(ins, ops_t, out_t, "torch")
        for k, (a, b) in enumerate(zip(out_np, out_t)):
            a, b = as_f64(a), as_f64(b)
            if ins.op.has("random"):
                assert np.array_equal(a, b), f"{name}: random samples differ between dialects"
            elif a.dtype == np.bool_ or a.dtype.kind in "iu":
                assert np.array_equal(a, b), f"{name} sample {si} result {k}"
            else:
                tol = TOL[dt] * 10 if name in ("adam_step",) else TOL[dt]
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol, equal_nan=True,
                                           err_msg=f"{name} sample {si} result {k} ({dt})")


BOUND = sorted({(n, d) for n in SAMPLED for d, dl in backends.dialects().items() if dl.available
                for impl in dl.kernels.get(n, ()) if hasattr(impl.fn, "bind")})


def test_layout_kernels_offer_bind():
    """The kernels the VM binds per instruction (``remat.backends.bound``) include the layout wrappers
    of both dialects, so the test below covers them."""
    for op in ("conv2d", "conv2d_grads", "max_pool2d", "batch_norm", "batch_norm_grad"):
        assert (op, "numpy") in BOUND and (op, "torch") in BOUND, op


def test_a_wrapper_copying_attributes_does_not_inherit_bind():
    """``functools.wraps`` copies ``bind`` onto a wrapper; ``bound`` must not use it (it would skip the wrapper)."""
    impl = next(i for i in backends.dialects()["torch"].kernels["conv2d"] if hasattr(i.fn, "bind"))

    @functools.wraps(impl.fn)
    def wrapper(*a, **kw):
        return impl.fn(*a, **kw)

    assert hasattr(wrapper, "bind")
    assert backends.bound(dataclasses.replace(impl, fn=wrapper), {"layout": "NHWC"}) is None
    assert backends.bound(impl, {"layout": "NHWC"}) is not None


@pytest.mark.parametrize("name,dialect", BOUND, ids=[f"{n}-{d}" for n, d in BOUND])
def test_bound_kernel_is_the_kernel(name, dialect):
    """``bound(impl, attrs)(*operands)`` gives bit for bit what ``impl.fn(*operands, **attrs)`` gives,
    honouring the same contract, on every sample (every layout the samples hold)."""
    rng = np.random.default_rng(sum(map(ord, name)))
    for si, s in enumerate(OPS[name].sample(rng)):
        args = cast_sample(s.args, DType.f32, name)
        ins, attrs = build(name, args, s.attrs)
        impl = next((i for i in backends.dialects()[dialect].kernels[name] if i.accepts(ins)), None)
        if impl is None or not hasattr(impl.fn, "bind"):
            continue
        ops, outs = run_kernel(ins, attrs, args, dialect)
        ops_b = [a.copy() for a in args] if dialect == "numpy" else [tk.to_torch(a.copy()) for a in args]
        out_b = backends.bound(impl, dict(attrs))(*ops_b)
        outs_b = out_b if isinstance(out_b, tuple) else (out_b,)
        check_contract(ins, ops_b, outs_b, dialect)
        for k, (a, b) in enumerate(zip(outs, outs_b)):
            assert np.array_equal(as_f64(a), as_f64(b), equal_nan=True), f"{name} ({dialect}) sample {si} result {k}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # pow samples include negative bases (NaN)
@pytest.mark.parametrize("name", [n for n in SAMPLED if not OPS[n].has("random") and n != "fold_seed"])
@pytest.mark.parametrize("dt", [DType.bf16, DType.f16], ids=str)
def test_low_precision_matches_f32_reference(name, dt):
    """f16/bf16 kernels compute in f32 and round once: they match the f32 result rounded, loosely."""
    rng = np.random.default_rng(1 + sum(map(ord, name)))
    tol = {DType.bf16: 4e-2, DType.f16: 4e-3}[dt]
    for s in OPS[name].sample(rng):
        if not any(a.dtype.kind == "f" for a in s.args):
            continue
        lo = cast_sample(s.args, dt, name)
        ins, attrs = build(name, lo, s.attrs)
        ops, outs = run_kernel(ins, attrs, lo, "numpy")
        check_contract(ins, ops, outs, "numpy")
        ref_args = [a.astype(np.float32) if a.dtype == dt.numpy else a for a in lo]
        ins32, attrs32 = build(name, ref_args, s.attrs)
        _, ref = run_kernel(ins32, attrs32, ref_args, "numpy")
        for a, b in zip(outs, ref):
            a, b = as_f64(a), as_f64(b)
            if a.dtype == np.bool_:
                continue  # comparisons of rounded inputs may legitimately flip
            scale = max(1.0, float(np.nanmax(np.abs(b))) if b.size else 1.0)
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale, equal_nan=True, err_msg=name)


MIXED_BN = {"batch_norm": 1, "batch_norm_stats": 1, "batch_norm_grad": 2, "batch_norm_grad_sums": 2}
"""The batch-norm ops that take a half-precision input with float32 per-channel operands (ATen's
mixed-dtype kernel, as ``torch.autocast`` runs them): how many leading operands are activations."""


def mixed_sample(name: str, args, dt: DType) -> list[np.ndarray]:
    """A sample of a batch-norm op in the mixed form: activations in ``dt``, per-channel operands f32."""
    n = MIXED_BN[name]
    return [a.astype(dt.numpy) if k < n else a.astype(np.float32) for k, a in enumerate(args)]


@pytest.mark.parametrize("name", sorted(MIXED_BN))
@pytest.mark.parametrize("dt", [DType.bf16, DType.f16], ids=str)
def test_mixed_dtype_batch_norm_kernels(name, dt):
    """Every sample in the mixed form: the activation results in the input's dtype, the per-channel
    ones (statistics, running statistics, grad_weight, grad_bias) in float32; numpy and torch agree;
    and the torch kernel gives what the one-dtype op gives on a float32 copy of the input, rounded
    (the cast it replaces): y and grad_x bit for bit, the statistics and sums to float32 rounding."""
    rng = np.random.default_rng(2 + sum(map(ord, name)))
    for si, s in enumerate(OPS[name].sample(rng)):
        args = mixed_sample(name, s.args, dt)
        ins, attrs = build(name, args, s.attrs)
        vec_dt = DType.f32 if len(args) > MIXED_BN[name] else dt  # no per-channel operand: all in dt
        for k, r in enumerate(ins.results):
            act = name in ("batch_norm", "batch_norm_grad") and k == 0
            assert r.type.dtype == (dt if act else vec_dt), f"{name} sample {si} result {k}: {r.type}"
        ops_np, out_np = run_kernel(ins, attrs, args, "numpy")
        check_contract(ins, ops_np, out_np, "numpy")
        impl = backends.kernel_for(ins, "torch")
        assert impl.dialect == "torch"
        ops_t, out_t = run_kernel(ins, attrs, args, "torch")
        check_contract(ins, ops_t, out_t, "torch")
        wide = [a.astype(np.float32) for a in args]
        ins32, attrs32 = build(name, wide, s.attrs)
        _, ref = run_kernel(ins32, attrs32, wide, "torch")
        tol = {DType.bf16: 1e-2, DType.f16: 2e-3}[dt]
        for k, (a, b, r) in enumerate(zip(out_np, out_t, ref)):
            a, b, r = as_f64(a), as_f64(b), as_f64(r)
            scale = max(1.0, float(np.abs(r).max()))
            if k == 0 and name in ("batch_norm", "batch_norm_grad"):
                if vec_dt == DType.f32:
                    assert np.array_equal(b, as_f64(tk.to_torch(r.astype(dt.numpy)))), f"{name} sample {si}: y/grad_x"
                np.testing.assert_allclose(b, r, rtol=tol, atol=tol * scale, err_msg=f"{name} sample {si} result {k}")
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale, err_msg=f"{name} sample {si} result {k}")
            else:
                t = 1e-5 if vec_dt == DType.f32 else tol
                np.testing.assert_allclose(b, r, rtol=t, atol=t * scale, err_msg=f"{name} sample {si} result {k}")
                np.testing.assert_allclose(a, b, rtol=t, atol=t * scale, err_msg=f"{name} sample {si} result {k}")


@pytest.mark.parametrize("name", sorted(MIXED_BN))
def test_mixed_dtype_batch_norm_refuses_other_mixes(name):
    """Only a half-precision input may have float32 per-channel operands; they share one dtype."""
    s = OPS[name].sample(np.random.default_rng(0))[0]
    n = MIXED_BN[name]
    f32_f64 = [a.astype(np.float32) if k < n else a.astype(np.float64) for k, a in enumerate(s.args)]
    with pytest.raises(TypeError, match="only an f16/bf16 input"):
        build(name, f32_f64, s.attrs)
    if len(s.args) > n + 1:
        split = [a.astype(np.float32 if k != n else np.float64) if k >= n else a.astype(DType.bf16.numpy)
                 for k, a in enumerate(s.args)]
        with pytest.raises(TypeError, match="share one dtype"):
            build(name, split, s.attrs)


def test_random_ops_are_deterministic_functions_of_the_seed():
    seed = np.array(1234, dtype=np.int64)
    for name, attrs in [("uniform", {"shape": (64,)}), ("normal", {"shape": (64,)}), ("bernoulli", {"shape": (64,), "p": 0.5})]:
        ins, a = build(name, [seed], attrs)
        _, (x1,) = run_kernel(ins, a, [seed], "numpy")
        _, (x2,) = run_kernel(ins, a, [seed], "numpy")
        _, (y,) = run_kernel(ins, a, [np.array(1235, dtype=np.int64)], "numpy")
        assert np.array_equal(x1, x2)
        assert not np.array_equal(x1, y)


def test_random_distribution_parameters():
    seed = np.array(7, dtype=np.int64)
    ins, a = build("uniform", [seed], {"shape": (20000,), "low": -2.0, "high": 3.0, "dtype": DType.f64})
    _, (u,) = run_kernel(ins, a, [seed], "numpy")
    assert u.min() >= -2.0 and u.max() < 3.0 and abs(u.mean() - 0.5) < 0.05
    ins, a = build("normal", [seed], {"shape": (20000,), "mean": 1.0, "std": 3.0, "dtype": DType.f64})
    _, (z,) = run_kernel(ins, a, [seed], "numpy")
    assert abs(z.mean() - 1.0) < 0.1 and abs(z.std() - 3.0) < 0.1
    ins, a = build("bernoulli", [seed], {"shape": (20000,), "p": 0.3})
    _, (m,) = run_kernel(ins, a, [seed], "numpy")
    assert m.dtype == np.bool_ and abs(m.mean() - 0.3) < 0.02


def test_fold_seed_is_a_stable_hash():
    from remat.backends.numpy_kernels import fold_seed_int

    seeds = {fold_seed_int(s, salt) for s in range(20) for salt in range(20)}
    assert len(seeds) == 400  # no collisions on a small grid
    assert all(-(2 ** 63) <= s < 2 ** 63 for s in seeds)
    assert fold_seed_int(5, 3) == fold_seed_int(5, 3) != fold_seed_int(3, 5)


@pytest.mark.parametrize("nesterov,maximize", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("step", [1, 4])
def test_sgd_step_matches_torch_optim(nesterov, maximize, step):
    rng = np.random.default_rng(step)
    p, g, buf = rng.standard_normal((3, 5)), rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    hp = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "nesterov": nesterov, "maximize": maximize}
    tp = torch.tensor(p, requires_grad=True)
    opt = torch.optim.SGD([tp], **hp)
    if step > 1:
        opt.state[tp]["momentum_buffer"] = torch.tensor(buf)
    tp.grad = torch.tensor(g)
    opt.step()
    (u,) = updates_from_torch(opt, [tp])  # the op's operands and attributes from torch's param group
    args = [p, g, buf, np.array(step, dtype=np.int64), hyper_values(u, opt.param_groups[0]), np.array(False)]
    ins, attrs = build("sgd_step", args, u.attrs)
    for d in ("numpy", "torch"):
        _, (np_, nbuf) = run_kernel(ins, attrs, args, d)
        np.testing.assert_allclose(as_f64(np_), tp.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(as_f64(nbuf), opt.state[tp]["momentum_buffer"].numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("step", [1, 3])
def test_adam_step_matches_torch_optim(decoupled, step):
    rng = np.random.default_rng(10 + step)
    p, g = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    m, v = rng.standard_normal((4, 3)) * 0.1, rng.uniform(0, 0.1, (4, 3))
    hp = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    tp = torch.tensor(p, requires_grad=True)
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([tp], **hp)
    if step > 1:
        opt.state[tp].update(step=torch.tensor(float(step - 1)), exp_avg=torch.tensor(m), exp_avg_sq=torch.tensor(v))
        m0, v0 = m, v
    else:
        m0, v0 = np.zeros_like(m), np.zeros_like(v)
    tp.grad = torch.tensor(g)
    opt.step()
    (u,) = updates_from_torch(opt, [tp])
    args = [p, g, m0, v0, np.array(step, dtype=np.int64), hyper_values(u, opt.param_groups[0]), np.array(False)]
    ins, attrs = build("adam_step", args, u.attrs)
    for d in ("numpy", "torch"):
        _, (np_, nm, nv) = run_kernel(ins, attrs, args, d)
        np.testing.assert_allclose(as_f64(np_), tp.detach().numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(as_f64(nm), opt.state[tp]["exp_avg"].numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(as_f64(nv), opt.state[tp]["exp_avg_sq"].numpy(), rtol=1e-10, atol=1e-12)


NO = torch.tensor(False)  # the updates' skip operand: not skipped


def _aten_ops(fn) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def _hyper(op: str, hp: dict) -> tuple[torch.Tensor, dict]:
    """The update op's ``hyper`` operand and its attributes, from keyword hyperparameters."""
    from remat.ir.ops.optim import HYPER

    return (torch.tensor([hp[k] for k in HYPER[op]], dtype=torch.float64),
            {k: v for k, v in hp.items() if k not in HYPER[op]})


@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("variant", ["plain", "decay", "nesterov", "maximize", "dampening"])
def test_fused_sgd_kernel_is_the_single_tensor_update(dt, step, variant):
    """f32/f64 with momentum run ATen's fused kernel (one pass), within an ulp or two of the
    single-tensor update, which other dtypes still run."""
    hp = {"lr": 0.05, "momentum": 0.9, "dampening": 0.1 if variant == "dampening" else 0.0,
          "weight_decay": 0.01 if variant == "decay" else 0.0, "nesterov": variant == "nesterov",
          "maximize": variant == "maximize"}
    g = torch.Generator().manual_seed(step)
    p, grad, buf = (torch.randn(1031, generator=g, dtype=dt) for _ in range(3))
    fused, single = (p.clone(), buf.clone()), (p.clone(), buf.clone())
    s = torch.tensor(step)
    hyper, flags = _hyper("sgd_step", hp)
    assert "aten::_fused_sgd_" in _aten_ops(lambda: tk.sgd_step(fused[0], grad, fused[1], s, hyper, NO, **flags))
    assert "aten::_fused_sgd_" not in _aten_ops(lambda: tk.sgd_single(single[0], grad, single[1], s, **hp))
    eps = torch.finfo(dt).eps
    for a, b in zip(fused, single):
        torch.testing.assert_close(a, b, rtol=4 * eps, atol=4 * eps)
    half = p.to(torch.bfloat16)  # no fused path in low precision: the single-tensor update, exactly
    h1, h2, gh, bh = half.clone(), half.clone(), grad.to(torch.bfloat16), buf.to(torch.bfloat16)
    b1, b2 = bh.clone(), bh.clone()
    tk.sgd_step(h1, gh, b1, s, hyper, NO, **flags)
    tk.sgd_single(h2, gh, b2, s, **hp)
    assert torch.equal(h1, h2) and torch.equal(b1, b2)


@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize("decoupled,weight_decay,maximize", [(False, 0.0, False), (False, 0.1, False),
                                                             (True, 0.1, False), (True, 0.0, True)])
def test_fused_adam_kernel_is_the_single_tensor_update(dt, step, decoupled, weight_decay, maximize):
    hp = {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": weight_decay,
          "decoupled": decoupled, "maximize": maximize}
    g = torch.Generator().manual_seed(step)
    p, grad = torch.randn(1031, generator=g, dtype=dt), torch.randn(1031, generator=g, dtype=dt)
    m, v = torch.randn(1031, generator=g, dtype=dt) * 0.1, torch.rand(1031, generator=g, dtype=dt) * 0.1
    fused, single = (p.clone(), m.clone(), v.clone()), (p.clone(), m.clone(), v.clone())
    s = torch.tensor(step)
    name = "aten::_fused_adamw_" if decoupled else "aten::_fused_adam_"
    hyper, flags = _hyper("adam_step", hp)
    assert name in _aten_ops(lambda: tk.adam_step(*fused[:1], grad, *fused[1:], s, hyper, NO, **flags))
    tk.adam_single(*single[:1], grad, *single[1:], s, **hp)
    assert int(s) == step  # the step count is read, not advanced
    eps = torch.finfo(dt).eps
    for a, b in zip(fused, single):
        torch.testing.assert_close(a, b, rtol=16 * eps, atol=16 * eps)


def test_max_pool_grad_ties_go_to_first_maximum_in_both_dialects():
    x = np.zeros((1, 1, 4, 4))  # every window is a tie
    gy = np.arange(4.0).reshape(1, 1, 2, 2) + 1
    ins, attrs = build("max_pool2d_grad", [x, gy], {"kernel": (2, 2)})
    want = np.zeros((1, 1, 4, 4))
    want[0, 0, ::2, ::2] = gy[0, 0]
    for d in ("numpy", "torch"):
        _, (gx,) = run_kernel(ins, attrs, [x, gy], d)
        np.testing.assert_array_equal(as_f64(gx), want)


def test_avg_pool_counts_padding_as_zeros():
    x = np.ones((1, 1, 2, 2))
    ins, attrs = build("avg_pool2d", [x], {"kernel": (2, 2), "stride": (1, 1), "padding": (1, 1)})
    for d in ("numpy", "torch"):
        _, (y,) = run_kernel(ins, attrs, [x], d)
        np.testing.assert_allclose(as_f64(y)[0, 0], [[0.25, 0.5, 0.25], [0.5, 1.0, 0.5], [0.25, 0.5, 0.25]])


def test_rank0_results_are_arrays_not_scalars():
    x = np.array(0.5)
    for name in ("exp", "neg", "sigmoid"):
        ins, attrs = build(name, [x], {})
        _, (y,) = run_kernel(ins, attrs, [x], "numpy")
        assert type(y) is np.ndarray and y.shape == ()
    ins, attrs = build("reduce_sum", [np.ones((3,))], {"axes": (0,)})
    _, (y,) = run_kernel(ins, attrs, [np.ones((3,))], "numpy")
    assert type(y) is np.ndarray and y.shape == () and y == 3.0


def test_reductions_with_empty_axes_copy():
    x = np.arange(6.0).reshape(2, 3)
    for name in ("reduce_sum", "reduce_max", "reduce_mean"):
        ins, attrs = build(name, [x], {"axes": ()})
        for d in ("numpy", "torch"):
            ops, outs = run_kernel(ins, attrs, [x], d)
            check_contract(ins, ops, outs, d)
            np.testing.assert_array_equal(as_f64(outs[0]), x)


def test_integer_division_floors_in_both_dialects():
    a, b = np.array([7, -7, 7, -7], dtype=np.int64), np.array([2, 2, -2, -2], dtype=np.int64)
    ins, attrs = build("div", [a, b], {})
    for d in ("numpy", "torch"):
        _, (y,) = run_kernel(ins, attrs, [a, b], d)
        np.testing.assert_array_equal(as_f64(y), [3, -4, -4, 3])


REUSING = [n for n in SAMPLED if reuses_operand(n)]


def test_torch_kernels_of_reusing_ops_write_in_place():
    """Every torch kernel of an op whose result may take a dying operand's buffer (remat.ir.reuse)
    has an out-variant: the torch dialect never takes the copying fallback (a transient result).
    ``fused`` is the exception: in torch it interprets its body node by node (intermediates are
    allocated anyway); its generated kernel is numba's, which has one."""
    torch_ = backends.dialects()["torch"]
    missing = [n for n in REUSING if n in torch_.kernels and n != "fused" and not backends.has_out_variant(n, "torch")]
    assert backends.has_out_variant("fused", "numba")
    assert not missing, f"torch kernels without an out-variant: {missing}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # pow samples include negative bases (NaN)
@pytest.mark.parametrize("name", REUSING)
@pytest.mark.parametrize("dt", [DType.f64, DType.f32], ids=str)
def test_inplace_kernels_give_the_out_of_place_bits(name, dt):
    """Written over each operand of the result's type, in every dialect that runs the op: the same
    bits as the out-of-place kernel, in that operand's storage, the other operands untouched."""
    rng = np.random.default_rng(sum(map(ord, name)) + 1)
    tried = 0
    for si, s in enumerate(OPS[name].sample(rng)):
        args = cast_sample(s.args, dt, name)
        ins, attrs = build(name, args, s.attrs)
        for dialect in ("numpy", "torch", "numba"):
            try:
                impl = backends.kernel_for(ins, dialect)
            except (backends.NoKernelError, KeyError):
                continue
            conv = (lambda a: a.copy()) if dialect != "torch" else (lambda a: tk.to_torch(a.copy()))
            ref = impl.fn(*[conv(a) for a in args], **attrs)
            ref = ref[0] if isinstance(ref, tuple) else ref
            for j, v in enumerate(ins.operands):
                if v.type != ins.results[0].type:
                    continue
                ops = [conv(a) for a in args]
                out = backends.inplace(impl, j)(*ops, **attrs)
                out = out[0] if isinstance(out, tuple) else out
                assert storage_of(out)[0] == storage_of(ops[j])[0], f"{name} ({dialect}): not written over operand {j}"
                a, b = as_f64(ref), as_f64(out)
                assert np.array_equal(a, b, equal_nan=a.dtype != np.bool_), f"{name} ({dialect}) sample {si} over operand {j}"
                for i, (x, y) in enumerate(zip(args, ops)):
                    if i != j and storage_of(y)[0] != storage_of(ops[j])[0]:
                        assert np.array_equal(as_f64(x), as_f64(y), equal_nan=True), f"{name}: operand {i} changed"
                tried += 1
    if not tried:
        pytest.skip(f"no sample of {name} has an operand of its result's type")


@pytest.mark.parametrize("dt", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["sgd_step", "adam_step"])
def test_a_skipped_update_changes_nothing(dt, op):
    """skip true (the step's loss or a gradient was not finite): parameter, state and the step count
    stay bit-identical, in the fused kernels (found_inf) and the single-tensor ones (bf16)."""
    g = torch.Generator().manual_seed(3)
    p, grad, m, v = (torch.randn(257, generator=g).to(dt) for _ in range(4))
    grad[5] = float("nan")
    grad[9] = float("inf")
    s = torch.tensor(2)
    before = [t.clone() for t in (p, m, v, s)]
    if op == "sgd_step":
        hyper, flags = _hyper(op, {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01,
                                   "nesterov": False, "maximize": False})
        tk.sgd_step(p, grad, m, s, hyper, torch.tensor(True), **flags)
    else:
        hyper, flags = _hyper(op, {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1,
                                   "decoupled": True, "maximize": False})
        tk.adam_step(p, grad, m, v, s, hyper, torch.tensor(True), **flags)
    for a, b in zip((p, m, v, s), before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_nonfinite_finds_nan_and_inf_and_nothing_else(dt):
    big = torch.full((3, 4), torch.finfo(dt).max, dtype=dt)  # finite, however large
    assert not bool(tk.nonfinite(big, torch.zeros(0, dtype=dt), torch.tensor(-0.0, dtype=dt)))
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = big.clone()
        x[2, 1] = bad
        assert bool(tk.nonfinite(torch.ones(2, dtype=dt), x))


@pytest.mark.parametrize("axis", [0, 1])
def test_index_put_with_repeated_indices_keeps_the_last_in_every_dialect(axis):
    """ATen leaves which of repeated indices wins unspecified; remat's dialects agree on the last,
    so a recomputed ``index_put`` writes what the first computation wrote."""
    x = np.zeros((6, 6))
    idx = np.array([[1, 3], [1, 1]])
    upd = np.arange(24.0).reshape((2, 2, 6) if axis == 0 else (6, 2, 2))
    ins, attrs = build("index_put", [x, idx, upd], {"axis": axis})
    outs = [as_f64(run_kernel(ins, attrs, [x, idx, upd], d)[1][0]) for d in ("numpy", "torch")]
    np.testing.assert_array_equal(outs[0], outs[1])
    want = upd[1, 1] if axis == 0 else upd[:, 1, 1]
    np.testing.assert_array_equal(np.take(outs[0], 1, axis=axis), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_upcast_cross_entropy_is_the_loss_of_the_f32_logits_bit_for_bit(dtype, reduction):
    """``cross_entropy {upcast}`` of low-precision logits (rows in several chunks) gives the loss,
    logsumexp and gradient of the logits converted to f32, the gradient rounded as a cast rounds it;
    on both dialects, the gradient also written over the logits."""
    import ml_dtypes

    from remat.backends import numpy_kernels as npk

    n, c = 300, 4000  # 131 rows a chunk: three chunks, the last partial
    gen = torch.Generator().manual_seed(1)
    z = (torch.randn(n, c, generator=gen) * 3).to(dtype)
    t = torch.randint(0, c, (n,), generator=gen)
    t[::7] = -100
    kw = dict(reduction=reduction, ignore_index=-100)
    loss, lse = tk.cross_entropy(z, t, upcast=True, **kw)
    want_loss, want_lse = tk.cross_entropy(z.float(), t, **kw)
    assert loss.dtype == lse.dtype == torch.float32
    assert torch.equal(loss, want_loss) and torch.equal(lse, want_lse)
    g = torch.rand(n if reduction == "none" else (), generator=gen)
    want = tk.cross_entropy_grad(g, z.float(), want_lse, t, **kw).to(dtype)
    got = tk.cross_entropy_grad(g, z, lse, t, upcast=True, **kw)
    assert got.dtype == dtype and torch.equal(got, want)
    over = z.clone()
    assert torch.equal(tk.cross_entropy_grad_out(over, g, over, lse, t, upcast=True, **kw), want)
    nz = z[:40].float().numpy().astype(ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float16)
    nl, nlse = npk.cross_entropy(nz, t[:40].numpy(), upcast=True, **kw)
    wl, wlse = npk.cross_entropy(nz.astype(np.float32), t[:40].numpy(), **kw)
    assert nl.dtype == nlse.dtype == np.float32
    np.testing.assert_array_equal(nl, wl)
    np.testing.assert_array_equal(nlse, wlse)


def test_low_precision_cross_entropy_keeps_one_f32_chunk_and_handles_infinite_rows():
    """The low-precision loss computes each chunk's logsumexp as ATen does on its f32 conversion,
    infinite rows included, with one f32 chunk as its only large temporary."""
    from remat.backends import torch_kernels as tk

    c = 3000
    rows = tk._ce_chunk(c)
    z = (torch.randn(2 * rows + 3, c, generator=torch.Generator().manual_seed(2)) * 5).to(torch.bfloat16)
    z[1, 7] = float("inf")
    z[rows + 1] = float("-inf")
    t = torch.zeros(z.shape[0], dtype=torch.int64)
    _, lse = tk.cross_entropy(z, t, reduction="none", upcast=True)
    torch.testing.assert_close(lse, torch.logsumexp(z.float(), dim=1), rtol=0, atol=0, equal_nan=True)
    from remat.runtime.allocator import kernel_workspace

    f = Function("f", [TensorType(DType.bf16, tuple(z.shape)), TensorType(DType.i64, (z.shape[0],))])
    loss, lse = Builder(f.entry).op("cross_entropy", *f.params, upcast=True)
    grad = Builder(f.entry).op("cross_entropy_grad", Builder(f.entry).op("constant", value=1.0), f.params[0], lse,
                               f.params[1], upcast=True)
    chunk = rows * c * 4
    for ins in (loss.instr, grad.instr):  # one f32 chunk, and row vectors
        assert chunk <= kernel_workspace(ins, ("torch",)) <= chunk + 64 * z.shape[0]
