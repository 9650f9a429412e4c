"""``remat.compile`` as named stages: each timed in the report, printable after it, and the
report's measured overhead honest (0 when nothing is recomputed, None without a measurement)."""
from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat.train.compilation import STAGE_NAMES as STAGES
from _train_util import make


def test_print_after_plan_prints_the_planned_step(capsys):
    model, inputs, loss_fn = make("mlp")
    step = remat.compile(model, inputs, loss_fn, print_after="plan")
    out = capsys.readouterr().out
    assert "// ---- after plan" in out and "func @train_step(" in out
    assert set(step.report().stage_seconds) == set(STAGES) - {"profile", "scale loss", "predict"}  # (profiled costs; fp16; dry runs)


def test_print_after_rejects_unknown_stage():
    model, inputs, loss_fn = make("mlp")
    with pytest.raises(ValueError, match="unknown stage.*stages: capture"):
        remat.compile(model, inputs, loss_fn, print_after="plann")


@pytest.mark.parametrize("cost_model", ["static", "profiled"])
def test_overhead_is_zero_when_nothing_is_recomputed(cost_model):
    model, inputs, loss_fn = make("mlp")
    step = remat.compile(model, inputs, loss_fn, cost_model=cost_model)
    step(*inputs)
    r = step.report()
    assert r.solver == "none" and r.recomputed_instructions == 0
    assert r.overhead == 0.0 and r.predicted_overhead == 0.0
    assert ("profile" in r.stage_seconds) == (cost_model == "profiled")


def test_profiled_overhead_compares_step_programs():
    """With measurements, the overhead compares the budgeted step with the unconstrained step
    program (both with the same updates), never the step with a joint lacking them."""
    from _train_util import make_deep_mlp

    model, inputs, loss_fn = make_deep_mlp()
    step = remat.compile(copy.deepcopy(model), inputs, loss_fn, budget=0.5, cost_model="profiled")
    step(*inputs)
    r = step.report()
    assert r.recomputed_instructions > 0 and r.unconstrained_step_seconds > 0
    assert r.overhead == pytest.approx(r.step_seconds / r.unconstrained_step_seconds - 1.0)


class _Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x


class _Deep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Residual() for _ in range(4)])
        self.head = torch.nn.Linear(32, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_planned_ir_and_report_carry_provenance(capsys):
    """The planned program names each instruction's layer and source line, each recomputation the
    value it recomputes; the report names the recomputed layers by module path."""
    torch.manual_seed(0)
    model, x, y = _Deep(), torch.randn(256, 32), torch.randn(256, 2)
    step = remat.compile(model, (x, y), torch.nn.functional.mse_loss, budget="70%", solver="greedy",
                         print_after="plan")
    out = capsys.readouterr().out
    assert 'loc("layers.0.fc", "' in out and f'test_stages.py":' in out
    assert "recompute=%" in out
    r = step.report()
    assert r.recomputed_instructions > 0
    assert any(p.startswith("layers.") for p in r.recomputed_layers)
    assert sum(r.recomputed_layers.values()) >= r.recomputed_instructions
    assert "recomputed layers" in str(r) and "layers." in str(r)
    unconstrained = remat.compile(model, (x, y), torch.nn.functional.mse_loss).report()
    assert unconstrained.recomputed_layers == {}


def test_a_cached_capture_compiles_the_same_step(tmp_path, monkeypatch):
    """A second compile of the same model takes its capture from the on-disk cache: the same
    planned program, the same updates bit for bit, and the report says where the capture came from."""
    from remat.ir import print_function

    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REMAT_CAPTURE_CACHE", "1")
    torch.manual_seed(0)
    model, x, y = _Deep(), torch.randn(64, 32), torch.randn(64, 2)
    steps, grads = [], []
    for _ in range(2):
        m = copy.deepcopy(model)
        steps.append(remat.compile(m, (x, y), torch.nn.functional.mse_loss, budget="70%", solver="greedy"))
        steps[-1](x, y)
        grads.append([p.grad for p in m.parameters()])
    first, second = (s.report() for s in steps)
    assert not first.capture_cached and second.capture_cached
    assert "capture cache" in str(second) and "capture cache" not in str(first)
    assert print_function(steps[0].program) == print_function(steps[1].program)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_garbage_collector_runs_again_after_each_stage():
    import gc

    from remat._gc import cyclic_gc_paused, cyclic_gc_relaxed

    threshold = gc.get_threshold()
    model, inputs, loss_fn = make("mlp")
    remat.compile(model, inputs, loss_fn)
    assert gc.isenabled() and gc.get_threshold() == threshold
    with pytest.raises(RuntimeError, match="inside"):
        with cyclic_gc_relaxed(threshold[0] + 1000):
            assert gc.get_threshold() == (threshold[0] + 1000, *threshold[1:])
            raise RuntimeError("inside")
    assert gc.get_threshold() == threshold
    with pytest.raises(RuntimeError, match="inside"):
        with cyclic_gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled()


def test_a_parameter_read_through_a_view_is_updated_after_that_read():
    """``update_points``: a parameter's in-place update waits for its last read, also a read of a view
    of it (a recomputation reading ``reshape(bias)`` after the bias's gradient exists)."""
    from remat.ir import Builder, DType, Function, TensorType
    from remat.step.program import Layout, update_points

    v = TensorType(DType.f32, (3,))
    f = Function("train_joint", [v, v])  # (param, input)
    b = Builder(f.entry)
    w, x = f.params
    loss = b.op("reduce_sum", b.op("mul", w, x), axes=[0])
    grad = b.op("mul", x, b.op("constant", value=1.0, dtype=DType.f32, shape=()))  # d loss / d w, at 3
    late = b.op("reduce_sum", b.op("reshape", w, shape=(1, 3)), axes=[0, 1])  # view at 4, read at 5
    f.result_types = [loss.type, late.type, grad.type]
    b.ret(loss, late, grad)
    layout = Layout(n_params=1, n_state=1, n_inputs=1, has_seed=False, n_buffers_out=1)
    assert update_points(f, layout) == [5]  # the read of the view, not the reshape (4) or the gradient (3)


def test_profiled_cost_model_measures_the_lean_variants_too():
    """With ``cost_model="profiled"`` a lean-algorithm variant's problem is costed as the reference's
    is, by running it (its candidates are compared with the reference's); static costs stay static."""
    from remat.plan.costmodel import static_costs
    from remat.train.variants import lean_variants

    for cost_model in ("static", "profiled"):
        model, inputs, loss_fn = make("resnet")  # its stem has a tiled (conv_bn_relu_pool) variant
        step = remat.compile(model, inputs, loss_fn, cost_model=cost_model)
        variants = lean_variants(step.compilation)(step.compilation.problem)
        assert variants, "resnet has no lean variant"
        p = variants[0].problem
        static = static_costs(p.joint)
        assert set(p.costs) == set(static)
        if cost_model == "profiled":
            assert p.measured is not None and p.costs != static
            assert all(t >= 0 for t in p.costs.values())
        else:
            assert p.measured is None and p.costs == static


def test_profiled_costs_cover_every_instruction_of_the_step():
    """With ``cost_model="profiled"`` every instruction the cost model prices is priced by measurement:
    the step program as it runs (a lean algorithm's instructions, fused kernels, the updates) and the
    unconstrained step's, each signature measured in the step's own runs or alone; costs steer
    choices only, so the predicted peak is still the measured one."""
    from remat.plan.costmodel import _priced, _signature

    model, inputs, loss_fn = make("resnet")  # a lean (tiled stem) variant at low budgets
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    step = remat.compile(model, inputs, loss_fn, optimizer=opt, budget=0.75, cost_model="profiled")
    step(*inputs)
    c = step.compilation
    r = step.report()
    assert c.plan.unconstrained is not None and c.recomputes  # a lean algorithm, and recomputation
    assert r.measured_peak == r.predicted_peak <= r.budget
    known = set(c.measured.seconds)
    for fn in (c.program, c.plan.program, c.unconstrained_program):
        missing = {ins.op.name for ins in _priced(fn) if _signature(ins) not in known}
        assert not missing, f"priced by the static estimate: {sorted(missing)}"
    cost = c.cost_model()
    assert c.predicted_seconds == pytest.approx(cost.program_cost(c.program))
    assert c.unconstrained_predicted_seconds == pytest.approx(cost.program_cost(c.unconstrained_program))


def test_report_shows_predicted_and_measured_recomputation_seconds():
    from _train_util import make_deep_mlp

    model, inputs, loss_fn = make_deep_mlp()
    step = remat.compile(copy.deepcopy(model), inputs, loss_fn, budget=0.5, cost_model="profiled")
    step(*inputs)
    r = step.report()
    assert r.recomputed_instructions > 0
    assert r.predicted_recompute_seconds > 0
    assert r.predicted_overhead == pytest.approx(r.predicted_recompute_seconds
                                                 / (r.predicted_step_seconds - r.predicted_recompute_seconds))
    assert r.measured_recompute_seconds == pytest.approx(r.step_seconds - r.unconstrained_step_seconds)
    lines = {ln.split("  ")[0]: ln for ln in str(r).splitlines()}
    assert f"{r.predicted_recompute_seconds * 1e3:+.2f} ms on a" in lines["predicted recompute overhead"]
    assert f"{r.measured_recompute_seconds * 1e3:+.2f} ms on a" in lines["measured step overhead"]
    assert r.priced_by == "measured" and "static cost model" not in lines["predicted recompute overhead"]
    static = remat.compile(copy.deepcopy(model), inputs, loss_fn, budget=0.5).report()
    assert static.priced_by == "nominal CPU"  # seconds at the nominal rates, not this machine's: said so
    line = next(ln for ln in str(static).splitlines() if ln.startswith("predicted recompute overhead"))
    assert line.endswith("predicted unconstrained step, static cost model at nominal CPU rates)")


def test_profiled_plans_price_blocks_by_measured_signatures_and_consider_the_static_plan(monkeypatch):
    """A profiled compile's chain DP prices its blocks on the compile's measured instruction seconds,
    never by timing a block once (its plans would follow the machine's load), and the portfolio also
    prices the plan the static cost model makes: the notes name it, as the winner or as tried."""
    import remat.plan.chain.profile as chain_profile

    real = chain_profile.profile_stages

    def no_block_timing(*args, measure=True, **kw):
        assert not measure, "a profiled compile timed the chain's blocks"
        return real(*args, measure=measure, **kw)

    monkeypatch.setattr(chain_profile, "profile_stages", no_block_timing)
    model, inputs, loss_fn = make("resnet")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    step = remat.compile(model, inputs, loss_fn, optimizer=opt, budget=0.6, cost_model="profiled")
    step(*inputs)
    r = step.report()
    assert r.measured_peak == r.predicted_peak <= r.budget
    assert "on the static cost model" in r.solver or any("on the static cost model" in n for n in r.solver_notes)
