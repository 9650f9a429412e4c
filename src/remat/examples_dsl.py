"""``python -m remat.examples_dsl``: the foundation (DSL → IR → VM) end to end in a few seconds.

Stages small models written in the Python DSL into IR, prints the IR, runs each on both
dialects (NumPy and PyTorch), checks that they agree, and compares the VM's measured peak
memory with the static prediction from liveness analysis; differentiates one, also in mixed
precision (``remat.autocast``).
"""
from __future__ import annotations

import time

import numpy as np

import remat
from remat.errors import format_bytes
from remat.frontend.dsl import Staged, ops

BATCH, FEATURES, HIDDEN, CLASSES = 32, 64, 128, 10


@remat.function
def mlp(x: remat.f32[BATCH, FEATURES], w1: remat.f32[FEATURES, HIDDEN], b1: remat.f32[HIDDEN],
        w2: remat.f32[HIDDEN, CLASSES], b2: remat.f32[CLASSES]):
    """A 2-layer perceptron: class probabilities for a batch."""
    h = (x @ w1 + b1).relu()
    return ops.softmax(h @ w2 + b2, axis=1)


@remat.function
def conv_block(x, w, b):
    """conv 3x3 -> relu -> 2x2 max-pool; parameter types come from the first call."""
    return ops.max_pool2d(ops.conv2d(x, w, b, padding=1).relu(), 2)


@remat.function
def tiny_cnn(x: remat.f32[8, 3, 16, 16], w1: remat.f32[8, 3, 3, 3], b1: remat.f32[8],
             w2: remat.f32[8 * 8 * 8, CLASSES], labels: remat.i64[8]):
    """A conv block (a staged call) and a linear classifier; returns the mean cross-entropy."""
    h = conv_block(x, w1, b1).reshape(8, -1)
    logp = ops.log_softmax(h @ w2, axis=1)
    return -(logp * ops.one_hot(labels, CLASSES)).sum(axis=1).mean()


def _section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 72 - len(title)))


def _predicted_peak(fn: Staged) -> int | None:
    try:
        from remat.plan.simulator import predict_peak
    except ImportError:
        return None
    try:
        return predict_peak(fn.__remat_function__())
    except NotImplementedError:  # branching code: the peak depends on the path taken
        return None


def _run_both(fn: Staged, args: list[np.ndarray], rtol: float) -> tuple[int, bool]:
    """Run on each dialect, print the peak, check agreement; returns (measured peak bytes, agree)."""
    results = {}
    for dialect in ("numpy", "torch"):
        t0 = time.perf_counter()
        out, stats = fn.run(*args, dialects=[dialect])
        ms = (time.perf_counter() - t0) * 1e3
        results[dialect] = (out, stats)
        print(f"  {dialect:<6} peak {format_bytes(stats.peak_bytes):>10} ({stats.peak_bytes} bytes), "
              f"{len(stats.instr_times)} instructions, {ms:.1f} ms (first run: includes preparing the VM)")
    (a, sa), (b, sb) = results["numpy"], results["torch"]
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    diff = max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) for x, y in zip(a, b))
    agree = all(np.allclose(x, y, rtol=rtol, atol=rtol) for x, y in zip(a, b))
    print(f"  numpy vs torch: max |difference| = {diff:.2e} -> {'agree' if agree else 'DISAGREE'}")
    if sa.peak_bytes != sb.peak_bytes:
        print(f"  note: the dialects measured different peaks ({sa.peak_bytes} vs {sb.peak_bytes} bytes)")
    predicted = _predicted_peak(fn)
    if predicted is not None:
        same = "matches" if predicted == sa.peak_bytes else "DIFFERS from"
        print(f"  static prediction (liveness): {format_bytes(predicted)} ({predicted} bytes) {same} the measurement")
    return sa.peak_bytes, agree


def main() -> int:
    rng = np.random.default_rng(0)
    ok = True

    _section("1. A 2-layer MLP staged from Python")
    print(mlp.ir)
    mlp_args = [rng.standard_normal(s).astype(np.float32) * 0.1
                for s in [(BATCH, FEATURES), (FEATURES, HIDDEN), (HIDDEN,), (HIDDEN, CLASSES), (CLASSES,)]]
    _, agree = _run_both(mlp, mlp_args, rtol=1e-5)
    probs = mlp(*mlp_args)
    print(f"  rows of the softmax sum to 1: {np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)}")
    ok &= agree

    _section("2. A tiny CNN with a staged call and a cross-entropy loss")
    cnn_args = [rng.standard_normal((8, 3, 16, 16)).astype(np.float32),
                rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.2,
                np.zeros(8, np.float32),
                rng.standard_normal((8 * 8 * 8, CLASSES)).astype(np.float32) * 0.01,
                rng.integers(0, CLASSES, size=8)]
    tiny_cnn.module  # stage it (and conv_block for its argument types) before printing
    print(tiny_cnn.ir)
    _, agree = _run_both(tiny_cnn, cnn_args, rtol=1e-4)
    print(f"  loss = {float(tiny_cnn(*cnn_args)):.4f} (a random model scores about ln {CLASSES} = {np.log(CLASSES):.4f})")
    ok &= agree

    _section("3. Its gradient with respect to the weights (remat.grad)")
    try:
        grad_cnn = remat.grad(tiny_cnn, wrt=(1, 2, 3))
    except ImportError:
        grad_cnn = None
        print("  (autodiff is not available yet)")
    if grad_cnn is not None:
        grad_cnn.specialize(*cnn_args)
        n_instr = sum(len(b.instrs) for f in grad_cnn.module for b in f.blocks)
        print(f"  @{grad_cnn.name}: {n_instr} instructions in {len(grad_cnn.module.functions)} function(s) "
              f"(print grad_cnn.ir to read them)")
        _, agree = _run_both(grad_cnn, cnn_args, rtol=1e-3)
        ok &= agree

        _section("3b. The same gradient in mixed precision (remat.autocast)")
        grad_mixed = remat.grad(remat.autocast(tiny_cnn, "bf16"), wrt=(1, 2, 3))
        want, fp32_stats = grad_cnn.run(*cnn_args, dialects=["torch"])
        got, mixed_stats = grad_mixed.run(*cnn_args, dialects=["torch"])
        casts = sum(1 for f in grad_mixed.module for i in f.instructions() if i.op.name == "cast")
        rel = ", ".join(f"{n} {float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)):.2%}"
                        for n, g, w in zip(("w1", "b1", "w2"), got, want))
        print(f"  the convolution and the product in bf16 ({casts} casts); the float32 gradients' distance from "
              f"float32's: {rel} (bf16 keeps 8 bits of mantissa)")
        print(f"  peak {format_bytes(mixed_stats.peak_bytes)} against {format_bytes(fp32_stats.peak_bytes)} in float32")

    _section("4. A data-dependent branch (remat.cond)")

    @remat.function
    def clipped_norm(g: remat.f32[256]):
        n = (g * g).sum().sqrt()
        return remat.cond(n > 1.0, lambda v: v / n, lambda v: v, g)

    print(clipped_norm.ir)
    for scale in (0.01, 10.0):
        g = (rng.standard_normal(256) * scale).astype(np.float32)
        out = clipped_norm(g)
        print(f"  |g| = {np.linalg.norm(g):8.4f} -> |clipped| = {np.linalg.norm(out):.4f}")

    _section("Summary")
    print("  all dialect comparisons agree" if ok else "  SOME DIALECT COMPARISONS DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
