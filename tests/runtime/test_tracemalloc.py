"""Cross-check the tracker against tracemalloc (numpy dialect: NumPy reports its buffers to it).

After each instruction, the traced memory minus the baseline must equal the tracker's live bytes
up to small Python-object overheads (array headers, lists), and the tracker's peak must not
exceed tracemalloc's (kernels also make temporaries the tracker does not count).
"""
from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import remat
from remat.ir import parse
from remat.plan.simulator import predict_peak

SLACK = 16 * 1024  # bytes of Python objects (headers, frame lists, timeline entries) allowed

PROGRAMS = {
    "exp_exp_add": """func @f(%0: f32[50000]) -> f32[50000] {
  %1 = exp %0 : f32[50000]
  %2 = exp %1 : f32[50000]
  %3 = add %1, %2 : f32[50000]
  return %3
}
""",
    "views_and_dead": """func @f(%0: f32[200,250]) -> (f32[250,200], f32[]) {
  %1 = reshape %0 {shape=[50000]} : f32[50000]
  %2 = tanh %1 : f32[50000]
  %3 = sin %1 : f32[50000]
  %4 = reshape %2 {shape=[200,250]} : f32[200,250]
  %5 = transpose %4 {perm=[1,0]} : f32[250,200]
  %6 = mul %2, %2 : f32[50000]
  %7 = reduce_sum %6 {axes=[0]} : f32[]
  return %5, %7
}
""",
    "matmul_free": """func @f(%0: f64[120,100], %1: f64[100,80]) -> f64[120,80] {
  %2 = matmul %0, %1 : f64[120,80]
  %3 = relu %2 : f64[120,80]
  free %2
  %4 = neg %3 : f64[120,80]
  %5 = concat %3, %4 {axis=0} : f64[240,80]
  %6 = slice %5 {start=[0,0], stop=[120,80]} : f64[120,80]
  return %6
}
""",
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_tracker_matches_tracemalloc(name):
    # Without donation: the caller keeps its arguments, so what the tracker counts is what is
    # really allocated (donation is an accounting statement; the caller's references remain).
    f = parse(PROGRAMS[name])["f"]
    vm = remat.VM(f.module, dialects="numpy")
    rng = np.random.default_rng(0)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        args = [rng.uniform(-1, 1, t.shape).astype(t.dtype.numpy) for t in f.param_types]
        diffs = []

        def on_step(e):
            diffs.append((e.index, tracemalloc.get_traced_memory()[0] - base, e.live_bytes))

        tracemalloc.reset_peak()
        outs, st = vm.run("f", *args, on_step=on_step)
        traced_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    for index, traced, live in diffs:
        assert abs(traced - live) <= SLACK, f"instruction {index}: traced {traced} vs tracked {live}"
    assert st.peak_bytes <= traced_peak
    assert st.peak_bytes == predict_peak(f)
    assert len(diffs) == len(f.entry.instrs)


def test_hand_computed_peaks():
    f = parse(PROGRAMS["exp_exp_add"])["f"]
    n = 50000 * 4
    # add writes over its first operand (both die there: remat.ir.reuse): x + the two exps at most.
    assert remat.run(f, np.zeros(50000, np.float32))[1].peak_bytes == 3 * n
    assert remat.run(f, np.zeros(50000, np.float32), donate=True)[1].peak_bytes == 2 * n
    g = parse(PROGRAMS["matmul_free"])["f"]
    a, b, m = 120 * 100 * 8, 100 * 80 * 8, 120 * 80 * 8
    # concat: a + b + relu (written over the matmul result, freed after it) + neg + concat(2m).
    assert remat.run(g, np.zeros((120, 100)), np.zeros((100, 80)))[1].peak_bytes == a + b + m + m + 2 * m
