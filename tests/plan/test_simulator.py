"""The simulator of record: liveness (CFG data-flow, death points) as it uses it, the insert-frees
pass, and static peak prediction, which must equal the VM's measured peak on generated straight-line
programs."""
from __future__ import annotations

import numpy as np
import pytest

import remat
from remat.ir import Builder, DType, Function, Module, TensorType, parse, verify
from remat.ir.liveness import liveness
from remat.plan.simulator import insert_frees, predict_peak, simulate
from remat.pipeline import run_pipeline

DIAMOND = """func @f(%0: f32[500], %1: bool[]) -> f32[500] {
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


def names(f: Function):
    from remat.ir.printer import Namer

    n = Namer(f)
    return lambda vs: sorted(n[v] for v in vs)


def test_liveness_sets_and_death_points_on_a_diamond():
    f = parse(DIAMOND)["f"]
    lv = liveness(f)
    nm = names(f)
    b0, b1, b2, b3 = f.blocks
    assert nm(lv.live_out[b0]) == ["%0", "%2", "%3"]
    assert nm(lv.live_in[b1]) == ["%2", "%3"] and nm(lv.live_in[b2]) == ["%0"]
    assert nm(lv.live_in[b3]) == [] and nm(lv.live_out[b3]) == []
    # %1 dies at the cond_br; on the edge to ^bb2, %2 and %3 die; on the edge to ^bb1, %0 does.
    assert nm(lv.dies_at[b0.instrs[-1]]) == ["%1"]
    assert nm(lv.edge_kills[(b0, 1)]) == ["%2", "%3"]
    assert nm(lv.edge_kills[(b0, 0)]) == ["%0"]
    assert nm(lv.dies_at[b1.instrs[0]]) == ["%2", "%3"]
    assert nm(lv.dies_at[b1.instrs[1]]) == ["%4"]  # passed on as a block argument
    assert b3.instrs[-1] not in lv.dies_at           # returned values never die
    last = lv.last_use()
    assert last[f.params[0]] is b2.instrs[0]


def test_liveness_in_a_loop_keeps_loop_invariant_values_live():
    text = """func @f(%0: f32[8], %1: i64[]) -> f32[8] {
  %2 = constant {value=0, dtype=i64} : i64[]
  br ^bb1(%2, %0)
^bb1(%3: i64[], %4: f32[8]):
  %5 = lt %3, %1 : bool[]
  cond_br %5, ^bb2, ^bb3
^bb2:
  %6 = exp %4 : f32[8]
  %7 = constant {value=1, dtype=i64} : i64[]
  %8 = add %3, %7 : i64[]
  br ^bb1(%8, %6)
^bb3:
  return %4
}
"""
    f = parse(text)["f"]
    lv = liveness(f)
    nm = names(f)
    assert nm(lv.live_in[f.blocks[1]]) == ["%1"]  # the bound is live around the loop
    assert nm(lv.live_out[f.blocks[2]]) == ["%1"]
    assert nm(lv.edge_kills[(f.blocks[1], 1)]) == ["%1", "%3"]  # leaving the loop
    assert nm(lv.dies_at[f.blocks[0].instrs[-1]]) == ["%0", "%2"]


def test_insert_frees_golden():
    text = """func @f(%0: f32[4], %1: f32[4]) -> f32[4] {
  %2 = mul %0, %1 : f32[4]
  %3 = exp %2 : f32[4]
  %4 = reshape %3 {shape=[2, 2]} : f32[2,2]
  %5 = sin %2 : f32[4]
  %6 = add %3, %5 : f32[4]
  return %6
}
"""
    f = parse(text)["f"]
    g = insert_frees(f)
    verify(g)
    assert str(g) == """func @f(%0: f32[4], %1: f32[4]) -> f32[4] {
  %2 = mul %0, %1 : f32[4]
  %3 = exp %2 : f32[4]
  %4 = reshape %3 {shape=[2, 2]} : f32[2,2]
  free %4
  %5 = sin %2 : f32[4]
  free %2
  %6 = add %3, %5 : f32[4]
  free %3, %5
  return %6
}
"""
    assert "free %0" in str(insert_frees(f, donate=True))
    assert str(f).count("free") == 0  # the input is not modified


def test_insert_frees_on_branches_splits_critical_edges_and_preserves_memory():
    f = parse(DIAMOND)["f"]
    g = insert_frees(f)
    verify(Module([g]))
    text = str(g)
    assert "free %2, %3" in text and "free %1" not in text.split("^bb1")[0].split("cond_br")[0]
    x = np.linspace(0, 1, 500).astype(np.float32)
    for c in (True, False):
        (a,), s1 = remat.run(f, x, np.array(c))
        (b,), s2 = remat.run(g, x, np.array(c))
        np.testing.assert_array_equal(a, b)
        assert s1.peak_bytes == s2.peak_bytes and s1.live_bytes_at_end == s2.live_bytes_at_end
    # A join block reached from two predecessors that kill different values gets edge blocks.
    text2 = """func @h(%0: f32[4], %1: bool[]) -> f32[4] {
  %2 = exp %0 : f32[4]
  cond_br %1, ^bb1(%0), ^bb1(%2)
^bb1(%3: f32[4]):
  return %3
}
"""
    h = parse(text2)["h"]
    k = insert_frees(h)
    verify(Module([k]))
    assert len(k.blocks) == 4
    for c in (True, False):
        (a,), s1 = remat.run(h, np.ones(4, np.float32), np.array(c))
        (b,), s2 = remat.run(k, np.ones(4, np.float32), np.array(c))
        np.testing.assert_array_equal(a, b)
        assert (s1.peak_bytes, s1.live_bytes_at_end) == (s2.peak_bytes, s2.live_bytes_at_end)


def test_insert_frees_is_a_registered_pass():
    m = parse(DIAMOND)
    out = run_pipeline(m, ["insert-frees"]).module
    assert "free" in str(out) and "free" not in str(m)


def test_predict_peak_rejects_branches_clearly():
    with pytest.raises(NotImplementedError, match="@f has 4 blocks"):
        predict_peak(parse(DIAMOND)["f"])


# ---------------------------------------------------------------- generated straight-line programs
SHAPES = [(6, 8), (8, 6), (48,), (4, 12), (6, 8)]


def random_program(rng: np.random.Generator, n_instr: int) -> Function:
    """A random straight-line program mixing fresh results, views, in-place updates, frees,
    dead results, calls-free code; returns a verified function."""
    nparams = int(rng.integers(1, 4))
    ptypes = [TensorType(DType.f32, SHAPES[int(rng.integers(len(SHAPES)))]) for _ in range(nparams)]
    f = Function("f", ptypes, [])
    b = Builder(f.entry)
    pool = list(f.params)  # values that may still be used
    step = b.op("constant", value=1, dtype=DType.i64)
    hyper = b.op("constant", value=0.1, shape=(4,), dtype=DType.f64)  # lr, momentum, dampening, weight decay
    skip = b.op("constant", value=False, dtype=DType.bool)

    def pick(pred=lambda v: True):
        cands = [v for v in pool if pred(v)]
        return cands[int(rng.integers(len(cands)))] if cands else None

    for _ in range(n_instr):
        kind = rng.choice(["unary", "unary", "binary", "reshape", "transpose", "reduce", "matmul", "free", "sgd",
                           "concat", "dead"])
        x = pick()
        if kind == "unary":
            pool.append(b.op(str(rng.choice(["exp", "tanh", "neg", "sin", "copy"])), x))
        elif kind == "dead":
            b.op("sigmoid", x)  # never used
        elif kind == "binary":
            y = pick(lambda v: v.type == x.type)
            pool.append(b.op(str(rng.choice(["add", "mul", "maximum"])), x, y))
        elif kind == "reshape":
            shape = [x.type.numel] if x.type.rank != 1 else [4, x.type.numel // 4]
            pool.append(b.op("reshape", x, shape=shape))
        elif kind == "transpose" and x.type.rank == 2:
            pool.append(b.op("transpose", x, perm=[1, 0]))
        elif kind == "reduce" and x.type.rank == 2:
            pool.append(b.op("reduce_sum", x, axes=[int(rng.integers(2))], keepdims=bool(rng.integers(2))))
        elif kind == "matmul" and x.type.rank == 2:
            y = pick(lambda v: v.type.rank == 2 and v.type.shape[0] == x.type.shape[1])
            if y is not None:
                pool.append(b.op("matmul", x, y))
        elif kind == "concat" and x.type.rank == 2:
            y = pick(lambda v: v.type.rank == 2 and v.type.shape[1] == x.type.shape[1])
            pool.append(b.op("concat", x, y, axis=0))
        elif kind == "free" and len(pool) > 1:
            pool.remove(x)
            b.free(x)
        elif kind == "sgd":
            params = [v for v in pool if v.type == x.type and v not in f.params]
            if len(params) >= 3 and len(set(params[:3])) == 3:
                p, g, m = params[:3]
                for v in (p, m):  # in-place: these operands must not be used again
                    pool.remove(v)
                np_, nm = b.op("sgd_step", p, g, m, step, hyper, skip)
                pool += [np_, nm]
    k = int(rng.integers(1, 4))
    outs = [pool[int(i)] for i in rng.choice(len(pool), size=min(k, len(pool)), replace=False)]
    f.result_types = [v.type for v in outs]
    b.ret(*outs)
    verify(Module([f]))
    return f


@pytest.mark.parametrize("seed", range(40))
def test_predicted_peak_equals_measured_peak(seed):
    rng = np.random.default_rng(seed)
    f = random_program(rng, int(rng.integers(3, 25)))
    args = [rng.uniform(-1, 1, t.shape).astype(np.float32) for t in f.param_types]
    dialects = ["numpy", "torch", None][seed % 3]  # None: torch where it can, numpy otherwise
    for donate in (False, True):
        (_, st) = remat.run(f, *[a.copy() for a in args], dialects=dialects, donate=donate)
        pred = simulate(f, donate=donate)
        assert st.peak_bytes == pred.peak_bytes == predict_peak(f, donate=donate), str(f)
        assert st.timeline == pred.timeline
        assert st.live_bytes_at_end == pred.live_bytes_at_end
        assert st.peak_index == pred.peak_index
        # Making the frees explicit changes nothing the VM measures but the instruction count.
        g = insert_frees(f, donate=donate)
        verify(Module([g]))
        _, st2 = remat.run(g, *[a.copy() for a in args], dialects=dialects, donate=donate)
        assert st2.peak_bytes == st.peak_bytes and st2.live_bytes_at_end == st.live_bytes_at_end
        assert predict_peak(g, donate=donate) == st.peak_bytes


def test_prediction_inlines_calls():
    text = """func @inner(%0: f32[100], %1: f32[100]) -> f32[100] {
  %2 = mul %0, %1 : f32[100]
  %3 = exp %2 : f32[100]
  return %3
}

func @outer(%0: f32[100]) -> f32[100] {
  %1 = neg %0 : f32[100]
  %2 = call @inner(%0, %1) : f32[100]
  %3 = call @inner(%2, %2) : f32[100]
  return %3
}
"""
    m = parse(text)
    for donate in (False, True):
        _, st = remat.run(m["outer"], np.ones(100, np.float32), donate=donate)
        assert st.peak_bytes == predict_peak(m["outer"], donate=donate)
        assert st.timeline == simulate(m["outer"], donate=donate).timeline
    # x, neg, mul live at once inside the first call (exp writes over mul: remat.ir.reuse).
    assert predict_peak(m["outer"]) == 3 * 400
