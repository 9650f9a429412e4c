"""The numba dialect's generated ``fused`` kernels: bit-identical to running the body's nodes one by
one with the torch kernels (random data with inf, nan and -0.0; f32, f64 and bf16; broadcasting; sizes
that take the threaded path), refused bodies fall back to torch, and the disk cache makes a second
process compile nothing."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from remat.backends import numba_kernels as nk
from remat.ir import Builder, DType, Function, Module, OPS, TensorType
from remat.ir.ops.fused import parse_body
from remat.runtime.vm import VM

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "remat-cache"))


def programs(body_text: str, types: list[TensorType]) -> tuple[Module, Module]:
    """(one fused instruction, the same nodes as separate instructions)."""
    f = Function("f", types, [])
    ins = Builder(f.entry).create("fused", f.params, {"body": body_text})
    Builder(f.entry).ret(*ins.results)
    f.result_types = [r.type for r in ins.results]
    body = parse_body(ins.attrs["body"])
    g = Function("f", types, f.result_types)
    b = Builder(g.entry)
    vals = list(g.params)
    for n in body.nodes:
        vals.append(b.op(n.op, *[vals[a] for a in n.args], **n.attr_dict))
    outs = []
    for o, t in zip(body.outputs, f.result_types):
        v = vals[o]
        if v.type.shape != t.shape:  # the fused result has the full iteration shape
            v = b.op("broadcast", v, shape=t.shape)
        outs.append(v)
    b.ret(*outs)
    return Module([f]), Module([g])


def special(rng: np.random.Generator, shape, dt: DType) -> np.ndarray:
    """Random values with inf, -inf, nan, 0.0, -0.0 and tiny (subnormal) numbers mixed in."""
    x = rng.standard_normal(shape)
    pool = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, -1e-310, 1.0, -1.0])
    mask = rng.random(shape) < 0.2
    x = np.where(mask, rng.choice(pool, size=shape), x)
    return np.asarray(x, dtype=dt.numpy)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal, NaN payloads aside (torch itself gives different NaN bits on different paths)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind != "f" and a.dtype != DType.bf16.numpy:
        return np.array_equal(a, b)
    isnan = np.isnan if a.dtype.kind == "f" else (lambda x: np.isnan(x.astype(np.float32)))  # bf16: exact in f32
    na, nb = isnan(a), isnan(b)
    iv = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    return bool(np.array_equal(na, nb) and np.array_equal(a[~na].view(iv), b[~nb].view(iv)))


BODIES = [
    # (body, operand shapes (dtype-generic), operand kinds: f float, b bool, i int)
    ("%3 = mul(%0, %1) %4 = add(%3, %2) -> %4", [(33, 17), (33, 17), (17,)], "fff"),  # a*b+c: no FMA
    ("%3 = sub(%0, %1) %4 = div(%3, %2) %5 = neg(%4) %6 = abs(%5) -> %4, %6", [(5, 1, 7), (1, 6, 7), (5, 6, 1)], "fff"),
    ("%2 = relu(%0) %3 = div(%1, %0) %4 = mul(%2, %3) -> %2, %4", [(1100, 1000), (1000,)], "ff"),  # threaded
    ("%2 = constant() {value=0.0} %3 = gt(%0, %2) %4 = select(%3, %1, %2) -> %4", [(64, 128), (64, 128)], "ff"),
    ("%3 = lt(%0, %1) %4 = ge(%0, %1) %5 = eq(%0, %1) %6 = ne(%0, %1) %7 = le(%0, %1) %8 = and(%3, %6) "
     "%9 = or(%5, %4) %10 = not(%7) %11 = select(%8, %0, %2) %12 = select(%9, %11, %1) %13 = select(%10, %12, %2) "
     "-> %13", [(40, 9), (9,), ()], "fff"),
    ("%2 = constant() {value=-inf} %3 = constant() {value=0.125} %4 = mul(%0, %3) %5 = select(%1, %4, %2) -> %5",
     [(8, 4, 16, 16), (16, 16)], "fb"),
    ("%1 = relu(%0) -> %1", [()], "f"),
]


@pytest.mark.parametrize("dt", [DType.f32, DType.f64, DType.bf16])
@pytest.mark.parametrize("case", range(len(BODIES)))
def test_numba_bitwise_equals_torch_op_by_op(case: int, dt: DType) -> None:
    body, shapes, kinds = BODIES[case]
    if "constant" in body:
        body = body.replace("constant() {value=", f"constant() {{dtype={dt.value}, value=")
    types = [TensorType(dt if k == "f" else DType.bool, s) for k, s in zip(kinds, shapes)]
    if max(int(np.prod(s, dtype=np.int64)) for s in shapes) >= nk.PARALLEL_MIN_ELEMENTS and nk.THREADS > 1:
        # this case takes the threaded path (the rows split over the pool)
        assert len(nk._plan(body, tuple(shapes), tuple(np.dtype(t.dtype.numpy) for t in types)).bounds) > 1
    fused, ref = programs(body, types)
    rng = np.random.default_rng(case)
    for _ in range(3):
        args = [special(rng, s, dt) if k == "f" else rng.random(s) < 0.5 for k, s in zip(kinds, shapes)]
        vm = VM(fused)
        assert vm.function("f").entry.instrs[0].dialect == "numba"
        got, sg = vm.run("f", *args)
        want, sw = VM(ref, dialects=("torch", "numpy")).run("f", *args)
        for a, b in zip(got, want):
            assert same_bits(a, b), body


def test_casts_and_int_comparisons() -> None:
    body = "%2 = cast(%0) {dtype=f64} %3 = eq(%1, %1) %4 = cast(%3) {dtype=f64} %5 = mul(%2, %4) %6 = cast(%5) {dtype=f32} -> %6"
    types = [TensorType(DType.f32, (50, 30)), TensorType(DType.i64, (30,))]
    fused, ref = programs(body, types)
    rng = np.random.default_rng(1)
    args = [special(rng, (50, 30), DType.f32), rng.integers(-3, 3, size=(30,))]
    vm = VM(fused)
    assert vm.function("f").entry.instrs[0].dialect == "numba"
    (got,), _ = vm.run("f", *args)
    (want,), _ = VM(ref, dialects=("torch", "numpy")).run("f", *args)
    assert same_bits(got, want)


def test_bf16_rounds_after_every_node_as_torch_does() -> None:
    """bf16 operands and results mixed with f32: casts both ways, a residual add in f32, a division by
    a bf16 scalar, and f32 values halfway between two bf16s (ties go to even), bit for bit."""
    body = ("%3 = cast(%0) {dtype=f32} %4 = add(%3, %1) %5 = cast(%4) {dtype=bf16} %6 = div(%5, %2) "
            "%7 = mul(%0, %2) %8 = sub(%7, %0) -> %4, %6, %8")
    types = [TensorType(DType.bf16, (64, 33)), TensorType(DType.f32, (64, 33)), TensorType(DType.bf16, ())]
    fused, ref = programs(body, types)
    rng = np.random.default_rng(3)
    ties = (rng.integers(0, 1 << 15, (64, 33), dtype=np.uint32) << 16 | np.uint32(0x8000)).view(np.float32)
    for x1 in (special(rng, (64, 33), DType.f32), ties):
        args = [special(rng, (64, 33), DType.bf16), x1, np.asarray(rng.standard_normal(()), DType.bf16.numpy)]
        vm = VM(fused)
        assert vm.function("f").entry.instrs[0].dialect == "numba"
        got, _ = vm.run("f", *args)
        want, _ = VM(ref, dialects=("torch", "numpy")).run("f", *args)
        for a, b in zip(got, want):
            assert same_bits(a, b)


def test_bf16_mixed_with_f64_is_left_to_torch() -> None:
    """torch computes an f64 operand of a bf16 op in f32: the generator refuses such a node."""
    assert not nk.node_supported("mul", (DType.bf16, DType.f64), {})
    assert not nk.node_supported("cast", (DType.f64,), {"dtype": DType.bf16})
    assert nk.node_supported("mul", (DType.bf16, DType.f32), {})
    assert nk.node_supported("cast", (DType.f32,), {"dtype": DType.bf16})


@pytest.mark.parametrize("op", ["exp", "sqrt"])
def test_unsupported_body_falls_back_to_torch(op: str) -> None:
    """exp and sqrt are not in the generator's table (torch's kernels are not correctly rounded), so
    torch runs the body, node by node."""
    fused, ref = programs(f"%2 = {op}(%0) %3 = add(%2, %1) -> %3", [TensorType(DType.f32, (4, 5))] * 2)
    vm = VM(fused)
    assert vm.function("f").entry.instrs[0].dialect == "torch"
    args = [np.ones((4, 5), np.float32), np.arange(20, dtype=np.float32).reshape(4, 5)]
    (got,), _ = vm.run("f", *args)
    (want,), _ = VM(ref, dialects=("torch", "numpy")).run("f", *args)
    assert same_bits(got, want)


def test_collapse_merges_dims_that_broadcast_alike() -> None:
    shape, shapes, full = nk.collapse((8, 4, 16, 16), [(8, 4, 16, 16), (16, 16), (8, 1, 1, 1)])
    assert shape == (8, 4, 256)
    assert shapes == [(8, 4, 256), (1, 1, 256), (8, 1, 1)]
    assert full == ((True, True, True), (False, False, True), (True, False, False))


def test_second_process_compiles_nothing(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        from remat.ir import parse
        from remat.backends import numba_kernels as nk
        m = parse('''func @f(%0: f32[6,7], %1: f32[7]) -> f32[6,7] {
          %2 = fused %0, %1 {body="%2 = sub(%0, %1) %3 = mul(%2, %2) -> %3"} : f32[6,7]
          return %2
        }''')
        nk.prepare(m)
        print(nk.compile_count())
    """)
    env = dict(os.environ, REMAT_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT / "src"))
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert [r.stdout.split()[-1] for r in runs] == ["1", "0"]
    assert len(list((tmp_path / "kernels").glob("k_*.py"))) == 1


@pytest.mark.parametrize("shape", [(1,), (2,), (7,), (3, 5, 9), (4, 64, 65)])
@pytest.mark.parametrize("p", [0.0, 1e-9, 0.3, 0.9, 1.0])
def test_numba_dropout_mask_has_the_reference_bits(shape: tuple, p: float) -> None:
    """The numba dialect's bernoulli draws exactly numpy_kernels.sample_bernoulli's bits (odd and even
    sizes, the probabilities at the ends), and the VM picks it over torch's."""
    from remat.backends import numpy_kernels as npk

    seed = np.array(-(2 ** 62) + 12345, dtype=np.int64)
    got = nk.bernoulli(seed, shape, p)
    want = npk.sample_bernoulli(int(seed), shape, p)
    assert got.dtype == np.bool_ and got.shape == shape and np.array_equal(got, want)
    f = Function("f", [TensorType(DType.i64, ())], [TensorType(DType.bool, shape)])
    b = Builder(f.entry)
    b.ret(b.op("bernoulli", f.params[0], shape=shape, p=p))
    vm = VM(Module([f]))
    assert vm.function("f").entry.instrs[0].dialect == "numba"
    (out,), _ = vm.run("f", seed)
    assert np.array_equal(out, want)


def test_bernoulli_words_are_splitmix64() -> None:
    """Word j of the mask stream is the splitmix64 generator's j-th output from the seed."""
    from remat.backends import numpy_kernels as npk

    seed = 2 ** 64 - 3
    words = npk.splitmix64_words(seed, 5)
    assert [int(w) for w in words] == [npk.splitmix64((seed + j * npk.SPLITMIX_GAMMA) & npk._M64) for j in range(5)]


@pytest.mark.parametrize("dt", [DType.f32, DType.f64], ids=str)
@pytest.mark.parametrize("case", [((3, 4, 32, 32), (3, 3), (2, 2), (1, 1)), ((2, 3, 7, 9), (2, 2), (2, 2), (0, 0)),
                                  ((2, 3, 8, 8), (3, 3), (1, 1), (1, 1)), ((2, 2, 9, 7), (3, 2), (2, 1), (1, 0))])
def test_numba_max_pool_is_torch_bit_for_bit(case: tuple, dt: DType) -> None:
    """Forward values and backward routing equal torch's CPU kernels bit for bit: ties (small integers)
    go to the first maximum, NaN wins (the last NaN of a window), -inf and padding never win over a
    real value; the VM picks the numba kernels."""
    import torch

    from remat.backends import torch_kernels as tk

    shape, k, s, p = case
    rng = np.random.default_rng(len(shape) + k[0] + s[1])
    x = rng.integers(-3, 3, shape).astype(dt.numpy)
    x[rng.random(shape) < 0.05] = np.nan
    x[rng.random(shape) < 0.05] = -np.inf
    gy = rng.standard_normal(nk._pool_out_shape(shape, k, s, p)).astype(dt.numpy)
    want_y = tk.max_pool2d(torch.from_numpy(x), k, s, p).numpy()
    want_gx = tk.max_pool2d_grad(torch.from_numpy(x), torch.from_numpy(gy), k, s, p).numpy()
    assert same_bits(nk.max_pool2d(x, k, s, p), want_y)
    assert same_bits(nk.max_pool2d_grad(x, gy, k, s, p), want_gx)
    _, want_idx = torch.ops.aten.max_pool2d_with_indices(torch.from_numpy(x), list(k), list(s), list(p))
    for index_dtype in (DType.i32, DType.i64):  # the saved-indices path: same winners, same scatter order
        y, idx = nk.max_pool2d_with_indices(x, k, s, p, index_dtype)
        assert same_bits(y, want_y) and idx.dtype == index_dtype.numpy and np.array_equal(idx, want_idx.numpy())
        assert same_bits(nk.max_pool2d_index_grad(gy, idx, shape, k, s, p), want_gx)
    f = Function("f", [TensorType(dt, shape), TensorType(dt, gy.shape)], [TensorType(dt, gy.shape), TensorType(dt, shape)])
    b = Builder(f.entry)
    y = b.op("max_pool2d", f.params[0], kernel=k, stride=s, padding=p)
    gx = b.op("max_pool2d_grad", f.params[0], f.params[1], kernel=k, stride=s, padding=p)
    b.ret(y, gx)
    vm = VM(Module([f]))
    assert {i.dialect for i in vm.function("f").entry.instrs if i.op.name != "return"} == {"numba"}
    (got_y, got_gx), _ = vm.run("f", x, gy)
    assert same_bits(got_y, want_y) and same_bits(got_gx, want_gx)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_numba_max_pool_split_over_threads_is_bit_identical(threads: int, monkeypatch) -> None:
    """Above the threshold the pooling kernels split the planes over threads; every split (including an
    uneven one, and planes < threads) gives the serial kernels' bits, which are torch's."""
    import torch

    from remat.backends import torch_kernels as tk

    shape, k, s, p = (2, 5, 64, 64), (3, 3), (1, 1), (1, 1)
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 3, shape).astype(np.float32)
    x[rng.random(shape) < 0.05] = np.nan
    gy = rng.standard_normal(nk._pool_out_shape(shape, k, s, p)).astype(np.float32)
    monkeypatch.setattr(nk, "PARALLEL_MIN_ELEMENTS", 1)
    monkeypatch.setattr(nk, "threads", lambda: threads)
    assert nk._pool_parts(gy.shape, k) == threads
    want_y = tk.max_pool2d(torch.from_numpy(x), k, s, p).numpy()
    want_gx = tk.max_pool2d_grad(torch.from_numpy(x), torch.from_numpy(gy), k, s, p).numpy()
    assert same_bits(nk.max_pool2d(x, k, s, p), want_y)
    assert same_bits(nk.max_pool2d_grad(x, gy, k, s, p), want_gx)
    _, want_idx = torch.ops.aten.max_pool2d_with_indices(torch.from_numpy(x), list(k), list(s), list(p))
    for index_dtype in (DType.i32, DType.i64):  # the saved-indices path: same winners, same scatter order
        y, idx = nk.max_pool2d_with_indices(x, k, s, p, index_dtype)
        assert same_bits(y, want_y) and idx.dtype == index_dtype.numpy and np.array_equal(idx, want_idx.numpy())
        assert same_bits(nk.max_pool2d_index_grad(gy, idx, shape, k, s, p), want_gx)


def test_numba_kernels_follow_torch_threads() -> None:
    """``torch.set_num_threads(1)`` makes the numba kernels serial; more torch threads allow up to THREADS."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert nk.threads() == 1 and nk._pool_parts((8, 64, 64, 64), (3, 3)) == 1
        torch.set_num_threads(max(2, before))
        assert nk.threads() == min(nk.THREADS, torch.get_num_threads())
    finally:
        torch.set_num_threads(before)
