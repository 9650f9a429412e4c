"""Dominance (remat.ir.dominance) against its definition on random control-flow graphs, and the
verifier's cost: one message per error, each showing a few lines of context."""
from __future__ import annotations

import numpy as np
import pytest

from remat.ir import Builder, DType, Function, TensorType, VerificationError, parse, verify
from remat.ir.core import Block
from remat.ir.dominance import DominatorTree, dominators, reachable

F2 = TensorType(DType.f32, (2,))


def random_cfg(rng: np.random.Generator, n: int) -> Function:
    """A function of ``n`` blocks with random branches (loops, joins, unreachable blocks)."""
    f = Function("f", [TensorType(DType.bool, ())], [])
    blocks = [f.entry] + [f.add_block(Block()) for _ in range(n - 1)]
    cond = f.params[0]
    for b in blocks:
        targets = [blocks[int(k)] for k in rng.integers(1, n, size=int(rng.integers(0, 3)))] if n > 1 else []
        bb = Builder(b)
        if not targets:
            bb.ret()
        elif len(targets) == 1:
            bb.br(targets[0])
        else:
            bb.cond_br(cond, targets[0], [], targets[1], [])
    return f


def reaches_without(f: Function, removed: Block | None) -> set[Block]:
    """Blocks reachable from the entry when ``removed`` is taken out (the definition of dominance)."""
    seen, stack = set(), [f.entry] if f.entry is not removed else []
    while stack:
        b = stack.pop()
        if b in seen:
            continue
        seen.add(b)
        t = b.terminator
        stack.extend(s.block for s in (t.successors if t else ()) if s.block is not removed)
    return seen


@pytest.mark.parametrize("seed", range(40))
def test_dominates_matches_the_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    f = random_cfg(rng, int(rng.integers(1, 12)))
    verify(f)
    tree, reach = DominatorTree(f), reachable(f)
    assert reach == reaches_without(f, None)
    sets = dominators(f)
    for a in f.blocks:
        cut = reaches_without(f, a)
        for b in f.blocks:
            want = b in reach and a in reach and (a is b or b not in cut)
            assert tree.dominates(a, b) == want
            if b in reach:
                assert (a in sets[b]) == want


def test_long_chain_needs_no_recursion() -> None:
    """Dominance of a 20,000-block chain: iterative throughout (no recursion limit)."""
    n = 20_000
    blocks = "".join(f"^b{k}(%v{k}: f32[2]):\n  br ^b{k + 1}(%v{k})\n" for k in range(1, n))
    f = parse(f"func @f(%0: f32[2]) -> f32[2] {{\n  br ^b1(%0)\n{blocks}^b{n}(%v{n}: f32[2]):\n  return %v{n}\n}}\n")["f"]
    tree = DominatorTree(f)
    assert tree.dominates(f.blocks[1], f.blocks[-1]) and not tree.dominates(f.blocks[-1], f.blocks[1])
    verify(f)


def test_each_error_shows_its_line_in_context_not_the_function() -> None:
    """Many faulty instructions give one message each, each with the offending line marked and at
    most two lines either side (the printed function is made once, not per message)."""
    body = "".join(f"  %{k + 1} = add %0, %0 : f32[3]\n" for k in range(300))
    with pytest.raises(VerificationError) as e:
        verify(parse(f"func @f(%0: f32[2]) -> f32[2] {{\n{body}  return %0\n}}\n"))
    assert len(e.value.errors) == 300
    for k, msg in enumerate(e.value.errors):
        lines = msg.splitlines()
        assert len(lines) <= 6, msg
        assert f"-->   %{k + 1} = add %0, %0 : f32[3]" in msg
