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

from dataclasses import dataclass, field, replace

from .chain.executor import Binding, ChainStage, make_stage
from ..ir import Builder, Function, Instruction, Value
from ..ir.core import BlockArg, Loc
from .graph import Graph
from ..ir.analysis import ancestors
from ..ir.build import clone_into
from .separators import find_separators


@dataclass
class Blocks:
    """The stages of a forward function and how they bind to its parameters."""

    stages: list[ChainStage]
    binding: Binding
    aux_order: list[int]  # forward-output index (1-based among side outputs) of each stage side output, in order
    kinds: list[int] = field(default_factory=list)  # stage k is the kinds[k]-th distinct block (same IR up to renaming)

    @property
    def n_distinct(self) -> int:
        return len(set(self.kinds))


StageCache = dict[str, tuple[ChainStage, list[int], int, list]]
"""Differentiated blocks by canonical text: (the stage, its salts in order, its kind number, the
provenance of its sliced forward's instructions)."""


def _salts(fn: Function) -> list[int]:
    """The random-stream salts ``fn`` uses, in order of first appearance (a ``salt`` attribute names a
    random stream: blocks that differ only in their salts are the same block up to renaming)."""
    out: list[int] = []
    for ins in fn.entry.instrs:
        s = ins.attrs.get("salt")
        if s is not None and s not in out:
            out.append(s)
    return out


def canonical_key(fn: Function, n_lead: int, grad_pos: tuple[int, ...], diff_input: bool) -> str:
    """A text equal for two stage functions exactly when they are the same IR up to the names of
    values, the function's name, the salts of their random streams and the provenance of their
    instructions (printed names are positional; the layer a block came from is not its IR)."""
    canon = fn.clone("block")
    index = {s: i for i, s in enumerate(_salts(fn))}
    for ins in canon.entry.instrs:
        ins.loc = None
        if "salt" in ins.attrs:
            ins.attrs["salt"] = index[ins.attrs["salt"]]
    return f"{n_lead} {grad_pos} {diff_input}\n{canon}"


def _renamed(fn: Function, name: str, salts: dict[int, int], locs: dict[Loc, Loc]) -> Function:
    """A copy of ``fn`` named ``name`` with its salts and provenance renamed through ``salts`` and ``locs``."""
    out = fn.clone(name)
    for ins in out.entry.instrs:
        if "salt" in ins.attrs:
            ins.attrs["salt"] = salts.get(ins.attrs["salt"], ins.attrs["salt"])
        if ins.loc is not None:
            ins.loc = locs.get(ins.loc, ins.loc)
    return out


def _stage(name: str, fn: Function, n_lead: int, grad_pos: tuple[int, ...], diff_input: bool,
           cache: StageCache, split_bn_grad: bool = False) -> tuple[ChainStage, int]:
    """The differentiated stage of ``fn`` and its kind: differentiated once per distinct block, and
    for a repeat, the first one's forward, split and costs with the repeat's name and salts."""
    key = canonical_key(fn, n_lead, grad_pos, diff_input)
    hit = cache.get(key)
    if hit is None:
        stage = make_stage(name, fn, n_lead, grad_pos, diff_input=diff_input, split_bn_grad=split_bn_grad)
        cache[key] = (stage, _salts(fn), len(cache), [ins.loc for ins in fn.entry.instrs])
        return stage, len(cache) - 1
    first, first_salts, kind, first_locs = hit
    ren = dict(zip(first_salts, _salts(fn)))
    # The repeat's own provenance (its layer's path), instruction by instruction: same IR, same order.
    locs = {a: ins.loc for a, ins in zip(first_locs, fn.entry.instrs) if a is not None and ins.loc is not None}
    if all(a == b for a, b in ren.items()) and all(a == b for a, b in locs.items()):
        return replace(first, name=name), kind
    sp = first.split
    split = replace(sp, forward=_renamed(sp.forward, sp.forward.name, ren, locs),
                    forward_light=_renamed(sp.forward_light, sp.forward_light.name, ren, locs),
                    backward=_renamed(sp.backward, sp.backward.name, ren, locs))
    return replace(first, name=name, forward=_renamed(first.forward, name, ren, locs), split=split), kind


def _deps(body: list[Instruction], roots: set[Value]) -> set[Value]:
    dep = set(roots)
    for ins in body:
        if any(o in dep for o in ins.operands):
            dep.update(ins.results)
    return dep


def cut(forward: Function, data_index: int, n_trainable: int, max_stages: int = 48,
        min_stages: int = 3, min_blocks: int = 12, backward_kept_only: bool = True,
        cache: StageCache | None = None, split_bn_grad: bool = False) -> Blocks | None:
    """Stages of ``forward: (params..., other args...) -> (loss, side outputs...)`` along the data
    input ``forward.params[data_index]``, or None when the graph has too few separators.

    ``backward_kept_only``: cut only at separators the backward keeps anyway (topped up to
    ``min_blocks`` with others); otherwise at every separator (finer blocks, more to hold).
    Identical blocks (repeated layers) are differentiated once; ``cache`` shares them between cuts
    (of one ``split_bn_grad``: batch-norm backwards split as the step's joint, the lean algorithm).
    Time: linear in the forward's size plus, per stage, its slice (stages partition the body)."""
    cache = {} if cache is None else cache
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
        kept_set = set(kept)
        rest = [s for s in seps if s not in kept_set]
        want = min(len(rest), min_blocks - len(kept))
        extra = [rest[round(i * (len(rest) - 1) / max(want - 1, 1))] for i in range(want)] if want else []
        kept = sorted(set(kept) | set(extra), key={ins: i for i, ins in enumerate(body)}.__getitem__)
    seps = kept
    if not seps or seps[-1].results[0] is not loss:
        seps.append(loss.instr)
    pos = {ins: i for i, ins in enumerate(body)}
    # Keep at most ``max_stages`` boundaries: every k-th, counted back from the loss, so that the
    # stages of repeated layers hold the same number of separators and stay identical blocks
    # (differentiated and costed once) however deep the model.
    if len(seps) > max_stages:
        k = -(-len(seps) // max_stages)
        seps = seps[(len(seps) - 1) % k::k]
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
    stages, leads, aux_order, kinds = [], [], [], []
    param_pos = {v: i for i, v in enumerate(forward.params)}
    for k in range(len(seps)):
        vin, vout = bounds[k], bounds[k + 1]
        results = [vout] + [side[j] for j in aux_of.get(k, [])]
        needed = ancestors(results, stop=[vin])
        if any(isinstance(r, BlockArg) and r is not vin for r in results) or (
                x is not vin and any(x in ins.operands for ins in needed)):
            return None  # a value crosses a boundary other than through a separator
        used = {o for ins in needed for o in ins.operands if isinstance(o, BlockArg) and o is not vin}
        lead_vals = [p for p in others if p in used]
        fn = _slice(f"stage{k + 1}", lead_vals + [vin], pos, needed, results)
        lead = [param_pos[v] for v in lead_vals]
        grad_pos = tuple(i for i, p in enumerate(lead) if p < n_trainable)
        stage, kind = _stage(f"stage{k + 1}", fn, len(lead), grad_pos, vin.type.dtype.is_float, cache, split_bn_grad)
        stages.append(stage)
        kinds.append(kind)
        leads.append(lead)
        aux_order += aux_of.get(k, [])
    binding = Binding(list(forward.param_types), leads, data_index, list(range(n_trainable)))
    return Blocks(stages, binding, aux_order, kinds)


def _slice(name: str, params: list[Value], pos: dict[Instruction, int], needed: set[Instruction],
           results: list[Value]) -> Function:
    """``slice_function`` with the needed instructions already known (copied in body order ``pos``),
    so that slicing costs the stage's size, not the whole body's."""
    f = Function(name, [p.type for p in params], [r.type for r in results])
    vmap: dict[Value, Value] = dict(zip(params, f.params))
    b = Builder(f.entry)
    for ins in sorted(needed, key=pos.__getitem__):
        clone_into(b, ins, vmap)
    b.ret(*[vmap[r] for r in results])
    return f


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
