"""Fusion (pattern + rule, RAF §3.2.2): DAGs of element-wise instructions become one ``fused`` instruction.

Runs on final straight-line programs (after autodiff and planning; explicit ``free``s and
recomputed clones allowed). A group is a set of fusible instructions connected by producer →
consumer edges such that:

* every member is an element-wise op the fused kernels support bit-exactly on its dtypes
  (``supports``; by default the numba generator's table), never random, a view, in place or an effect,
  or a ``fused`` instruction whose body's nodes all are (batch norm's normalisation, made before
  planning by ``split-batch-norm``): its body is inlined into the group's;
* its *outputs* (member results used outside the group, ignoring ``free``, or returned) all have
  the group's iteration shape, and are used only after the group's last member, where the fused
  instruction is placed; intermediates used only inside the group vanish with their frees;
* no path leaves the group through another instruction and comes back (no cycle once fused).

Rank-0 ``constant`` operands are copied into the body. Frees of the group's operands that fall
inside the group move to just after the fused instruction. A fused instruction holds all its
operands until it ends and allocates all its outputs at once, so fusion can raise the peak: the
pass keeps only groups that leave ``predict_peak`` at or below the unfused program's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..ir import Builder, Function, Instruction, Module, OpResult, Value
from ..ir.ops.fused import Body, Node, fusible_node_op, parse_body
from ..ir.types import DType, broadcast_shapes
from ..plan.simulator import simulate

Supports = Callable[[str, tuple[DType, ...], dict], bool]
Judge = Callable[[Function], "int | None"]
"""A check of a rewritten program beyond its VM peak: None when it is acceptable, else the index of
an instruction where it is not (a rewrite whose span holds it is undone)."""


def _default_supports() -> Supports:
    from ..backends.numba_kernels import node_supported

    return node_supported


@dataclass
class Group:
    """Members in program order, and the iteration shape."""

    members: list[Instruction]
    shape: tuple[int, ...]
    outputs: list[Value] = field(default_factory=list)


@dataclass
class FuseStats:
    """What one run of the pass did (per function)."""

    groups: int = 0
    fused_instructions: int = 0
    instructions_before: int = 0
    instructions_after: int = 0
    dropped_for_peak: int = 0
    member_positions: list[int] = field(default_factory=list)  # fused instructions' indices in the input


def _is_scalar_const(v: Value) -> bool:
    return (isinstance(v, OpResult) and v.instr.op.name == "constant" and v.type.shape == ()
            and v.type.dtype in (DType.f32, DType.f64, DType.bool, DType.i32, DType.i64))


def _fusible(ins: Instruction, supports: Supports) -> bool:
    op = ins.op
    if op.name == "fused":  # a fused instruction already (batch norm's normalisation): its body joins a group
        if len(ins.results) != 1:
            return False
        body = parse_body(ins.attrs["body"])
        vals = body.value_types([v.type for v in ins.operands])
        return all(supports(n.op, tuple(vals[a].dtype for a in n.args), n.attr_dict) for n in body.nodes)
    if len(ins.results) != 1 or op.name == "constant" or not fusible_node_op(op.name):
        return False
    return bool(supports(op.name, tuple(v.type.dtype for v in ins.operands), ins.attrs))


def inplace_updates(instrs: list[Instruction]) -> dict[Value, list[int]]:
    """For each value whose storage an instruction updates in place (``sgd_step`` on a parameter), the
    positions of those updates; a view of such a value (``reshape(bias)``) maps to its storage's."""
    root: dict[Value, Value] = {}  # a view's storage: the value it aliases
    by_root: dict[Value, list[int]] = {}
    for i, ins in enumerate(instrs):
        for k, src in ins.op.aliases.items():
            o = ins.operands[src]
            root[ins.results[k]] = root.get(o, o)
        if ins.op.has("inplace"):
            for v in ins.operands:
                by_root.setdefault(root.get(v, v), []).append(i)
    out = {v: by_root[r] for v, r in root.items() if r in by_root}
    out.update(by_root)
    return out


def find_groups(fn: Function, supports: Supports | None = None) -> list[Group]:
    """The fusion groups of a single-block function (see the module docstring for the rules)."""
    supports = supports or _default_supports()
    instrs = fn.entry.instrs
    pos = {ins: i for i, ins in enumerate(instrs)}
    users: dict[Value, list[Instruction]] = {}
    for ins in instrs:
        if ins.op.name != "free":
            for v in ins.operands:
                users.setdefault(v, []).append(ins)
    clobbers = inplace_updates(instrs)
    parent: dict[int, int] = {}

    def find(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    gid: dict[Instruction, int] = {}
    shape: dict[int, tuple[int, ...]] = {}
    members: dict[int, list[Instruction]] = {}  # by root

    def read_outside_before(a: int, b: int, limit: int) -> bool:
        """Whether an instruction outside groups ``a`` and ``b`` reads one of their results before
        position ``limit`` (the merged group's end so far). Every path that leaves a group and comes
        back (a cycle once fused) starts with such a read, and ``_validate`` would split the group
        there anyway: checking the first edge, not the whole path, keeps the scan linear."""
        ms = members[a] + members[b]
        mset = set(ms)
        return any(pos[u] < limit and u not in mset for m in ms for u in users.get(m.result, ()))

    for ins in instrs:
        if ins.op.name == "free" or not _fusible(ins, supports):
            continue
        g = len(parent)
        parent[g] = g
        shape[g] = ins.result.type.shape
        members[g] = [ins]
        gid[ins] = g
        cands = []
        for v in ins.operands:
            if isinstance(v, OpResult) and v.instr in gid:
                c = find(gid[v.instr])
                if c not in cands:
                    cands.append(c)
        for c in cands:
            c, cur = find(c), find(g)
            if c == cur or read_outside_before(c, cur, pos[ins]):
                continue
            try:
                s = broadcast_shapes(shape[cur], shape[c])
            except ValueError:
                continue
            parent[c] = cur
            shape[cur] = s
            members[cur] = sorted(members[cur] + members.pop(c), key=pos.__getitem__)
    groups = []
    for ms in members.values():
        groups.extend(_validate(ms, users, pos, clobbers))
    groups.sort(key=lambda g: pos[g.members[0]])
    return groups


def _validate(members: list[Instruction], users: dict, pos: dict, clobbers: dict) -> list[Group]:
    """Split or trim a candidate group until it follows the rules; keep groups of ≥ 2.

    An output read by another instruction before the group's end, or an operand updated in place
    between its reader and the group's end, splits the group there; an output narrower than the
    iteration shape drops its member and that member's in-group producers.
    """
    if len(members) < 2:
        return []
    mset = set(members)
    shp = broadcast_shapes(*(m.result.type.shape for m in members))
    anchor = pos[members[-1]]

    def split(at: int) -> list[Group]:
        return (_validate([x for x in members if pos[x] < at], users, pos, clobbers)
                + _validate([x for x in members if pos[x] > at], users, pos, clobbers))

    for m in members:
        for v in m.operands:
            for c in clobbers.get(v, ()):
                if pos[m] < c < anchor:
                    return split(c)
    outputs = []
    for m in members:
        r = m.result
        outside = [u for u in users.get(r, ()) if u not in mset]
        if not outside:
            continue
        early = min((pos[u] for u in outside), default=anchor)
        if early < anchor:
            return split(early)
        if r.type.shape != shp:
            drop = {m}
            for x in reversed(members):  # in-group producers of dropped members go too
                if x in drop:
                    for v in x.operands:
                        if isinstance(v, OpResult) and v.instr in mset:
                            drop.add(v.instr)
            return _validate([x for x in members if x not in drop], users, pos, clobbers)
        outputs.append(r)
    if not outputs:  # nothing outside reads the group (dead values, e.g. only freed): leave it alone
        return []
    return [Group(members, shp, outputs)]


def _body(g: Group) -> tuple[Body, list[Value]]:
    """The body of a group and its operands (external values in order of first use)."""
    ext: list[Value] = []
    index: dict[Value, int] = {}
    consts: list[tuple[Value, Node]] = []
    for m in g.members:
        for v in m.operands:
            if v in index or any(v is c for c, _ in consts):
                continue
            if isinstance(v, OpResult) and v.instr in g.members:
                continue
            if _is_scalar_const(v):
                a = v.instr.attrs
                consts.append((v, Node("constant", (), tuple(sorted({"value": a["value"], "shape": (),
                                                                    "dtype": a["dtype"]}.items())))))
            else:
                index[v] = len(ext)
                ext.append(v)
    nodes: list[Node] = []
    for v, node in consts:
        index[v] = len(ext) + len(nodes)
        nodes.append(node)
    for m in g.members:
        if m.op.name == "fused":  # its body's nodes, inlined: local operand k is the member's operand k
            inner = parse_body(m.attrs["body"])
            local = [index[v] for v in m.operands]
            for n in inner.nodes:
                local.append(len(ext) + len(nodes))
                nodes.append(Node(n.op, tuple(local[a] for a in n.args), n.attrs))
            index[m.result] = local[inner.outputs[0]]
            continue
        index[m.result] = len(ext) + len(nodes)
        nodes.append(Node(m.op.name, tuple(index[v] for v in m.operands), tuple(sorted(m.attrs.items()))))
    return Body(len(ext), tuple(nodes), tuple(index[o] for o in g.outputs)), ext


def _rewrite(fn: Function, groups: list[Group]) -> tuple[Function, dict[int, tuple[int, int]]]:
    """``fn`` with each group replaced by one ``fused`` instruction at its last member, and per group
    (by ``id``) the span of new instruction indices where its fusion changed what is live."""
    src = fn.entry.instrs
    member_of: dict[Instruction, Group] = {m: g for g in groups for m in g.members}
    anchor_of = {g.members[-1]: g for g in groups}
    bodies = {id(g): _body(g) for g in groups}
    # Values that vanish: member results that are not outputs.
    gone: set[Value] = {m.result for g in groups for m in g.members} - {o for g in groups for o in g.outputs}
    used_by_rest: set[Value] = set()
    for ins in src:
        if ins.op.name != "free" and ins not in member_of:
            used_by_rest.update(ins.operands)
    for g in groups:
        used_by_rest.update(bodies[id(g)][1])
    read_by_members = {v for m in member_of for v in m.operands}
    for ins in src:  # scalar constants only read by bodies vanish too
        if (ins.op.name == "constant" and ins.result.type.shape == () and ins.result not in used_by_rest
                and ins.result in read_by_members):
            gone.add(ins.result)
    # A free of a group's operand inside the group's span moves to just after the (latest such) fused
    # instruction that still reads it.
    pos = {ins: i for i, ins in enumerate(src)}
    target: dict[tuple[Instruction, Value], Group] = {}
    for g in groups:
        ops = set(bodies[id(g)][1])
        lo, hi = pos[g.members[0]], pos[g.members[-1]]
        for ins in src[lo:hi]:
            if ins.op.name == "free":
                for v in ins.operands:
                    if v in ops:
                        old = target.get((ins, v))
                        if old is None or pos[old.members[-1]] < hi:
                            target[(ins, v)] = g
    deferred: dict[int, list[Value]] = {}
    moved: dict[Instruction, set[Value]] = {}
    for (ins, v), g in target.items():
        deferred.setdefault(id(g), []).append(v)
        moved.setdefault(ins, set()).add(v)

    out = Function(fn.name, fn.param_types, fn.result_types)
    vmap: dict[Value, Value] = dict(zip(fn.params, out.params))
    b = Builder(out.entry)
    new_at: list[int] = []
    spans: dict[int, tuple[int, int]] = {}
    for ins in src:
        new_at.append(len(out.entry.instrs))
        if ins in member_of and ins not in anchor_of:
            continue
        if ins in anchor_of:
            g = anchor_of[ins]
            body, ext = bodies[id(g)]
            fi = b.create("fused", [vmap[v] for v in ext], {"body": body.text()}, loc=ins.loc)  # the anchor's
            spans[id(g)] = (new_at[pos[g.members[0]]], len(out.entry.instrs) - 1)
            for o, r in zip(g.outputs, fi.results):
                vmap[o] = r
            later = [vmap[v] for v in deferred.get(id(g), ()) if v in vmap]
            if later:
                b.free(*dict.fromkeys(later))
            continue
        if ins.op.name == "constant" and ins.results and ins.result in gone:
            continue
        if ins.op.name == "free":
            keep = [vmap[v] for v in ins.operands if v not in gone and v not in moved.get(ins, ()) and v in vmap]
            if keep:
                b.free(*keep)
            continue
        ni = b._insert(Instruction(ins.op, [vmap[v] for v in ins.operands], ins.attrs,
                                   [r.type for r in ins.results], (), ins.dialect, ins.loc))
        if ins.recomputes is not None:  # provenance survives (None when the recomputed value was fused away)
            ni.recomputes = vmap.get(ins.recomputes)
        for r, nr in zip(ins.results, ni.results):
            vmap[r] = nr
    return out, spans


def fuse_function(fn: Function, supports: Supports | None = None, stats: FuseStats | None = None,
                  judge: Judge | None = None) -> Function:
    """Fuse ``fn`` (single-block functions; others are returned as a copy), never raising its peak;
    groups whose span holds an instruction ``judge`` objects to are left unfused too."""
    if fn.is_declaration or len(fn.blocks) != 1 or any(i.op.name == "call" for i in fn.entry.instrs):
        return fn.clone()
    groups = find_groups(fn, supports)
    st = stats if stats is not None else FuseStats()
    st.instructions_before += len(fn.entry.instrs)
    if not groups:
        st.instructions_after += len(fn.entry.instrs)
        return fn.clone()
    n = len(groups)
    out, groups = keep_accepted(fn, groups, _rewrite, within_peak(fn, judge))
    out = out if groups else fn.clone()
    st.dropped_for_peak += n - len(groups)
    st.groups += len(groups)
    st.fused_instructions += sum(len(g.members) for g in groups)
    where = {ins: i for i, ins in enumerate(fn.entry.instrs)}
    st.member_positions += sorted(where[m] for g in groups for m in g.members)
    st.instructions_after += len(out.entry.instrs)
    return out


def keep_accepted(fn: Function, items: list, rewrite: Callable, check: Judge,
                  size: Callable[[Any], int] | None = None) -> tuple[Function, list]:
    """``rewrite(fn, items)`` -> (program, span per item by ``id``), then, while ``check`` rejects
    an instruction, the same without the items whose span holds it. Returns the accepted program
    and the items kept (``fn`` itself when none is). A rejection outside every span (rewrites that
    together moved a high-water mark past their spans) undoes them all: ``fn`` runs as planned.

    With ``size`` (the bytes an item keeps alive over its span), also the same undoing the largest
    of those items first (those holding at least half the largest one's bytes), so that a scalar
    kept alive next to a large value is not undone with it; of the two, the program keeping more
    items."""
    out = _accepted(fn, items, rewrite, check, None)
    if size is None or len(out[1]) == len(items):  # nothing undone: the order of undoing cannot matter
        return out
    tiered = _accepted(fn, items, rewrite, check, size)
    return tiered if len(tiered[1]) > len(out[1]) else out


def _accepted(fn: Function, items: list, rewrite: Callable, check: Judge,
              size: Callable[[Any], int] | None) -> tuple[Function, list]:
    """:func:`keep_accepted`'s loop: every culprit undone at once, or (``size``) the largest first."""
    out, spans = rewrite(fn, items)
    while items:
        at = check(out)
        if at is None:
            return out, items
        culprits = [x for x in items if spans[id(x)][0] <= at <= spans[id(x)][1]]
        if not culprits:
            return fn, []
        if size is not None:
            largest = max(size(x) for x in culprits)
            culprits = [x for x in culprits if 2 * size(x) >= largest]
        items = [x for x in items if x not in culprits]
        if items:
            out, spans = rewrite(fn, items)
    return fn, items


def within_peak(fn: Function, judge: Judge | None = None, limit: int | None = None) -> Judge:
    """The check a rewrite of ``fn`` must pass: its VM peak (``simulate``) at most ``limit`` (None:
    ``fn``'s), and ``judge`` when given; it returns None, or the index of an instruction at the excess."""
    base = simulate(fn).peak_bytes if limit is None else limit

    def check(out: Function) -> int | None:
        pred = simulate(out)
        if pred.peak_bytes > base:
            return -1 if pred.peak_index is None else pred.peak_index
        return None if judge is None else judge(out)

    return check


def fuse(module: Module | Function, supports: Supports | None = None, stats: FuseStats | None = None
         ) -> Module | Function:
    """Fuse every function of a module (or one function); see :func:`fuse_function`."""
    if isinstance(module, Function):
        return fuse_function(module, supports, stats)
    return Module([fuse_function(f, supports, stats) for f in module])


def fuse_pass(module: Module) -> Module:
    """Pass: element-wise instruction DAGs become ``fused`` instructions (peak never rises)."""
    return fuse(module)


__all__ = ["FuseStats", "Group", "Judge", "find_groups", "fuse", "fuse_function", "fuse_pass", "keep_accepted", "within_peak"]
