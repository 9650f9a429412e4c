"""The attention kernels beyond the generated samples: the torch dialect's fused flash kernels and
its explicit-math fallback agree with each other and with the numpy reference, over the ranks and
mask forms the flash path reshapes (rank 2-4, bool masks made additive, broadcast masks)."""
from __future__ import annotations

import numpy as np
import pytest

from remat import backends
from remat.backends import torch_kernels as tk
from remat.ir import DType

from test_kernels import as_f64, build, check_contract, run_kernel


def _impls(ins):
    return {impl.fn.__name__: impl for impl in backends.dialects()["torch"].kernels[ins.op.name] if impl.accepts(ins)}


def _case(rng, lead, t, s, d, mask):
    q, k, v = (rng.standard_normal(lead + (n, d)) for n in (t, s, s))
    if mask == "bool":
        m = rng.random((t, s)) > 0.4
        m[:, 0] = True
        return [q, k, v, m]
    if mask == "float":
        return [q, k, v, rng.standard_normal((1,) * len(lead) + (t, s))]
    return [q, k, v]


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)], ids=["rank2", "rank3", "rank4"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_math_and_numpy_agree(lead, mask, causal):
    if causal and mask:
        pytest.skip("a mask or is_causal, not both")
    rng = np.random.default_rng(len(lead) * 7 + (mask or "").__len__() + causal)
    args = _case(rng, lead, 5, 6 if not causal else 5, 4, mask)
    attrs = {"scale": 0.4, "is_causal": causal}
    ins, attrs = build("attention", args, attrs)
    impls = _impls(ins)
    assert set(impls) == {"attention_flash", "attention_math"}
    assert backends.kernel_for(ins, "torch").fn.__name__ == "attention_flash"
    _, ref = run_kernel(ins, attrs, args, "numpy")
    g = rng.standard_normal(ref[0].shape)
    gargs = [g, *args[:3], ref[0], ref[1]] + args[3:]
    gins, gattrs = build("attention_grad", gargs, attrs)
    _, gref = run_kernel(gins, gattrs, gargs, "numpy")
    for name in ("flash", "math"):
        ops = [tk.to_torch(a.copy()) for a in args]
        outs = impls[f"attention_{name}"].fn(*ops, **attrs)
        check_contract(ins, ops, outs, "torch")
        for a, b in zip(outs, ref):
            np.testing.assert_allclose(as_f64(a), b, rtol=1e-10, atol=1e-10, err_msg=f"{name} forward")
        gops = [tk.to_torch(a.copy()) for a in gargs]
        gouts = _impls(gins)[f"attention_grad_{name}"].fn(*gops, **gattrs)
        check_contract(gins, gops, gouts, "torch")
        for a, b in zip(gouts, gref):
            np.testing.assert_allclose(as_f64(a), b, rtol=1e-10, atol=1e-10, err_msg=f"{name} backward")


def test_flash_refuses_different_value_head_size_and_math_takes_it():
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 3))]
    ins, _ = build("attention", args, {"scale": 0.5})
    assert set(_impls(ins)) == {"attention_math"}


def test_low_precision_logsumexp_stays_f32():
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((1, 2, 4, 8)).astype(DType.bf16.numpy) for _ in range(3)]
    ins, attrs = build("attention", args, {"scale": 0.35})
    assert ins.results[1].type.dtype == DType.f32 and ins.results[0].type.dtype == DType.bf16
    for d in ("numpy", "torch"):
        ops, outs = run_kernel(ins, attrs, args, d)
        check_contract(ins, ops, outs, d)


def test_flash_drops_a_mask_that_hides_nothing_and_takes_the_causal_mask_as_is_causal():
    """As eager's SDPA path runs a Hugging Face model: an all-true bool mask (or an additive one of
    zeros) is no mask, an exact causal bool mask is is_causal. The results are the flash kernel's
    without the mask, bit for bit, forward and backward; any other mask is still applied."""
    import torch

    rng = np.random.default_rng(5)
    q, k, v, g = (torch.from_numpy(rng.standard_normal((2, 3, 6, 4)).astype(np.float32)) for _ in range(4))
    fwd, bwd = tk.attention_flash, tk.attention_grad_flash
    plain, plain_lse = fwd(q, k, v, scale=0.5)
    causal, causal_lse = fwd(q, k, v, scale=0.5, is_causal=True)
    tril = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    for mask, want, want_lse, is_causal in ((torch.ones(2, 1, 6, 6, dtype=torch.bool), plain, plain_lse, False),
                                            (torch.zeros(2, 1, 6, 6), plain, plain_lse, False),
                                            (tril, causal, causal_lse, True)):
        assert tk._flash_args(mask, q, k, False)[0] is None
        out, lse = fwd(q, k, v, mask, scale=0.5)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        got = bwd(g, q, k, v, out, lse, mask, scale=0.5)
        ref = bwd(g, q, k, v, want, want_lse, scale=0.5, is_causal=is_causal)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    holes = tril.clone()
    holes[1, 0, 5, 2] = False  # one more masked score: a mask again
    assert tk._flash_args(holes, q, k, False)[0] is not None
    out, _ = fwd(q, k, v, holes, scale=0.5)
    assert torch.equal(out[0], causal[0]) and not torch.equal(out[1], causal[1])


@pytest.mark.parametrize("lead", [(3,), (2, 3)], ids=["rank3", "rank4"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t", [5, tk.FLASH_MIN_LOWP_QUERIES])
def test_low_precision_short_sequences_take_the_explicit_kernels(lead, mask, causal, t):
    """bf16 attention over fewer than FLASH_MIN_LOWP_QUERIES queries runs ``attention_lowp`` (the
    CPU flash kernels are slow there), forward and backward, within bf16 rounding of the f64
    reference, with no f32 copy of q, k, v as its workspace; from that length on, the flash kernels."""
    if causal and mask:
        pytest.skip("a mask or is_causal, not both")
    rng = np.random.default_rng(t + len(lead) * 7 + len(mask or "") + causal)
    args = [a if a.dtype == bool else a.astype(DType.bf16.numpy) for a in _case(rng, lead, t, t, 8, mask)]
    attrs = {"scale": 0.35, "is_causal": causal}
    ins, attrs = build("attention", args, attrs)
    want = "attention_flash" if t >= tk.FLASH_MIN_LOWP_QUERIES else "attention_lowp"
    assert backends.kernel_for(ins, "torch").fn.__name__ == want
    wide = [a if a.dtype == bool else a.astype(np.float64) for a in args]
    wins, wattrs = build("attention", wide, attrs)
    _, ref = run_kernel(wins, wattrs, wide, "numpy")
    ops, outs = run_kernel(ins, attrs, args, "torch")
    check_contract(ins, ops, outs, "torch")
    np.testing.assert_allclose(as_f64(outs[0]), ref[0], rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(as_f64(outs[1]), ref[1], rtol=1e-2, atol=1e-2)
    g = rng.standard_normal(ref[0].shape)
    gargs = [g.astype(DType.bf16.numpy), *args[:3], as_f64(outs[0]).astype(DType.bf16.numpy),
             as_f64(outs[1]).astype(np.float32)] + args[3:]
    gins, gattrs = build("attention_grad", gargs, attrs)
    assert backends.kernel_for(gins, "torch").fn.__name__ == want.replace("attention", "attention_grad")
    wg = [a if a.dtype == bool else a.astype(np.float64) for a in gargs]
    wgins, wgattrs = build("attention_grad", wg, attrs)
    _, gref = run_kernel(wgins, wgattrs, wg, "numpy")
    gops, gouts = run_kernel(gins, gattrs, gargs, "torch")
    check_contract(gins, gops, gouts, "torch")
    for a, b in zip(gouts, gref):
        np.testing.assert_allclose(as_f64(a), b, rtol=5e-2, atol=5e-2 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["heads", "grouped"])
def test_low_precision_seq_first_operands_give_the_heads_first_results(kv_heads):
    """``attention_lowp`` and its backward read ``seq_first`` operands ([B, T, H, D], as Hugging
    Face's models give them) through heads-first views: the same results, bit for bit, as on
    heads-first operands holding the same values (the backward makes each operand heads-first once)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 3, 7, 4, 8

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    q, g = rand(b, t, h, d), rand(b, t, h, d)
    k, v = rand(b, t, kv_heads, d), rand(b, t, kv_heads, d)
    mask = rand(b, h, t, t)
    first = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  [B, H, T, D]
    out, lse = tk.attention_lowp(q, k, v, mask, scale=0.35, seq_first=True)
    out_h, lse_h = tk.attention_lowp(first(q), first(k), first(v), mask, scale=0.35)
    assert torch.equal(first(out), out_h) and torch.equal(lse, lse_h)
    grads = tk.attention_grad_lowp(g, q, k, v, out, lse, mask, scale=0.35, seq_first=True)
    grads_h = tk.attention_grad_lowp(first(g), first(q), first(k), first(v), out_h, lse_h, mask, scale=0.35)
    for x, y in zip(grads, grads_h):
        assert x.is_contiguous() and torch.equal(first(x), y)


def test_low_precision_exponentials_are_never_subnormal():
    """Exponentials that would be subnormal f32 (under 1.2e-38, which ATen's CPU exp computes ~35x
    slower) are 0; others are exp's, NaN and the infinities included. So an additive mask of -100,
    as Swin's shifted windows use, gives the bits of the same mask as bool, forward and backward."""
    import torch

    x = torch.tensor([0.0, -1.0, -86.9, -87.0, -100.0, -104.0, float("-inf"), float("inf"), float("nan")])
    got = tk._exp_normal(x.clone())
    want = torch.exp(x)
    want[3:6] = 0.0
    assert torch.equal(got[:8], want[:8]) and bool(got[8].isnan())
    assert not bool(((got > 0) & (got < torch.finfo(torch.float32).tiny)).any())

    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 4, 16, 2, 8
    q, k, v, g = (torch.randn(b, t, h, d, generator=gen).to(torch.bfloat16) for _ in range(4))
    keep = torch.rand(b, h, t, t, generator=gen) > 0.3
    keep[..., 0] = True
    additive = torch.zeros(b, h, t, t, dtype=torch.bfloat16).masked_fill_(~keep, -100.0)
    runs = []
    for mask in (additive, keep):
        out, lse = tk.attention_lowp(q, k, v, mask, scale=0.35, seq_first=True)
        runs.append((out, lse, *tk.attention_grad_lowp(g, q, k, v, out, lse, mask, scale=0.35, seq_first=True)))
    assert all(torch.equal(a, c) for a, c in zip(*runs))


@pytest.mark.parametrize("mask", [None, "batch", "shared", "additive", "causal"])
@pytest.mark.parametrize("layout", ["heads_first", "seq_first", "grouped"])
def test_attention_over_slices_of_the_batch_gives_the_same_bits(mask, layout):
    """``chunks`` computes the explicit kernels (low precision and the f32 math fallback) over slices
    of the leading axis: the same bits as one call, forward and backward, with slices of unequal
    sizes (7 rows in 2, 3 and 5 slices), a mask sliced with the batch or read whole by every slice,
    and contiguous results."""
    import torch

    gen = torch.Generator().manual_seed(len(mask or "") * 3 + len(layout))
    b, t, h, d = 7, 12, 4, 8
    kv = 2 if layout == "grouped" else h
    if mask == "additive" and layout == "grouped":
        pytest.skip("grouped-query attention takes a bool mask or none")
    seq_first = layout != "heads_first"
    shape = (lambda n: (b, t, n, d)) if seq_first else (lambda n: (b, n, t, d))
    masks = {None: None, "causal": None, "batch": torch.rand(b, 1, t, t, generator=gen) > 0.3,
             "shared": torch.rand(t, t, generator=gen) > 0.3,
             "additive": torch.randn(b, 1, t, t, generator=gen) * 3}
    for dtype, fwd, bwd in ((torch.bfloat16, tk.attention_lowp, tk.attention_grad_lowp),
                            (torch.float32, tk.attention_math, tk.attention_grad_math)):
        q, g = (torch.randn(shape(h), generator=gen).to(dtype) for _ in range(2))
        k, v = (torch.randn(shape(kv), generator=gen).to(dtype) for _ in range(2))
        m = masks[mask] if masks[mask] is None or masks[mask].dtype == torch.bool else masks[mask].to(dtype)
        attrs = dict(scale=0.35, is_causal=mask == "causal", seq_first=seq_first)
        out, lse = fwd(q, k, v, m, **attrs)
        grads = bwd(g, q, k, v, out, lse, m, **attrs)
        for n in (2, 3, 5):
            o_n, lse_n = fwd(q, k, v, m, chunks=n, **attrs)
            assert torch.equal(o_n, out) and torch.equal(lse_n, lse), (dtype, n)
            grads_n = bwd(g, q, k, v, out, lse, m, chunks=n, **attrs)
            assert all(x.is_contiguous() and torch.equal(x, y) for x, y in zip(grads_n, grads)), (dtype, n)
