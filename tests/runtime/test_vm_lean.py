"""The VM's recording levels: ``record="peak"`` (the lean mode of training steps) gives the same
results and the same measured bytes as ``record="full"``, and still enforces every kernel contract."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import remat
from remat import zoo
from remat.ir import OPS, Builder, DType, Function, Module, TensorType, parse
from remat.plan.simulator import predict_peak

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ir"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plan"))
from irgen import sampled_ops  # noqa: E402
from test_simulator import random_program  # noqa: E402

F = lambda *s: TensorType(DType.f32, s)  # noqa: E731
N = 1000


def run_both(vm: remat.VM, name: str, args: list, **kw):
    """Runs ``name`` in both modes on fresh copies of ``args`` (in-place ops mutate them)."""
    copy = lambda a: a.clone() if isinstance(a, torch.Tensor) else a.copy()  # noqa: E731
    full = vm.run(name, *[copy(a) for a in args], record="full", **kw)
    peak = vm.run(name, *[copy(a) for a in args], record="peak", **kw)
    return full, peak


def assert_same(full, peak) -> None:
    """Same outputs bit for bit and the same measured bytes; the lean run has no timeline."""
    (o1, s1), (o2, s2) = full, peak
    assert len(o1) == len(o2)
    for a, b in zip(o1, o2):
        a, b = (np.asarray(x.numpy() if isinstance(x, torch.Tensor) else x) for x in (a, b))
        np.testing.assert_array_equal(a, b)
    assert (s2.peak_bytes, s2.peak_index, s2.live_bytes_at_end, s2.argument_bytes) == \
        (s1.peak_bytes, s1.peak_index, s1.live_bytes_at_end, s1.argument_bytes)
    assert s2.peak_at is s1.peak_at
    assert s1.record == "full" and len(s1.timeline) == len(s1.instr_times) > 0
    assert s2.record == "peak" and s2.timeline == [] and s2.instr_times == [] and s2.time_by_op() == {}


def all_samples_program(rng: np.random.Generator) -> tuple[Function, list[np.ndarray]]:
    """One function running every sample of every op (irgen's op list) on its own parameters;
    returns all results: mixed dialects, views, in-place updates, multi-result and random ops."""
    work = [(name, s) for name in sampled_ops() for s in OPS[name].sample(rng)]
    args = [a for _, s in work for a in s.args]
    f = Function("f", [TensorType(DType.from_numpy(a.dtype), a.shape) for a in args], [])
    b = Builder(f.entry)
    outs, k = [], 0
    for name, s in work:
        ins = b.create(name, f.params[k:k + len(s.args)], s.attrs)
        k += len(s.args)
        outs += ins.results
    f.result_types = [v.type for v in outs]
    b.ret(*outs)
    Module([f])
    return f, args


@pytest.mark.parametrize("dialects", [None, "numpy", "torch"])
def test_peak_mode_matches_full_mode_on_every_op_sample(dialects):
    rng = np.random.default_rng(0)
    f, args = all_samples_program(rng)
    if dialects == "torch":  # ops torch does not take fall back to numpy: mixed dialects, conversions
        vm = remat.VM(remat.backends.assign_dialects(Module([f.clone()]), ("torch", "numpy")))
    else:
        vm = remat.VM(f.module, dialects=dialects)
    for donate in (False, True):
        full, peak = run_both(vm, "f", args, donate=donate)
        assert_same(full, peak)
        assert peak[1].peak_bytes == predict_peak(vm.function("f"), donate=donate)


@pytest.mark.parametrize("seed", range(24))
def test_peak_mode_matches_full_mode_on_generated_programs(seed):
    rng = np.random.default_rng(seed)
    f = random_program(rng, int(rng.integers(3, 25)))
    args = [rng.uniform(-1, 1, t.shape).astype(np.float32) for t in f.param_types]
    vm = remat.VM(f.module, dialects=["numpy", "torch", None][seed % 3])
    for donate in (False, True):
        for outputs in ("numpy", "torch"):
            full, peak = run_both(vm, "f", args, donate=donate, outputs=outputs)
            assert_same(full, peak)
            assert peak[1].peak_bytes == predict_peak(f, donate=donate)


BRANCHES_AND_CALLS = """func @inner(%0: f32[100], %1: f32[100]) -> f32[100] {
  %2 = mul %0, %1 : f32[100]
  %3 = exp %2 : f32[100]
  return %3
}

func @outer(%0: f32[100], %1: bool[]) -> f32[100] {
  %2 = neg %0 : f32[100]
  cond_br %1, ^bb1, ^bb2
^bb1:
  %3 = call @inner(%0, %2) : f32[100]
  br ^bb3(%3)
^bb2:
  %4 = sin %2 : f32[100]
  br ^bb3(%4)
^bb3(%5: f32[100]):
  %6 = call @inner(%5, %5) : f32[100]
  %7 = reshape %6 {shape=[10,10]} : f32[10,10]
  %8 = reshape %7 {shape=[100]} : f32[100]
  %9 = add %8, %0 : f32[100]
  return %9
}
"""


@pytest.mark.parametrize("dialects", ["numpy", "torch"])
def test_peak_mode_matches_full_mode_with_branches_and_calls(dialects):
    vm = remat.VM(parse(BRANCHES_AND_CALLS), dialects=dialects)
    x = np.linspace(-1, 1, 100).astype(np.float32)
    for cond in (True, False):
        for donate in (False, True):
            full, peak = run_both(vm, "outer", [x, np.array(cond)], donate=donate)
            assert_same(full, peak)
            # x, neg (or sin) and the callee's mul live at once (exp writes over mul: remat.ir.reuse);
            # the bool dies at the branch when donated.
            assert peak[1].peak_bytes == 3 * 400 + (0 if donate else 1)


def test_peak_mode_matches_full_mode_on_a_zoo_training_step():
    torch.manual_seed(0)
    model, ex, loss_fn = zoo.make("gpt", "tiny")  # dropout on: random ops replay from the seed argument
    step = remat.compile(model, ex, loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    args = step.binding.step_args(ex, copy=True, step=1)
    full, peak = run_both(step.vm, step.program.name, args, outputs="torch")
    assert_same(full, peak)
    assert peak[1].peak_bytes == step.predicted_peak
    for a, b in zip(full[0], peak[0]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- contracts, in both modes
def one_op(name: str, in_shape: tuple[int, ...] = (N,), **attrs) -> Function:
    f = Function("f", [F(*in_shape)], [])
    b = Builder(f.entry)
    r = b.op(name, f.params[0], **attrs)
    f.result_types = [r.type]
    b.ret(r)
    Module([f])
    return f


def vm_with_kernel(f: Function, kernel, dialect: str = "torch") -> remat.VM:
    vm = remat.VM(f.module, dialects=dialect)
    vm._plans["f"].blocks[0].steps[0].fn = kernel
    return vm


MISBEHAVING = {
    "returns its operand": lambda x: x,
    "returns a non-contiguous tensor": lambda x: torch.stack([torch.exp(x), x], 1)[:, 0],
    "returns a view at an offset of a larger buffer": lambda x: torch.cat([x, torch.exp(x)])[N:],
    "returns the front of a larger buffer": lambda x: torch.cat([torch.exp(x), x])[:N],
}


@pytest.fixture(params=["full", "peak", "peak, generated"])
def record(request, monkeypatch):
    """The recording level of the runs; "peak, generated": lean runs of eligible functions take their
    generated straight-line form from the first run on (``remat.runtime.straight``)."""
    if request.param == "peak, generated":
        monkeypatch.setattr("remat.runtime.straight.INTERPRETED_RUNS", 0)
    return request.param


def level(record: str) -> str:
    return record.split(",")[0]


def check_generated(vm: remat.VM, record: str) -> None:
    """With "peak, generated", the run took the generated function (the general path for a result
    included)."""
    if record == "peak, generated":
        assert callable(vm._plans["f"].straight)


@pytest.mark.parametrize("how", list(MISBEHAVING))
def test_misbehaving_outputs_are_copied_so_accounting_stays_exact(how, record):
    f = one_op("exp")
    vm = vm_with_kernel(f, MISBEHAVING[how])
    x = torch.linspace(-1, 1, N)
    (o,), st = vm.run("f", x, outputs="torch", record=level(record))
    check_generated(vm, record)
    assert o.is_contiguous() and o.untyped_storage().nbytes() == 4 * N
    assert o.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(o, MISBEHAVING[how](x.clone()))
    assert st.peak_bytes == 8000 == predict_peak(f)


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_view_returning_a_copy_and_wrong_types_are_errors(dialect, record):
    f = one_op("reshape", (10, 100), shape=[N])
    copy = (lambda x, shape: x.reshape(shape).copy()) if dialect == "numpy" else \
        (lambda x, shape: x.reshape(shape).clone())
    x = np.zeros((10, 100), np.float32)
    for kernel, error in [(copy, "must share the storage of operand 0"),
                          ((lambda x, shape: x.reshape(shape).astype(np.float64)) if dialect == "numpy" else
                           (lambda x, shape: x.reshape(shape).double()),
                           rf"{dialect}\.reshape.*instruction 0.*should be f32\[1000\].*float64"),
                          (lambda x, shape: x[:10], r"should be f32\[10,10\]|should be f32\[1000\]")]:
        vm = vm_with_kernel(f, kernel, dialect)
        with pytest.raises(RuntimeError, match=error):
            vm.run("f", x, record=level(record))
        if dialect == "torch":
            check_generated(vm, record)


def test_record_level_is_checked_and_reported():
    f = one_op("exp")
    x = np.zeros(N, np.float32)
    with pytest.raises(ValueError, match=r"record must be one of 'full', 'peak', got 'fast'"):
        remat.run(f, x, record="fast")
    with pytest.raises(ValueError, match="on_step needs record='full'"):
        remat.VM(f.module).run("f", x, on_step=print, record="peak")
    (_,), st = remat.run(f, x, record="peak")
    assert st.peak_bytes == 8000 and st.peak_index == 0 and st.peak_at.op.name == "exp"
    assert "peak only recorded" in str(st) and "8000 bytes" in str(st)


def test_operands_of_the_kernels_own_dialect_are_not_converted():
    f = Function("f", [F(N)], [F(N)])
    b = Builder(f.entry)
    y = b.op("exp", f.params[0])
    z = b.op("neg", y)
    b.ret(b.op("add", y, z))
    mod = remat.backends.assign_dialects(Module([f]), ("torch",))
    mod["f"].entry.instrs[1].dialect = "numpy"  # neg runs in numpy: add must convert z, not y
    vm = remat.VM(mod, dialects=("torch", "numpy"))
    steps = vm._plans["f"].blocks[0].steps
    assert [s.convs is None for s in steps[:3]] == [True, False, False]
    assert steps[2].convs[0] is None and steps[2].convs[1] is not None
    x = np.linspace(-1, 1, N).astype(np.float32)
    for record in ("full", "peak"):
        (o,), st = vm.run("f", x, record=record)
        np.testing.assert_allclose(o, np.exp(x) - np.exp(x), atol=0)
        assert st.peak_bytes == predict_peak(f) == 12000  # add writes over y (remat.ir.reuse)


@pytest.mark.parametrize("name,size,budget", [("gpt", "tiny", None), ("resnet", "tiny", None), ("unet", "small", 0.6)])
def test_lean_runs_of_training_steps_are_generated_and_equal_the_interpreters(name, size, budget):
    """A training step's lean runs take its generated straight-line function (``remat.runtime.straight``)
    after the first ``INTERPRETED_RUNS``: the same results bit for bit, the same measured bytes, peak and
    instruction of the peak as the interpreter's lean run and its full one."""
    from remat.runtime.straight import INTERPRETED_RUNS

    torch.manual_seed(0)
    model, ex, loss_fn = zoo.make(name, size)
    step = remat.compile(model, ex, loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         budget=budget)
    vm, fn = step.vm, step.program.name
    args = step.binding.step_args(ex, copy=True, step=1)
    plan = vm._plans[fn]
    for _ in range(INTERPRETED_RUNS):
        full, interpreted = run_both(vm, fn, args, outputs="torch")
        assert plan.straight is None
    full, generated = run_both(vm, fn, args, outputs="torch")
    assert callable(plan.straight), "the step's lean run was interpreted"
    vm.straight_runs, plan.straight = False, None
    try:
        never = run_both(vm, fn, args, outputs="torch")[1]
        assert plan.straight is False
    finally:
        vm.straight_runs, plan.straight = True, None
    for lean in (generated, interpreted, never):
        assert_same(full, lean)
        for a, b in zip(full[0], lean[0]):
            assert torch.equal(a, b)
    assert generated[1].peak_bytes == step.predicted_peak
