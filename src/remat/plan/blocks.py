"""Cut a model's forward function into a chain of blocks at its separators (thesis §5.2), so the
chain solvers (the thesis's DP and the extended model) can plan a general graph.

A *separator* is a value every path from the data input to the loss passes through (the
outputs of transformer and ResNet blocks). Between consecutive separators lies a stage: a
function ``(model tensors and other inputs it reads..., stage input) -> (stage output, side
outputs...)``. Values that depend only on parameters (a transposed weight, a causal mask) are
recomputed inside each stage that reads them; side outputs (batch-norm running statistics) are
computed by the stage holding their data. A tied weight read by several stages receives the sum of
their gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

from .chain.executor import Binding, ChainStage, make_stage
from ..ir import Function, Instruction, Value
from ..ir.core import BlockArg
from .graph import Graph
from ..ir.analysis import ancestors
from ..ir.build import slice_function
from .separators import find_separators


@dataclass
class Blocks:
    """The stages of a forward function and how they bind to its parameters."""

    stages: list[ChainStage]
    binding: Binding
    aux_order: list[int]  # forward-output index (1-based among side outputs) of each stage side output, in order


def _deps(body: list[Instruction], roots: set[Value]) -> set[Value]:
    dep = set(roots)
    for ins in body:
        if any(o in dep for o in ins.operands):
            dep.update(ins.results)
    return dep


def cut(forward: Function, data_index: int, n_trainable: int, max_stages: int = 48,
        min_stages: int = 3, min_blocks: int = 12, backward_kept_only: bool = True) -> Blocks | None:
    """Stages of ``forward: (params..., other args...) -> (loss, side outputs...)`` along the data
    input ``forward.params[data_index]``, or None when the graph has too few separators.

    ``backward_kept_only``: cut only at separators the backward keeps anyway (topped up to
    ``min_blocks`` with others); otherwise at every separator (finer blocks, more to hold)."""
    if len(forward.blocks) != 1:
        return None
    body = forward.entry.instrs[:-1]
    ret = forward.entry.instrs[-1]
    loss, side = ret.operands[0], list(ret.operands[1:])
    x = forward.params[data_index]
    dep_x = _deps(body, {x})
    if loss not in dep_x:
        return None
    # Instructions on the way to the loss that depend on the data: the separation criterion.
    anc = ancestors([loss])
    considered = [ins for ins in body if ins in anc and ins.results[0] in dep_x]
    g = Graph()
    pos_in = {ins: i for i, ins in enumerate(body)}
    node: dict[Value, int] = {x: g.add_input("x", x.type.nbytes)}
    for ins in considered:
        r = ins.results[0]
        node[r] = g.add_node(f"%{pos_in[ins]}:{ins.op.name}", 0.0, r.type.nbytes,
                             sorted({node[o] for o in ins.operands if o in node}))
    seps = [considered[k - 1] for k in find_separators(g)]  # node k is considered[k - 1]
    # The chain model keeps a stage's output until that stage's backward: cut only where the
    # backward keeps the value anyway (an input a consumer's VJP saves, or an output its own op
    # saves), so that requirement costs nothing the unsplit program would not hold too.
    consumers: dict[Value, list[Instruction]] = {}
    for ins in body:
        for o in ins.operands:
            consumers.setdefault(o, []).append(ins)
    kept = [s for s in seps if _kept_by_backward(s.results[0], consumers)] if backward_kept_only else list(seps)
    if len(kept) < min_blocks:
        # Too coarse: add evenly spaced other separators (each costs holding one activation longer).
        rest = [s for s in seps if s not in set(kept)]
        want = min(len(rest), min_blocks - len(kept))
        extra = [rest[round(i * (len(rest) - 1) / max(want - 1, 1))] for i in range(want)] if want else []
        kept = sorted(set(kept) | set(extra), key={ins: i for i, ins in enumerate(body)}.__getitem__)
    seps = kept
    if not seps or seps[-1].results[0] is not loss:
        seps.append(loss.instr)
    pos = {ins: i for i, ins in enumerate(body)}
    # Keep at most ``max_stages`` boundaries, spread evenly over the instruction positions.
    if len(seps) > max_stages:
        keep = [seps[round(i * (len(seps) - 1) / (max_stages - 1))] for i in range(max_stages)]
        seps = sorted(set(keep), key=pos.__getitem__)
    if len(seps) < min_stages:
        return None
    bounds = [x] + [s.results[0] for s in seps]
    # Side outputs go to the stage holding the latest loss-path data value they read.
    on_path = set(considered)
    stage_of_pos = [pos[s] for s in seps]

    def stage_for(v: Value) -> int:
        latest = -1
        seen, st = set(), [v]
        while st:
            u = st.pop()
            if u in seen or isinstance(u, BlockArg):
                continue
            seen.add(u)
            if u.instr in on_path:  # position among the loss-path data values it reads
                latest = max(latest, pos[u.instr])
                if u in bounds:
                    continue
            st.extend(u.instr.operands)
        for k, p in enumerate(stage_of_pos):
            if latest <= p:
                return k
        return len(seps) - 1

    aux_of: dict[int, list[int]] = {}
    for j, v in enumerate(side):
        aux_of.setdefault(stage_for(v), []).append(j)
    others = [p for i, p in enumerate(forward.params) if i != data_index]
    stages, leads, aux_order = [], [], []
    for k in range(len(seps)):
        vin, vout = bounds[k], bounds[k + 1]
        results = [vout] + [side[j] for j in aux_of.get(k, [])]
        try:
            full = slice_function(f"stage{k + 1}", others + [vin], body, results)
        except ValueError:
            return None  # a value crosses a boundary other than through a separator
        used = _used_params(full)
        lead_vals = [others[i] for i in range(len(others)) if i in used]
        fn = slice_function(f"stage{k + 1}", lead_vals + [vin], body, results)
        lead = [forward.params.index(v) for v in lead_vals]
        grad_pos = tuple(i for i, p in enumerate(lead) if p < n_trainable)
        stage = make_stage(f"stage{k + 1}", fn, len(lead), grad_pos, diff_input=vin.type.dtype.is_float)
        stages.append(stage)
        leads.append(lead)
        aux_order += aux_of.get(k, [])
    binding = Binding(list(forward.param_types), leads, data_index, list(range(n_trainable)))
    return Blocks(stages, binding, aux_order)


def _kept_by_backward(v: Value, consumers: dict[Value, list[Instruction]]) -> bool:
    from ..ir.ops._vjp import saved_indices

    ins = v.instr
    if ins.op.vjp is not None and v.index in saved_indices(ins.op.vjp_saves, len(ins.operands),
                                                           len(ins.results), ins.attrs)[1]:
        return True
    for c in consumers.get(v, []):
        if c.op.vjp is None:
            continue
        idx, _ = saved_indices(c.op.vjp_saves, len(c.operands), len(c.results), c.attrs)
        if any(c.operands[i] is v for i in idx):
            return True
    return False


def _used_params(fn: Function) -> set[int]:
    used = set()
    for ins in fn.entry.instrs:
        for o in ins.operands:
            if isinstance(o, BlockArg) and o.block is fn.entry:
                used.add(o.index)
    return used
