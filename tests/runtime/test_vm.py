"""The VM: results, hand-computed peaks, branches, calls, argument checks, kernel contracts, RunStats."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import remat
from remat.ir import Builder, DType, Function, Module, TensorType, parse
from remat.plan.simulator import predict_peak, simulate

F = lambda *s: TensorType(DType.f32, s)  # noqa: E731
N = 1000  # elements; f32[1000] is 4000 bytes


def exp_exp_add() -> Function:
    f = Function("f", [F(N)], [F(N)])
    b = Builder(f.entry)
    (x,) = f.params
    y = b.op("exp", x)
    z = b.op("exp", y)
    b.ret(b.op("add", y, z))
    Module([f])
    return f


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_exp_exp_add_hand_computed(dialect):
    f = exp_exp_add()
    x = np.linspace(-1, 1, N).astype(np.float32)
    (out,), st = remat.run(f, x, dialects=dialect)
    np.testing.assert_allclose(out, np.exp(x) + np.exp(np.exp(x)), rtol=1e-6)
    # x (4000, the caller's) + y + z while the second exp runs: 12000. add writes w over y (both of
    # its operands die there: remat.ir.reuse), so it allocates nothing; then z dies: x + w.
    assert st.peak_bytes == 12000
    assert st.peak_index == 1 and st.peak_at.op.name == "exp"
    assert [(e.live_bytes, e.high_water) for e in st.timeline] == [(8000, 8000), (12000, 12000), (8000, 12000), (8000, 8000)]
    assert st.live_bytes_at_end == 8000 and st.argument_bytes == 4000
    # Donated: x dies after the first exp.  exp: 8000 -> 4000; exp: 8000; add (over y): 8000 -> 4000.
    (_,), st = remat.run(f, x, dialects=dialect, donate=True)
    assert st.peak_bytes == 8000 and st.live_bytes_at_end == 4000


def test_views_count_once_and_dead_results_die_immediately():
    f = Function("f", [F(10, 100)], [F(1000)])
    b = Builder(f.entry)
    (x,) = f.params
    r = b.op("reshape", x, shape=[1000])     # a view: +0
    b.op("exp", r)                           # dead result: +4000 during, then released
    t = b.op("neg", r)                       # +4000
    b.ret(t)
    Module([f])
    (out,), st = remat.run(f, np.ones((10, 100), np.float32), dialects="numpy")
    assert [e.live_bytes for e in st.timeline] == [4000, 4000, 8000, 8000]
    assert [e.high_water for e in st.timeline] == [4000, 8000, 8000, 8000]
    assert st.peak_bytes == 8000 == predict_peak(f)
    np.testing.assert_array_equal(out, -np.ones(1000, np.float32))


def test_explicit_free_releases_at_the_free():
    text = """func @f(%0: f32[1000]) -> f32[1000] {
  %1 = exp %0 : f32[1000]
  %2 = cumsum %1 {axis=0} : f32[1000]
  free %1
  %3 = exp %2 : f32[1000]
  return %3
}
"""
    f = parse(text)["f"]
    (_,), st = remat.run(f, np.zeros(1000, np.float32))
    assert [e.live_bytes for e in st.timeline] == [8000, 12000, 8000, 8000, 8000]
    assert st.peak_bytes == 12000 == predict_peak(f)


def loop_module() -> Module:
    """sum_{i<n} exp(x) by a loop with block arguments (a counter and an accumulator)."""
    text = """func @loop(%0: f32[256], %1: i64[]) -> f32[256] {
  %2 = constant {value=0, dtype=i64} : i64[]
  %3 = constant {value=0.0, shape=[256]} : f32[256]
  br ^bb1(%2, %3)
^bb1(%4: i64[], %5: f32[256]):
  %6 = lt %4, %1 : bool[]
  cond_br %6, ^bb2, ^bb3
^bb2:
  %7 = exp %0 : f32[256]
  %8 = add %5, %7 : f32[256]
  %9 = constant {value=1, dtype=i64} : i64[]
  %10 = add %4, %9 : i64[]
  br ^bb1(%10, %8)
^bb3:
  return %5
}
"""
    return parse(text)


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_loop_with_block_arguments(dialect):
    m = loop_module()
    x = np.linspace(0, 1, 256).astype(np.float32)
    (out,), st = remat.run(m["loop"], x, np.array(5, dtype=np.int64), dialects=dialect)
    np.testing.assert_allclose(out, 5 * np.exp(x), rtol=1e-6)
    # At the end only the argument (1024 + 8 bytes) and the result (1024) are live.
    assert st.live_bytes_at_end == 1024 + 8 + 1024
    # At the loop body's add: x, n, counter, acc, exp result, new acc (the bool condition died at
    # the branch; the old acc and exp result die before the counter's constant and add allocate).
    assert st.peak_bytes == 1032 + 8 + 3 * 1024
    assert len(st.timeline) == 3 + 5 * 7 + 2 + 1
    (out0,), _ = remat.run(m["loop"], x, np.array(0, dtype=np.int64), dialects=dialect)
    np.testing.assert_array_equal(out0, np.zeros(256, np.float32))


def test_values_used_on_one_branch_die_on_the_other_edge():
    text = """func @f(%0: f32[500], %1: bool[]) -> f32[500] {
  %2 = exp %0 : f32[500]
  %3 = neg %0 : f32[500]
  cond_br %1, ^bb1, ^bb2
^bb1:
  %4 = add %2, %3 : f32[500]
  br ^bb3(%4)
^bb2:
  %5 = sin %0 : f32[500]
  br ^bb3(%5)
^bb3(%6: f32[500]):
  return %6
}
"""
    f = parse(text)["f"]
    x = np.linspace(0, 1, 500).astype(np.float32)
    (o,), st = remat.run(f, x, np.array(False))
    np.testing.assert_allclose(o, np.sin(x), rtol=1e-6)
    # On the false edge %2 and %3 die before sin allocates: x + cond + sin result.
    sin_entry = [e for e in st.timeline if st.instr_times[st.timeline.index(e)][1] == "sin"][0]
    assert sin_entry.high_water == 2000 + 1 + 2000
    assert st.live_bytes_at_end == 2000 + 1 + 2000
    (o,), st = remat.run(f, x, np.array(True))
    np.testing.assert_allclose(o, np.exp(x) - x, rtol=1e-6)
    assert st.peak_bytes == 2001 + 3 * 2000 and st.live_bytes_at_end == 4001


def call_module() -> Module:
    text = """func @inner(%0: f32[1000]) -> f32[1000] {
  %1 = exp %0 : f32[1000]
  %2 = exp %1 : f32[1000]
  %3 = mul %1, %2 : f32[1000]
  return %3
}

func @outer(%0: f32[1000]) -> (f32[1000], f32[1000]) {
  %1 = neg %0 : f32[1000]
  %2 = call @inner(%1) : f32[1000]
  %3 = call @inner(%0) : f32[1000]
  return %2, %3
}
"""
    return parse(text)


@pytest.mark.parametrize("donate", [False, True])
def test_calls_count_callee_temporaries(donate):
    m = call_module()
    x = np.linspace(-1, 1, N).astype(np.float32)
    (a, b), st = remat.run(m["outer"], x, donate=donate)
    e = lambda v: np.exp(v) * np.exp(np.exp(v))  # noqa: E731
    np.testing.assert_allclose(a, e(-x), rtol=1e-5)
    np.testing.assert_allclose(b, e(x), rtol=1e-5)
    # First call: x, neg (dies inside the callee after its last use), exp, exp; mul writes over the
    # first exp (remat.ir.reuse). Second call: x, first result, exp, exp -> 4 buffers either way.
    assert st.peak_bytes == 4 * 4000 == predict_peak(m["outer"], donate=donate)
    assert st.timeline == simulate(m["outer"], donate=donate).timeline
    assert [t[1] for t in st.instr_times] == ["neg", "call", "call", "return"]


def test_callee_returning_its_argument_and_a_view():
    text = """func @g(%0: f32[10,10]) -> (f32[10,10], f32[100]) {
  %1 = reshape %0 {shape=[100]} : f32[100]
  return %0, %1
}

func @f(%0: f32[10,10]) -> (f32[10,10], f32[100]) {
  %1 = exp %0 : f32[10,10]
  %2, %3 = call @g(%1) : f32[10,10], f32[100]
  return %2, %3
}
"""
    m = parse(text)
    x = np.ones((10, 10), np.float32)
    (a, b), st = remat.run(m["f"], x)
    np.testing.assert_allclose(b, np.exp(x).reshape(100))
    assert np.shares_memory(a, b)
    assert st.peak_bytes == 800 == predict_peak(m["f"]) and st.live_bytes_at_end == 800


def test_argument_type_errors_name_the_parameter():
    f = exp_exp_add()
    with pytest.raises(TypeError, match=r"argument 0 of @f: expected f32\[1000\], got f64\[1000\]"):
        remat.run(f, np.zeros(N))
    with pytest.raises(TypeError, match=r"argument 0 of @f: expected f32\[1000\], got f32\[999\]"):
        remat.run(f, np.zeros(N - 1, np.float32))
    with pytest.raises(TypeError, match=r"@f takes 1 argument"):
        remat.run(f, np.zeros(N, np.float32), np.zeros(N, np.float32))
    with pytest.raises(TypeError, match="numpy array or torch tensor"):
        remat.run(f, [0.0] * N)


def test_torch_inputs_and_outputs():
    f = exp_exp_add()
    x = torch.linspace(-1, 1, N)
    (o,), st = remat.run(f, x, outputs="torch")
    assert isinstance(o, torch.Tensor)
    torch.testing.assert_close(o, torch.exp(x) + torch.exp(torch.exp(x)))
    (o2,), st2 = remat.run(f, x, dialects="numpy")
    assert isinstance(o2, np.ndarray) and st2.peak_bytes == st.peak_bytes == 12000


def test_non_contiguous_argument_is_copied_once():
    f = Function("f", [F(100, 10)], [F(1000)])
    b = Builder(f.entry)
    b.ret(b.op("reshape", f.params[0], shape=[1000]))
    Module([f])
    x = np.ones((10, 100), np.float32).T  # not C-contiguous
    for d in ("numpy", "torch"):
        (o,), st = remat.run(f, x, dialects=d)
        assert st.peak_bytes == 4000 and o.shape == (1000,)


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_a_view_into_a_larger_buffer_counts_its_own_bytes(dialect):
    """A rank's slice of the whole batch: the step's own copy is counted, as predicted, not the
    caller's whole buffer; an argument written in place is the caller's buffer itself."""
    f = exp_exp_add()
    big = np.linspace(-1, 1, 4 * N).astype(np.float32)
    for whole in (big, torch.from_numpy(big)):
        view = whole[N:2 * N]  # contiguous, at an offset into a 4x larger buffer
        (out,), st = remat.run(f, view, dialects=dialect)
        assert st.peak_bytes == predict_peak(f) == 12000 and st.argument_bytes == 4000
        np.testing.assert_allclose(out, np.exp(big[N:2 * N]) + np.exp(np.exp(big[N:2 * N])), rtol=1e-6)
    g = Function("g", [F(N), F(N)], [F(N)])
    b = Builder(g.entry)
    p, v = g.params
    b.ret(b.op("assign", p, b.op("neg", v)))
    Module([g])
    buf = torch.zeros(4 * N)
    _, st = remat.run(g, buf[N:2 * N], torch.ones(N), dialects=dialect)
    assert torch.equal(buf[N:2 * N], -torch.ones(N)) and buf[:N].abs().sum() == 0  # written where it lives
    assert st.argument_bytes == 4 * N * 4 + 4000  # its whole buffer: it cannot be copied


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_one_buffer_passed_as_two_arguments_counts_both(dialect):
    """One tensor passed as two arguments (``labels=input_ids``): the step reads a copy for the
    second, so each argument holds its own bytes as predicted (counted by storage, the pair was
    one argument's bytes below the prediction); an argument written in place is never copied."""
    f = Function("f", [F(N), F(N)], [F(N)])
    b = Builder(f.entry)
    x, y = f.params
    b.ret(b.op("add", b.op("exp", x), y))
    Module([f])
    for a in (np.linspace(-1, 1, N).astype(np.float32), torch.linspace(-1, 1, N)):
        for record in ("full", "peak"):
            vm = remat.VM(f.module, dialects=dialect)
            (out,), st = vm.run("f", a, a, record=record)
            assert st.argument_bytes == 8000 and st.peak_bytes == predict_peak(f) == 12000
            np.testing.assert_allclose(np.asarray(out), np.exp(np.asarray(a)) + np.asarray(a), rtol=1e-6, atol=1e-6)
    g = Function("g", [F(N), F(N)], [F(N)])
    b = Builder(g.entry)
    p, v = g.params
    b.ret(b.op("assign", p, b.op("neg", v)))
    Module([g])
    buf = torch.ones(N)
    _, st = remat.run(g, buf, buf, dialects=dialect)  # the written one first: the read one is copied
    assert torch.equal(buf, -torch.ones(N)) and st.argument_bytes == 8000


def test_bytes_by_kind_measured_as_predicted():
    """``run(..., by_kind=True)`` splits the bytes by the labels of ``set_kinds``, as ``simulate`` does."""
    f = exp_exp_add()
    x, (y, z, w) = f.params[0], [i.results[0] for i in f.entry.instrs[:3]]
    labels = {x: "inputs", y: "activations", z: "activations"}  # w unlabelled, but written over y
    vm = remat.VM(f.module, dialects="torch")
    with pytest.raises(ValueError, match="set_kinds"):
        vm.run("f", np.zeros(N, np.float32), by_kind=True)
    vm.set_kinds(f, labels)
    for record in ("full", "peak"):
        _, st = vm.run("f", np.zeros(N, np.float32), record=record, by_kind=True)
        # A storage has the kind of the value that allocated it: w lives in y's, "activations".
        assert st.by_kind.at_peak == {"other": 0, "inputs": 4000, "activations": 8000}
        assert st.by_kind.peaks == {"other": 0, "inputs": 4000, "activations": 8000}
        assert st.by_kind.allocated == {"other": 0, "inputs": 4000, "activations": 8000}
        assert st.by_kind == simulate(f, kinds=labels).by_kind
    assert vm.run("f", np.zeros(N, np.float32), record="peak")[1].by_kind is None


def test_kernel_output_type_mismatch_names_the_instruction():
    vm = remat.VM(exp_exp_add().module, dialects="numpy")
    vm._plans["f"].blocks[0].steps[1].fn = lambda x: np.exp(x).astype(np.float64)
    with pytest.raises(RuntimeError, match=r"numpy\.exp.*instruction 1.*should be f32\[1000\].*float64"):
        vm.run("f", np.zeros(N, np.float32))


def test_kernel_returning_a_scalar_is_rejected():
    f = Function("f", [F()], [F()])
    b = Builder(f.entry)
    b.ret(b.op("exp", f.params[0]))
    vm = remat.VM(Module([f]), dialects="numpy")
    vm._plans["f"].blocks[0].steps[0].fn = lambda x: np.float32(1.0)
    with pytest.raises(RuntimeError, match="should be f32"):
        vm.run("f", np.zeros((), np.float32))


def test_non_view_output_sharing_an_input_is_copied():
    f = Function("f", [F(N)], [F(N)])
    b = Builder(f.entry)
    b.ret(b.op("copy", f.params[0]))
    vm = remat.VM(Module([f]), dialects="numpy")
    vm._plans["f"].blocks[0].steps[0].fn = lambda x: x  # breaks the contract: returns its operand
    x = np.arange(N, dtype=np.float32)
    (o,), st = vm.run("f", x)
    assert not np.shares_memory(o, x)
    np.testing.assert_array_equal(o, x)
    assert st.peak_bytes == 8000 == predict_peak(f)


def test_view_kernel_returning_a_copy_is_an_error():
    f = Function("f", [F(10, 100)], [F(N)])
    b = Builder(f.entry)
    b.ret(b.op("reshape", f.params[0], shape=[N]))
    vm = remat.VM(Module([f]), dialects="numpy")
    vm._plans["f"].blocks[0].steps[0].fn = lambda x, shape: x.reshape(shape).copy()
    with pytest.raises(RuntimeError, match="must share the storage of operand 0"):
        vm.run("f", np.zeros((10, 100), np.float32))


def test_kernel_failure_names_the_instruction():
    text = """func @f(%0: f32[5,3], %1: i64[2]) -> f32[2,3] {
  %2 = gather %0, %1 : f32[2,3]
  return %2
}
"""
    f = parse(text)["f"]
    with pytest.raises(IndexError, match=r"(?s)numpy\.gather.*instruction 0.*'gather': index \(axis 0\) 9 is out of range; "
                                         r"valid: \[0, 5\)"):
        remat.run(f, np.zeros((5, 3), np.float32), np.array([0, 9]), dialects="numpy")


def test_mixed_dialects_share_storage_zero_copy():
    f = Function("f", [F(10, 100)], [F(100)])
    b = Builder(f.entry)
    r = b.op("reshape", f.params[0], shape=[N])  # torch view of a numpy argument
    y = b.op("exp", r)
    m = b.op("matmul", b.op("reshape", y, shape=[10, 100]), b.op("reshape", y, shape=[100, 10]))
    b.ret(b.op("reshape", m, shape=[100]))
    mod = remat.backends.assign_dialects(Module([f]))
    for ins in mod["f"].instructions():  # alternate the dialects by hand
        if ins.op.name == "exp":
            ins.dialect = "numpy"
    x = np.random.default_rng(0).standard_normal((10, 100)).astype(np.float32)
    (o,), st = remat.VM(mod).run("f", x)
    e = np.exp(x.reshape(N))
    np.testing.assert_allclose(o, (e.reshape(10, 100) @ e.reshape(100, 10)).reshape(100), rtol=1e-5)
    assert st.peak_bytes == predict_peak(mod["f"]) == 4000 + 4000 + 400


def test_vm_is_reusable_and_staged_objects_run():
    vm = remat.VM(exp_exp_add().module)
    x = np.zeros(N, np.float32)
    (a,), s1 = vm.run("f", x)
    (b,), s2 = vm.run("f", x + 1)
    np.testing.assert_allclose(a, np.full(N, 1 + np.e, np.float32), rtol=1e-6)
    assert not np.allclose(a, b) and s1.peak_bytes == s2.peak_bytes

    class Staged:
        def __remat_function__(self):
            return exp_exp_add()

    (c,), _ = remat.run(Staged(), x)
    np.testing.assert_array_equal(a, c)
    with pytest.raises(TypeError, match="remat Function or a staged function"):
        remat.run(lambda v: v, x)


def test_run_stats_report():
    (_,), st = remat.run(exp_exp_add(), np.zeros(N, np.float32))
    text = str(st)
    assert "peak memory" in text and "12000 bytes" in text and "add" in text
    assert st.total_seconds >= sum(t for _, _, t in st.instr_times) * 0.5
    assert set(st.time_by_op()) == {"exp", "add", "return"}


def test_random_ops_replay_identically_across_dialects():
    text = """func @f(%0: i64[]) -> (f32[8,8], bool[8,8], i64[]) {
  %1 = fold_seed %0 {salt=3} : i64[]
  %2 = normal %1 {shape=[8,8]} : f32[8,8]
  %3 = bernoulli %1 {shape=[8,8], p=0.5} : bool[8,8]
  return %2, %3, %1
}
"""
    f = parse(text)["f"]
    s = np.array(42, dtype=np.int64)
    a, _ = remat.run(f, s, dialects="numpy")
    b, _ = remat.run(f, s, dialects="torch")
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
