"""Inline every ``call``: the callee's body replaces the call, so later passes (autodiff, CSE,
DCE, memory planning) see one flat function. A single-block callee is spliced in place; a
multi-block callee splits the caller's block, its returns branching to the continuation."""
from __future__ import annotations

from ..ir import Block, Function, Instruction, Module, Successor, Value, get_op
from ._rewrite import apply_replacements

MAX_DEPTH = 64


class InlineError(ValueError):
    """A call cannot be inlined (unknown callee, gradient declaration, recursion)."""


def inline_function(f: Function, module: Module) -> Function:
    """A copy of ``f`` with every call inlined (recursively, up to a depth of ``MAX_DEPTH``)."""
    g = f.clone()
    g.module = None
    chains: dict[Instruction, tuple[str, ...]] = {}  # call -> callees it was inlined through
    depth = 0
    while True:
        site = next(((b, i) for b in g.blocks for i, ins in enumerate(b.instrs) if ins.op.name == "call"), None)
        if site is None:
            return g
        depth += 1
        if depth > 10_000:
            raise InlineError(f"in @{f.name}: too many calls to inline (recursion?)")
        _inline_one(g, module, *site, origin=f.name, chains=chains)


def _inline_one(g: Function, module: Module, block: Block, idx: int, origin: str,
                chains: dict[Instruction, tuple[str, ...]]) -> None:
    call = block.instrs[idx]
    name = call.attrs["callee"]
    if name not in module:
        raise InlineError(f"in @{origin}: call to unknown function @{name}")
    callee = module[name]
    if callee.is_declaration:
        raise InlineError(f"in @{origin}: call to @{name}, a gradient declaration; run the 'grad' pass first")
    chain = chains.pop(call, ()) + (name,)
    if chain.count(name) > 1 or len(chain) > MAX_DEPTH:
        raise InlineError(f"in @{origin}: recursive call chain {' -> '.join('@' + c for c in chain)} cannot be inlined")
    body = callee.clone()
    for ins in body.instructions():
        if ins.op.name == "call":
            chains[ins] = chain
    repl: dict[Value, Value] = dict(zip(body.entry.args, call.operands))
    before, after = block.instrs[:idx], block.instrs[idx + 1:]
    if len(body.blocks) == 1:
        ret = body.entry.instrs[-1]
        mid = body.entry.instrs[:-1]
        for ins in mid:
            ins.block = block
        block.instrs = before + mid + after
        repl.update(zip(call.results, ret.operands))
        apply_replacements(g, repl)
        _fix_operands(mid, repl)
        return
    # Multi-block callee: block = before + callee entry body; callee blocks; continuation.
    cont = Block([r.type for r in call.results])
    for ins in after:
        ins.block = cont
    cont.instrs = after
    repl.update(zip(call.results, cont.args))
    new_blocks = []
    for bb in body.blocks:
        t = bb.terminator
        if t is not None and t.op.name == "return":
            bb.instrs[-1] = Instruction(get_op("br"), [], {}, [], [Successor(cont, list(t.operands))])
            bb.instrs[-1].block = bb
    for ins in body.entry.instrs:
        ins.block = block
    block.instrs = before + body.entry.instrs
    pos = g.blocks.index(block)
    for bb in body.blocks[1:]:
        bb.function = g
        new_blocks.append(bb)
    cont.function = g
    g.blocks[pos + 1:pos + 1] = new_blocks + [cont]
    apply_replacements(g, repl)


def _fix_operands(instrs, repl) -> None:
    from ._rewrite import resolve

    for ins in instrs:
        ins.operands = [resolve(repl, v) for v in ins.operands]


def inline(module: Module) -> Module:
    """Inline every call in every function; gradient declarations are left as they are."""
    out = Module()
    for f in module:
        if f.is_declaration:
            out.add(f.clone())
        else:
            out.add(inline_function(f, module))
    return out
