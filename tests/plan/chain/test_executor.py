"""The chain executor's promise: for plans at many budgets, the VM's measured peak equals the
predicted peak, never exceeds the budget, and gradients are bit-identical to the no-recompute run
(random ops replay the same values when recomputed)."""
from __future__ import annotations

import numpy as np
import pytest

import remat
from remat.plan.chain import ChainPlanner, minimum_budget, solve
from remat.plan.chain.solvers import no_recompute_peak
from remat.plan.chain.executor import compile_schedule, make_stage
from remat.plan.chain.profile import chain_costs, profile_stages
from remat.ir import Builder, DType, Function, TensorType
from remat.plan.simulator import predict_peak

F64 = DType.f64


def _dense(name: str, batch: int, width: int, act: str, dropout: bool = False) -> Function:
    """(w, x) -> act(x @ w), optionally with a dropout mask drawn from a constant seed."""
    f = Function(name, [TensorType(F64, (width, width)), TensorType(F64, (batch, width))],
                 [TensorType(F64, (batch, width))])
    b = Builder(f.entry)
    w, x = f.params
    y = b.op(act, b.op("matmul", x, w))
    if dropout:
        seed = b.op("fold_seed", b.op("constant", value=1234, dtype=DType.i64), salt=hash(name) % 1000)
        keep = b.op("bernoulli", seed, shape=(batch, width), p=0.8)
        y = b.op("select", keep, b.op("div", y, b.op("constant", value=0.8, dtype=F64)), b.op("constant", value=0.0, dtype=F64))
    b.ret(y)
    return f


def _conv(name: str, n: int, c: int, hw: int) -> Function:
    f = Function(name, [TensorType(F64, (c, c, 3, 3)), TensorType(F64, (n, c, hw, hw))], [TensorType(F64, (n, c, hw, hw))])
    b = Builder(f.entry)
    w, x = f.params
    b.ret(b.op("relu", b.op("conv2d", x, w, padding=(1, 1))))
    return f


def _chain(kind: str):
    rng = np.random.default_rng(0)
    if kind == "mlp":
        fns = [_dense(f"l{i}", 64, 32, "tanh" if i % 2 else "relu", dropout=(i == 2)) for i in range(6)]
        params = [[rng.standard_normal((32, 32)) / 6] for _ in fns]
        x, gy = rng.standard_normal((64, 32)), rng.standard_normal((64, 32))
    else:
        fns = [_conv(f"c{i}", 2, 4, 8) for i in range(5)]
        params = [[rng.standard_normal((4, 4, 3, 3)) / 6] for _ in fns]
        x, gy = rng.standard_normal((2, 4, 8, 8)), rng.standard_normal((2, 4, 8, 8))
    stages = [make_stage(f.name, f, 1) for f in fns]
    profiles = profile_stages(stages, params, x, gy, repeats=1, dialects=("numpy",))
    return stages, profiles, [p for ps in params for p in ps] + [x, gy]


@pytest.fixture(scope="module", params=["mlp", "conv"])
def chain(request):
    return _chain(request.param)


def test_budgets_measured_equals_predicted_and_gradients_are_bit_identical(chain):
    stages, profiles, args = chain
    costs = chain_costs(profiles)
    planner = ChainPlanner(stages, costs)
    full = planner.solve(10**12)
    ref, ref_stats = remat.run(full.program, *args, dialects=("numpy",))
    assert ref_stats.peak_bytes == full.peak
    minimum = planner.minimum()
    seen_peaks = set()
    for frac in np.linspace(0.0, 1.0, 9):
        budget = int(minimum + frac * (full.peak - minimum))
        policy = planner.solve(budget)
        outs, stats = remat.run(policy.program, *args, dialects=("numpy",))
        assert stats.peak_bytes == policy.peak == predict_peak(policy.program)
        assert stats.peak_bytes <= budget
        for a, b in zip(outs, ref):
            assert np.array_equal(a, b), "gradients must be bit-identical to the no-recompute run"
        seen_peaks.add(policy.peak)
    assert len(seen_peaks) >= 3, "budgets between the minimum and the full peak should give different plans"
    with pytest.raises(remat.BudgetTooSmall) as e:
        planner.solve(minimum - 1)
    assert e.value.minimum == minimum


def test_every_solver_method_executes_exactly(chain):
    stages, profiles, args = chain
    costs = chain_costs(profiles)
    ref = None
    for method in ("none", "sqrt", "uniform", "precise", "extended"):
        model = "extended" if method == "extended" else "precise"
        budget = (minimum_budget(costs, method=model) + no_recompute_peak(costs, "thesis")) // 2
        plan = solve(costs, budget, method=method)
        prog = compile_schedule(stages, list(plan.schedule))
        fn = prog["chain_step"]
        outs, stats = remat.run(fn, *args, dialects=("numpy",))
        assert stats.peak_bytes == predict_peak(fn)
        ref = ref or outs
        assert all(np.array_equal(a, b) for a, b in zip(outs, ref))


def test_recomputed_random_ops_replay():
    """A dropout stage recomputed twice draws the same mask: same gradients as storing it."""
    stages, profiles, args = _chain("mlp")
    costs = chain_costs(profiles)
    planner = ChainPlanner(stages, costs)
    lo = planner.solve(planner.minimum())
    recomputes = sum(1 for s in lo.solution.schedule if type(s).__name__ in ("F", "FT") and s.i == 3)
    assert recomputes >= 2
    a, _ = remat.run(lo.program, *args)
    b, _ = remat.run(planner.solve(10**12).program, *args)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_a_stage_backward_releases_its_tape_and_upstream_gradient(monkeypatch):
    """``Split.donated``: the backward of a stage frees the tape values and the gradient it was given
    at their last use, rather than after the whole backward. The program is exact either way and
    computes the same bits; donating lowers the storing schedule's peak."""
    from remat.plan.chain import executor

    peaks, outs = {}, {}
    for donate in (False, True):
        monkeypatch.setattr(executor, "DONATE_TAPE", donate)
        stages, profiles, args = _chain("conv")
        assert all(bool(st.split.donated) == donate for st in stages)
        policy = ChainPlanner(stages, chain_costs(profiles)).solve(10**12)
        outs[donate], stats = remat.run(policy.program, *args, dialects=("numpy",))
        assert stats.peak_bytes == predict_peak(policy.program)
        peaks[donate] = stats.peak_bytes
    assert peaks[True] < peaks[False]
    assert all(np.array_equal(a, b) for a, b in zip(outs[True], outs[False]))
