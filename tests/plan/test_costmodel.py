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
