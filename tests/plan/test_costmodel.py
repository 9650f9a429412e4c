"""The static cost model reads only the op registry: every op declares its cost rule (tests
generated over all ops); views, constants and control ops declare no arithmetic."""
from __future__ import annotations

import numpy as np
import pytest

import remat  # noqa: F401  (declares every op)
from remat.ir import OPS, Builder, DType, Function, TensorType
from remat.plan import costmodel


def _sample_instructions(name: str):
    op = OPS[name]
    for s in op.sample(np.random.default_rng(0)):
        types = [TensorType(DType.from_numpy(np.asarray(a).dtype), np.shape(a)) for a in s.args]
        attrs = op.check_attrs(types, s.attrs)
        f = Function("f", types, list(op.result_types(types, attrs)))
        yield Builder(f.entry).create(name, f.params, attrs)


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_declares_a_cost_rule(name):
    assert OPS[name].flops is not None, (f"op '{name}' declares no cost rule: add flops= to its OpDef "
                                         "(helpers: max_numel, per_output, no_flops in remat.ir.ops._util)")


@pytest.mark.parametrize("name", sorted(n for n, o in OPS.items() if o.sample is not None))
def test_cost_rule_prices_the_samples(name):
    """Each sample gets a finite, non-negative estimate; views and constants cost no arithmetic."""
    op = OPS[name]
    for ins in _sample_instructions(name):
        f = costmodel.flops(ins)
        assert np.isfinite(f) and f >= 0.0
        if op.has("view") or op.has("constant"):
            assert f == 0.0
        else:
            assert f > 0.0


def test_an_op_without_a_cost_rule_is_an_error_naming_it():
    ins = next(_sample_instructions("exp"))
    rule, ins.op.flops = ins.op.flops, None
    try:
        with pytest.raises(ValueError, match="'exp' declares no cost rule"):
            costmodel.flops(ins)
    finally:
        ins.op.flops = rule


def test_control_ops_carry_the_control_tag_and_cost_nothing():
    control = {n for n, o in OPS.items() if o.has("control")}
    assert control == {"call", "br", "cond_br", "return", "free"}
    assert all(OPS[n].flops([], [], {}) == 0.0 for n in control)


def _chain(n: int) -> Function:
    """``n`` element-wise instructions of one signature, then one of another (a larger tensor)."""
    t, big = TensorType(DType.f32, (4, 8)), TensorType(DType.f32, (64, 8))
    f = Function("f", [t, big], [t, big])
    b = Builder(f.entry)
    x = f.params[0]
    for _ in range(n):
        x = b.create("relu", [x], {}).results[0]
    y = b.create("relu", [f.params[1]], {}).results[0]
    b.ret(x, y)
    return f


def test_measured_signatures_price_what_the_costs_lack_once_per_signature():
    """A profiled compile's cost model prices an instruction its measured costs lack by measuring it:
    once per signature (however many instructions and cost models ask), none where it cannot
    (the static estimate then)."""
    fn = _chain(3)
    asked: list[list] = []

    def measure(instrs):
        asked.append(list(instrs))
        return [None if ins.operands[0].type.shape[0] == 64 else 1e-3 for ins in instrs]

    measured = costmodel.MeasuredSignatures(measure)
    first = fn.entry.instrs[0]
    model = costmodel.CostModel({first: 5e-3}, measured)  # the first relu's signature: known
    big = fn.entry.instrs[3]
    assert model.program_cost(fn) == pytest.approx(3 * 5e-3 + costmodel.instruction_cost(big))
    assert [len(a) for a in asked] == [1] and asked[0][0] is big  # only the unknown signature, once
    other = costmodel.CostModel({}, measured)  # another cost model of the compile: nothing measured again
    assert other.program_cost(fn) == pytest.approx(3 * 1e-3 + costmodel.instruction_cost(big))
    assert [len(a) for a in asked] == [1, 1] and measured.measured_alone == 1
    assert other.program_cost(fn) == pytest.approx(3 * 1e-3 + costmodel.instruction_cost(big))
    assert len(asked) == 2


def test_recorded_seconds_are_not_measured_again():
    fn = _chain(2)
    measured = costmodel.MeasuredSignatures(lambda instrs: pytest.fail(f"measured {instrs}"))
    measured.record({fn.entry.instrs[0]: 2e-3, fn.entry.instrs[2]: 7e-3})
    assert costmodel.CostModel({}, measured).program_cost(fn) == pytest.approx(2 * 2e-3 + 7e-3)


def test_without_measurements_the_static_estimate_prices_the_rest():
    fn = _chain(2)
    model = costmodel.CostModel({fn.entry.instrs[0]: 1.0})
    assert model.program_cost(fn) == pytest.approx(2.0 + costmodel.instruction_cost(fn.entry.instrs[2]))


def test_dispatch_prices_every_instruction_a_run_dispatches():
    """The VM's time beyond the priced instructions' own, measured on a run, is spread over every
    instruction it dispatched, so a run of the same program is priced at its measured total."""
    fn = _chain(2)
    costs = {ins: 1e-3 for ins in fn.entry.instrs if ins.op.name != "return"}
    measured = costmodel.MeasuredSignatures(lambda instrs: pytest.fail(f"measured {instrs}"))
    measured.record(costs)
    measured.set_dispatch(fn, costs, 3e-3 + 3 * 2e-6)  # three instructions, 2 µs each beyond their times
    assert measured.dispatch == pytest.approx(2e-6)
    assert costmodel.CostModel(costs, measured).program_cost(fn) == pytest.approx(3e-3 + 3 * 2e-6)
