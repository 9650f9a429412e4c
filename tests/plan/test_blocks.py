"""Cutting a forward into a chain of blocks (``remat.plan.blocks``): repeated layers are the same
block up to renaming (values and random-stream salts), differentiated once; the work of cutting
grows with the forward's size, not its square. Work is counted, never timed."""
from __future__ import annotations

import re

import pytest

import remat.plan.blocks as blocks
from remat.ir import parse
from remat.plan.blocks import canonical_key, cut
from remat.plan.chain.executor import make_stage
from remat.plan.portfolio import plan_step
from remat.plan.simulator import predict_peak

WIDTH, BATCH = 16, 8


def _forward(depth: int, salted: bool = True) -> str:
    """``(w0..w{depth-1}, seed, x) -> loss``: depth layers ``x + tanh(x @ w) * mask``, each with its own
    dropout-like mask drawn from ``fold_seed(seed, salt=k)`` (the same salt for all when not ``salted``)."""
    ws = ", ".join(f"%w{k}: f32[{WIDTH},{WIDTH}]" for k in range(depth))
    lines = [f"func @f({ws}, %s: i64[], %x: f32[{BATCH},{WIDTH}]) -> f32[] {{",
             f"  %e = tanh %x : f32[{BATCH},{WIDTH}]"]  # (the cut does not see residual edges from the input itself)
    h = "%e"
    for k in range(depth):
        t = f"f32[{BATCH},{WIDTH}]"
        lines += [f"  %m{k} = matmul {h}, %w{k} : {t}", f"  %t{k} = tanh %m{k} : {t}",
                  f"  %k{k} = fold_seed %s {{salt={k + 1 if salted else 1}}} : i64[]",
                  f"  %b{k} = bernoulli %k{k} {{shape=[{BATCH}, {WIDTH}], p=0.9}} : bool[{BATCH},{WIDTH}]",
                  f"  %z{k} = constant {{value=0.0, shape=[], dtype=f32}} : f32[]",
                  f"  %d{k} = select %b{k}, %t{k}, %z{k} : {t}", f"  %h{k} = add {h}, %d{k} : {t}"]
        h = f"%h{k}"
    lines += [f"  %l = reduce_sum {h} {{axes=[0, 1]}} : f32[]", "  return %l", "}"]
    return "\n".join(lines) + "\n"


def _cut(depth: int, **kw):
    fn = parse(_forward(depth))["f"]
    return cut(fn, depth + 1, depth, backward_kept_only=False, min_blocks=1, max_stages=10 ** 6, **kw)


def test_repeated_layers_share_one_differentiation(monkeypatch):
    calls = []
    monkeypatch.setattr(blocks, "make_stage", lambda *a, **k: calls.append(a[0]) or make_stage(*a, **k))
    b = _cut(12)
    assert b is not None and len(b.stages) >= 12
    # One differentiation per distinct block, however deep the chain.
    assert len(calls) == b.n_distinct < 6
    calls.clear()
    assert _cut(24).n_distinct == b.n_distinct and len(calls) == b.n_distinct


def test_a_capped_cut_keeps_repeated_layers_identical(monkeypatch):
    """A model deeper than ``max_stages`` allows is cut at every k-th separator, so its stages stay
    the same block: differentiated once each, however many layers (counted, not timed)."""
    calls = []
    monkeypatch.setattr(blocks, "make_stage", lambda *a, **k: calls.append(a[0]) or make_stage(*a, **k))
    for depth in (40, 97):
        calls.clear()
        fn = parse(_forward(depth))["f"]
        b = cut(fn, depth + 1, depth, backward_kept_only=False, min_blocks=1, max_stages=12)
        assert b is not None and 6 <= len(b.stages) <= 12
        assert len(calls) == b.n_distinct <= 3, (depth, b.kinds)  # the first, the repeated, the last
        assert len(set(b.kinds[1:-1])) == 1


def test_blocks_differing_only_in_provenance_are_one_block(monkeypatch):
    """Layers print their module path (``// loc(...)``), which is not IR: they share one
    differentiation, and each stage keeps its own layer's provenance."""
    calls = []
    monkeypatch.setattr(blocks, "make_stage", lambda *a, **k: calls.append(a[0]) or make_stage(*a, **k))
    depth = 8
    lines = [line + (f'  // loc("layers.{m.group(1)}", "m.py":3)' if (m := re.match(r"  %[a-z](\d+) =", line)) else "")
             for line in _forward(depth).splitlines()]
    fn = parse("\n".join(lines) + "\n")["f"]
    assert len({ins.loc.path for ins in fn.entry.instrs if ins.loc is not None}) == depth
    b = cut(fn, depth + 1, depth, backward_kept_only=False, min_blocks=1, max_stages=10 ** 6)
    assert len(calls) == b.n_distinct < 6
    for st in b.stages:
        own = {ins.loc.path for ins in st.split.forward.entry.instrs if ins.loc is not None}
        assert own == {ins.loc.path for ins in st.forward.entry.instrs if ins.loc is not None}
    paths = [frozenset(ins.loc.path for ins in st.split.backward.entry.instrs if ins.loc is not None) for st in b.stages]
    assert len(set(p for p in paths if p)) >= depth - 1  # each layer's backward names its own layer


def test_shared_blocks_equal_their_own_differentiation():
    """A repeat's forward and split, renamed from the first block, print exactly as differentiating
    the repeat itself would give (salts included)."""
    b = _cut(6)
    fwd = parse(_forward(6))["f"]
    for st in b.stages:
        own = make_stage(st.name, st.forward, st.n_params, st.grad_params, diff_input=True)
        for part in ("forward", "forward_light", "backward"):
            assert str(getattr(own.split, part)) == str(getattr(st.split, part)), (st.name, part)
    salts = {ins.attrs["salt"] for st in b.stages for ins in st.split.forward.entry.instrs if "salt" in ins.attrs}
    assert salts == {ins.attrs["salt"] for ins in fwd.entry.instrs if "salt" in ins.attrs}


def test_canonical_key_ignores_names_and_salts_only():
    b = _cut(4)
    mids = [st for st, k in zip(b.stages, b.kinds) if b.kinds.count(k) > 1]
    assert len(mids) >= 2
    k0 = canonical_key(mids[0].forward, mids[0].n_params, mids[0].grad_params, True)
    assert k0 == canonical_key(mids[1].forward, mids[1].n_params, mids[1].grad_params, True)
    assert k0 != canonical_key(mids[0].forward, mids[0].n_params, (), True)  # what gets gradients matters
    other = parse(_forward(4).replace("tanh", "sigmoid"))["f"]
    ob = cut(other, 5, 4, backward_kept_only=False, min_blocks=1, max_stages=10 ** 6)
    assert canonical_key(ob.stages[1].forward, ob.stages[1].n_params, ob.stages[1].grad_params, True) != \
        canonical_key(b.stages[1].forward, b.stages[1].n_params, b.stages[1].grad_params, True)


@pytest.mark.parametrize("depth", [8, 32])
def test_cutting_copies_each_instruction_a_bounded_number_of_times(monkeypatch, depth):
    """Slicing the stages copies O(forward size) instructions (each layer's few, plus the
    parameter-only values a stage recomputes), not O(size x stages)."""
    copied = []
    orig = blocks.clone_into
    monkeypatch.setattr(blocks, "clone_into", lambda b, ins, vmap: copied.append(ins) or orig(b, ins, vmap))
    fn = parse(_forward(depth))["f"]
    b = cut(fn, depth + 1, depth, backward_kept_only=False, min_blocks=1, max_stages=10 ** 6)
    n = len(fn.entry.instrs)
    assert len(b.stages) >= depth
    assert len(copied) <= 2 * n
    assert len(set(copied)) == len(copied) or len(copied) - len(set(copied)) <= 2 * len(b.stages)


def test_plans_of_a_repeated_chain_fit_and_report_the_chain():
    """End to end through ``plan_step``: the plan fits, and the notes account for the chain of blocks
    (the winner, a loser with its overhead, or why none was planned)."""
    from tests.plan.test_plan_stage import _problem

    base = _problem(None)
    peak = predict_peak(base.unconstrained)
    budget = int(peak * 0.9)
    cand = plan_step(_problem(budget))
    assert predict_peak(cand.program) <= budget
    assert cand.solver != "none"
    assert any("chain" in n for n in cand.notes)
