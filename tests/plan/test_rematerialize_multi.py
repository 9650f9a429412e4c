"""Instruction-level rematerialisation of multi-result instructions (normalisations: output and
statistics): one graph node per result, one execution for their first computation, a re-run
when a freed result is needed again, and the same values either way."""
from __future__ import annotations

import numpy as np

from remat.ir import Builder, DType, Function, Module, TensorType
from remat.plan.graph import COMPUTE, FREE
from remat.plan.liveness import predict_peak
from remat.plan.rematerialize import from_schedule, to_graph
from remat.runtime.vm import VM


def _bn_function() -> Function:
    t = TensorType(DType.f64, (4, 3, 2))
    v = TensorType(DType.f64, (3,))
    f = Function("f", [t, v, v])
    b = Builder(f.entry)
    y, mean, invstd = b.op("batch_norm", *f.params)
    z = b.op("relu", y)
    s = b.op("add", b.op("reduce_sum", z, axes=[0, 2]), b.op("mul", mean, invstd))
    f.result_types = [s.type]
    b.ret(s)
    return f


def _run(fn: Function, args):
    vm = VM(Module([fn]), dialects=("numpy",))
    out, stats = vm.run(fn.name, *args)
    return out, stats


def test_one_node_per_result_and_one_execution_in_order():
    f = _bn_function()
    low = to_graph(f)
    names = [low.graph[i].name for i in low.graph.compute_nodes]
    assert [n for n in names if "batch_norm" in n] == ["%0:batch_norm#0", "%0:batch_norm#1", "%0:batch_norm#2"]
    sched = [(COMPUTE, i) for i in low.graph.compute_nodes]
    g = from_schedule(low, sched)
    assert [i.op.name for i in g.entry.instrs].count("batch_norm") == 1


def test_a_freed_statistic_needed_again_reruns_the_instruction():
    f = _bn_function()
    low = to_graph(f)
    node = {low.graph[i].name: i for i in low.graph.compute_nodes}
    bn0, bn1, bn2 = node["%0:batch_norm#0"], node["%0:batch_norm#1"], node["%0:batch_norm#2"]
    rest = [i for i in low.graph.compute_nodes if i not in (bn0, bn1, bn2)]
    relu, rsum, mul, add = rest
    sched = [(COMPUTE, bn0), (COMPUTE, bn1), (FREE, bn1), (COMPUTE, relu), (FREE, bn0), (COMPUTE, rsum),
             (FREE, relu), (COMPUTE, bn1), (COMPUTE, bn2), (COMPUTE, mul), (FREE, bn1), (FREE, bn2),
             (COMPUTE, add)]
    g = from_schedule(low, sched)
    assert [i.op.name for i in g.entry.instrs].count("batch_norm") == 2
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((4, 3, 2)), rng.uniform(0.5, 1.5, 3), rng.standard_normal(3)]
    want, _ = _run(f, args)
    got, stats = _run(g, args)
    np.testing.assert_array_equal(got[0], want[0])
    assert stats.peak_bytes == predict_peak(g)
