"""Reverse-mode automatic differentiation by source transformation.

The pass ``grad`` turns every declaration ``func @g = gradient @f wrt i, j`` (or
``value_and_gradient``) into an ordinary function: f's forward code, then the backward code
emitted by the per-op VJP rules in reverse order, returning the gradients wrt the listed
parameters (preceded by f's outputs for ``value_and_gradient``). No closures, no tape at run
time: the result is plain IR that every later pass (simplify, CSE, DCE, rematerialisation) can
read, and that can itself be differentiated again (``grad(grad(f))``).

Decisions, documented here because users see them:

* **Output cotangent.** If f returns one floating-point value with a single element (a loss),
  its cotangent is the constant 1. Otherwise the gradient function takes one extra trailing
  parameter per floating-point output, the cotangent of that output (a VJP); non-float outputs
  get none.
* **Calls** are inlined (pass ``inline``) before differentiating.
* **Control flow.** Branches (any acyclic CFG, e.g. if/else diamonds) are supported: a join block
  receives an extra ``i32`` block argument saying which predecessor edge was taken, and the
  backward branches on it to the backward of that predecessor. Forward values saved for the
  backward that are defined inside a branch are carried to the end of the forward as extra join
  block arguments (a zero placeholder on the other paths, never read there). Loops are rejected.
* **Saves.** Each rule only sees the operands/results its ``saves`` declares (RAF's flexible
  adjoints). ``adjoints="inputs"`` selects the input-keeping variants of ops whose default rule
  keeps the output, so the memory effect of that choice can be measured.
* **Zero cotangents short-circuit**: only instructions that depend on a wrt parameter and reach
  an output get backward code; cotangents never materialise for values that do not reach the
  output, except a zero constant for a requested gradient that is identically zero.
* ``free`` instructions of f are dropped (the forward's values are now used by the backward);
  liveness re-inserts frees later.
"""
from __future__ import annotations

from typing import Any

from ..ir import (Block, Builder, DType, Function, GradientSpec, Instruction, Module, OpDef, Successor, TensorType,
                  Value, get_op, verify)
from ..ir.ops._vjp import VARIANTS, Primal, saved_indices
from ..ir.verifier import dominators, predecessors, reachable
from ..passes.inline import InlineError, inline_function

ADJOINT_POLICIES = ("outputs", "inputs")
FLAG = TensorType(DType.i32, ())


class DifferentiationError(ValueError):
    """The function cannot be differentiated as asked; the message says where and why."""


def vjp_rule(op: OpDef, adjoints: str = "outputs") -> tuple[Any, Any] | None:
    """The (rule, saves) used for ``op`` under an adjoint policy, or None if it has none."""
    if adjoints not in ADJOINT_POLICIES:
        raise ValueError(f"unknown adjoint policy {adjoints!r}; valid: {', '.join(ADJOINT_POLICIES)}")
    if (op.name, adjoints) in VARIANTS:
        return VARIANTS[(op.name, adjoints)]
    if op.vjp is None:
        return None
    return op.vjp, op.vjp_saves


def differentiate(module: Module, adjoints: str = "outputs") -> Module:
    """The ``grad`` pass: a new module where every gradient declaration is an ordinary function."""
    out = module.clone()
    pending = [f.name for f in out if f.is_declaration]
    while pending:
        ready = [n for n in pending if _ready(out, out[n].gradient.of, set())]
        if not ready:
            raise DifferentiationError(
                f"gradient declarations {', '.join('@' + n for n in pending)} depend on each other in a cycle")
        for name in ready:
            spec = out[name].gradient
            g = gradient_function(out, name, spec, adjoints)
            g.module = out
            out.functions[name] = g  # same position in the module
            pending.remove(name)
    return out


def _ready(m: Module, name: str, seen: set[str]) -> bool:
    """True when ``name`` and everything it calls are ordinary (non-declaration) functions."""
    if name not in m:
        raise DifferentiationError(f"gradient of unknown function @{name}; the module has "
                                   f"{', '.join('@' + n for n in m.functions)}")
    f = m[name]
    if f.is_declaration:
        return False
    if name in seen:
        return True
    seen.add(name)
    return all(_ready(m, i.attrs["callee"], seen) for i in f.instructions() if i.op.name == "call")


def grad_pass(module: Module) -> Module:
    """Differentiate every gradient declaration (default adjoints: keep what each rule declares)."""
    return differentiate(module)


# ---------------------------------------------------------------- one gradient function
def gradient_function(module: Module, name: str, spec: GradientSpec, adjoints: str = "outputs",
                      explicit_cotangents: bool = False) -> Function:
    """Build the function ``name`` computing the gradient of ``module[spec.of]`` described by ``spec``.

    ``explicit_cotangents``: take every float output's cotangent as a trailing parameter, even for
    a scalar loss (a VJP; checkpointing executors split forward from backward at these parameters).
    """
    f = module[spec.of]
    where = f"@{name} = gradient @{spec.of}"
    n = len(f.params)
    for i in spec.wrt:
        if not 0 <= i < n:
            raise DifferentiationError(f"{where}: wrt index {i} is out of range; @{spec.of} has {n} parameters")
        if not f.params[i].type.dtype.is_float:
            raise DifferentiationError(f"{where}: parameter {i} has type {f.params[i].type}; only floating-point "
                                       f"parameters have gradients")
    try:
        src = inline_function(f, module)
    except InlineError as e:
        raise DifferentiationError(f"{where}: {e}") from None
    _drop_frees(src)
    _single_exit(src)
    return _Transform(src, spec, name, adjoints, where, explicit_cotangents).run()


def _drop_frees(f: Function) -> None:
    for b in f.blocks:
        b.instrs = [i for i in b.instrs if i.op.name != "free"]


def _single_exit(f: Function) -> None:
    """Make the function have one returning block (a new exit block if several return)."""
    rets = [b for b in f.blocks if b.terminator is not None and b.terminator.op.name == "return"]
    if len(rets) <= 1:
        return
    exit_ = f.add_block(arg_types=f.result_types)
    Builder(exit_).ret(*exit_.args)
    br = get_op("br")
    for b in rets:
        t = b.instrs[-1]
        ni = Instruction(br, [], {}, [], [Successor(exit_, list(t.operands))])
        ni.block = b
        b.instrs[-1] = ni


def _topo_order(f: Function, where: str) -> list[Block]:
    """Reachable blocks in a topological order; raises on a loop."""
    reach = reachable(f)
    state: dict[Block, int] = {}
    order: list[Block] = []
    index = {b: i for i, b in enumerate(f.blocks)}

    def visit(b: Block) -> None:
        stack = [(b, iter(_succ_blocks(b)))]
        state[b] = 1
        while stack:
            blk, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                state[blk] = 2
                order.append(blk)
                continue
            s = state.get(nxt, 0)
            if s == 1:
                raise DifferentiationError(f"{where}: the function has a loop (block ^bb{index[nxt]} is reached again "
                                           f"from ^bb{index[blk]}); loops are not supported by reverse-mode autodiff "
                                           f"here — unroll the loop or differentiate its body")
            if s == 0:
                state[nxt] = 1
                stack.append((nxt, iter(_succ_blocks(nxt))))

    visit(f.entry)
    order.reverse()
    return [b for b in order if b in reach]


def _succ_blocks(b: Block) -> list[Block]:
    t = b.terminator
    return [s.block for s in t.successors] if t else []


class _Transform:
    def __init__(self, src: Function, spec: GradientSpec, name: str, adjoints: str, where: str,
                 explicit_cotangents: bool = False):
        self.src, self.spec, self.name, self.adjoints, self.where = src, spec, name, adjoints, where
        self.explicit_cotangents = explicit_cotangents

    # ---------------------------------------------------------------- analysis
    def rule(self, ins: Instruction):
        return vjp_rule(ins.op, self.adjoints) if not ins.op.nondiff else None

    def analyse(self) -> None:
        src = self.src
        self.order = _topo_order(src, self.where)
        self.exit = next(b for b in self.order if b.terminator is not None and b.terminator.op.name == "return")
        self.dom = dominators(src)
        self.edges: dict[Block, list[tuple[Block, Successor]]] = {b: [] for b in self.order}
        for b in self.order:
            for s in b.terminator.successors:
                self.edges[s.block].append((b, s))
        self.defblock: dict[Value, Block] = {}
        for b in self.order:
            for a in b.args:
                self.defblock[a] = b
            for ins in b.instrs:
                for r in ins.results:
                    self.defblock[r] = b
        outs = self.exit.terminator.operands
        # Output cotangents: the constant 1 for a single one-element float output, else parameters.
        self.scalar_loss = (not self.explicit_cotangents and len(outs) == 1 and outs[0].type.numel == 1
                            and outs[0].type.dtype.is_float)
        # Varied: depends (differentiably) on a wrt parameter.
        varied: set[Value] = {src.params[i] for i in self.spec.wrt}
        for b in self.order:
            for a in b.args:
                if b is not src.entry and a.type.dtype.is_float and any(s.args[a.index] in varied for _, s in self.edges[b]):
                    varied.add(a)
            for ins in b.instrs:
                if self.rule(ins) is not None and any(v in varied for v in ins.operands):
                    varied.update(r for r in ins.results if r.type.dtype.is_float)
        # Useful: some output with a cotangent depends on it through differentiable ops.
        useful: set[Value] = {v for v in outs if v.type.dtype.is_float}
        for b in reversed(self.order):
            t = b.terminator
            for s in t.successors:
                for a, v in zip(s.block.args, s.args):
                    if a in useful:
                        useful.add(v)
            for ins in reversed(b.instrs):
                if self.rule(ins) is not None and any(r in useful for r in ins.results):
                    useful.update(v for v in ins.operands if v.type.dtype.is_float)
        self.active = {v for v in varied & useful if v.type.dtype.is_float}
        # The tape: forward values the backward rules read.
        self.tape: list[Value] = []
        seen: set[Value] = set()
        for b in self.order:
            for ins in b.instrs:
                if not any(r in self.active for r in ins.results):
                    continue
                _, saves = self.rule(ins)
                xs, ys = saved_indices(saves, len(ins.operands), len(ins.results), ins.attrs)
                for v in [ins.operands[i] for i in sorted(xs)] + [ins.results[j] for j in sorted(ys)]:
                    if v not in seen:
                        seen.add(v)
                        self.tape.append(v)
        # Values whose cotangent must cross block boundaries in the backward.
        crosses: set[Value] = set()
        for b in self.order:
            for ins in b.instrs:
                for v in ins.operands:
                    if v in self.active and self.defblock.get(v) is not b:
                        crosses.add(v)
                for s in ins.successors:
                    crosses.update(v for v in s.args if v in self.active)
        self.acc: dict[Block, list[Value]] = {}
        for b in self.order:
            self.acc[b] = [v for v in self.crossing_order(crosses) if self.defblock[v] in self.dom[b]]

    def crossing_order(self, crosses: set[Value]) -> list[Value]:
        if not hasattr(self, "_cross_list"):
            out = []
            for b in self.order:
                out += [a for a in b.args if a in crosses]
                for ins in b.instrs:
                    out += [r for r in ins.results if r in crosses]
            self._cross_list = out
        return self._cross_list

    # ---------------------------------------------------------------- construction
    def run(self) -> Function:
        self.analyse()
        src, spec = self.src, self.spec
        outs = list(self.exit.terminator.operands)
        seed_types = [] if self.scalar_loss else [v.type for v in outs if v.type.dtype.is_float]
        result_types = (list(src.result_types) if spec.with_value else []) + [src.params[i].type for i in spec.wrt]
        g = Function(self.name, list(src.param_types) + seed_types, result_types)
        self.g = g
        # Forward: copy the reachable blocks in topological order.
        vmap: dict[Value, Value] = {}
        bmap: dict[Block, Block] = {src.entry: g.entry}
        for a, na in zip(src.entry.args, g.entry.args):
            vmap[a] = na
        for b in self.order[1:]:
            nb = g.add_block(arg_types=[a.type for a in b.args])
            bmap[b] = nb
            for a, na in zip(b.args, nb.args):
                vmap[a] = na
        for b in self.order:
            nb = bmap[b]
            for ins in b.instrs:
                if b is self.exit and ins is b.terminator:
                    continue  # the return is replaced by the backward
                ni = Instruction(ins.op, [vmap[v] for v in ins.operands], ins.attrs, [r.type for r in ins.results],
                                 [Successor(bmap[s.block], [vmap[v] for v in s.args]) for s in ins.successors],
                                 ins.dialect, ins.loc)
                nb.append(ni)
                for r, nr in zip(ins.results, ni.results):
                    vmap[r] = nr
        self.vmap, self.bmap = vmap, bmap
        self.carry_tape()
        self.seeds = list(g.params[len(src.params):])
        self.emit_backward(outs)
        return g

    def carry_tape(self) -> None:
        """Make every tape value (and each join's edge flag) available at the end of the forward."""
        tape_set = set(self.tape)
        avail: dict[Block, dict[Any, Value]] = {}
        for b in self.order:
            nb = self.bmap[b]
            own: dict[Any, Value] = {}
            for a in b.args:
                if a in tape_set:
                    own[a] = self.vmap[a]
            for ins in b.instrs:
                for r in ins.results:
                    if r in tape_set:
                        own[r] = self.vmap[r]
            edges = self.edges[b]
            if b is self.src.entry:
                cur: dict[Any, Value] = {}
            elif len(edges) == 1:
                cur = dict(avail[edges[0][0]])
            else:
                cur = {}
                flag = nb.add_arg(FLAG)
                for k, (p, s) in enumerate(edges):
                    self._succ_in_g(p, s).args.append(self._const_before_term(p, k, FLAG))
                cur[("flag", b)] = flag
                keys: list[Any] = []
                for p, _ in edges:
                    keys += [k for k in avail[p] if k not in keys and k not in cur]
                for key in keys:
                    if not isinstance(key, tuple) and self.defblock[key] in self.dom[b]:
                        cur[key] = self.vmap[key]
                        continue
                    t = avail[next(p for p, _ in edges if key in avail[p])][key].type
                    arg = nb.add_arg(t)
                    for p, s in edges:
                        v = avail[p].get(key)
                        self._succ_in_g(p, s).args.append(v if v is not None else self._const_before_term(p, 0, t))
                    cur[key] = arg
            cur.update(own)
            avail[b] = cur
        self.avail = avail[self.exit]

    def _succ_in_g(self, p: Block, s: Successor) -> Successor:
        k = next(i for i, x in enumerate(p.terminator.successors) if x is s)
        return self.bmap[p].instrs[-1].successors[k]

    def _const_before_term(self, p: Block, value: float, t: TensorType) -> Value:
        nb = self.bmap[p]
        b = Builder(nb, len(nb.instrs) - 1)
        v = bool(value) if t.dtype == DType.bool else (int(value) if not t.dtype.is_float else float(value))
        return b.op("constant", value=v, shape=t.shape, dtype=t.dtype)

    def emit_backward(self, outs: list[Value]) -> None:
        g, src = self.g, self.src
        # Backward block of each forward block: the exit continues in place; others are new blocks
        # whose arguments are the incoming cotangent accumulators.
        bwd: dict[Block, Block] = {self.exit: self.bmap[self.exit]}
        for b in reversed(self.order):
            if b is not self.exit:
                bwd[b] = Block([v.type for v in self.acc[b]])
        self.bwd = bwd
        for b in reversed(self.order):
            blk = bwd[b]
            if blk.function is None:
                g.add_block(blk)
            bld = Builder(blk)
            ct: dict[Value, Value] = {}
            if b is self.exit:
                fl = [v for v in outs if v.type.dtype.is_float]
                if self.scalar_loss:
                    v = outs[0]
                    self._acc(bld, ct, v, bld.op("constant", value=1.0, shape=v.type.shape, dtype=v.type.dtype))
                else:
                    for v, s in zip(fl, self.seeds):
                        self._acc(bld, ct, v, s)
            else:
                for v, a in zip(self.acc[b], blk.args):
                    ct[v] = a
            for ins in reversed(b.instrs):
                self._backward_instr(bld, ins, ct)
            if b is src.entry:
                vals = [self.vmap[v] for v in outs] if self.spec.with_value else []
                for i in self.spec.wrt:
                    p = src.params[i]
                    vals.append(ct[p] if p in ct else bld.op("constant", value=0.0, shape=p.type.shape, dtype=p.type.dtype))
                bld.ret(*vals)
            else:
                self._dispatch(b, bld, ct)

    def _acc(self, b: Builder, ct: dict[Value, Value], v: Value, c: Value) -> None:
        if c.type != v.type:
            raise DifferentiationError(f"{self.where}: cotangent of type {c.type} for a value of type {v.type}")
        ct[v] = b.op("add", ct[v], c) if v in ct else c

    def _backward_instr(self, b: Builder, ins: Instruction, ct: dict[Value, Value]) -> None:
        if ins.op.has("terminator") or not any(r in self.active for r in ins.results):
            return
        gs = [ct.get(r) for r in ins.results]
        if all(x is None for x in gs):
            return  # zero cotangent: nothing to do
        rule, saves = self.rule(ins)
        xs, ys = saved_indices(saves, len(ins.operands), len(ins.results), ins.attrs)
        p = Primal(dict(ins.attrs), [v.type for v in ins.operands], [r.type for r in ins.results],
                   [self.avail[v] if i in xs else None for i, v in enumerate(ins.operands)],
                   [self.avail[r] if j in ys else None for j, r in enumerate(ins.results)])
        outer, b.loc = b.loc, ins.loc  # the backward of an instruction comes from its source line
        try:  # single-result rules get the cotangent, multi-result rules the list (None: zero)
            cts = rule(b, p, gs[0] if len(ins.results) == 1 else gs)
        except NotImplementedError as e:
            raise DifferentiationError(f"{self.where}: cannot differentiate '{ins.op.name}': {e}") from None
        finally:
            b.loc = outer
        if len(cts) != len(ins.operands):
            raise DifferentiationError(f"{self.where}: VJP rule of '{ins.op.name}' returned {len(cts)} cotangents "
                                       f"for {len(ins.operands)} operands")
        for v, c in zip(ins.operands, cts):
            if c is not None and v in self.active:
                if c.type != v.type:
                    raise DifferentiationError(f"{self.where}: VJP rule of '{ins.op.name}' gave a cotangent of type "
                                               f"{c.type} for an operand of type {v.type}")
                self._acc(b, ct, v, c)

    def _dispatch(self, b: Block, bld: Builder, ct: dict[Value, Value]) -> None:
        """End the backward of ``b``: route cotangents to the backward of the predecessor taken."""
        edges = self.edges[b]
        targets: list[Block] = []
        for k, (p, s) in enumerate(edges):
            eb = bld.block if len(edges) == 1 else self.g.add_block(Block())
            eb_b = bld if len(edges) == 1 else Builder(eb)
            local = dict(ct)
            for a, v in zip(b.args, s.args):  # block arguments: cotangent flows to the value passed on this edge
                if a in ct and v in self.active:
                    self._acc(eb_b, local, v, ct[a])
            vals = []
            for v in self.acc[p]:
                vals.append(local[v] if v in local else
                            eb_b.op("constant", value=0.0, shape=v.type.shape, dtype=v.type.dtype))
            eb_b.br(self.bwd[p], *vals)
            targets.append(eb)
        if len(edges) == 1:
            return
        flag = self.avail[("flag", b)]
        cur = bld
        for k in range(len(edges) - 1):
            c = cur.op("eq", flag, cur.op("constant", value=k, shape=(), dtype=DType.i32))
            if k == len(edges) - 2:
                cur.cond_br(c, targets[k], [], targets[k + 1], [])
            else:
                nxt = self.g.add_block(Block())
                cur.cond_br(c, targets[k], [], nxt, [])
                cur = Builder(nxt)
