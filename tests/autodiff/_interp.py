"""A tiny reference interpreter over the numpy kernels, for tests that must not depend on the VM
(value semantics only: no memory accounting). Supports branches and calls."""
from __future__ import annotations

import numpy as np

from remat.backends import kernel_for
from remat.ir import Function, Module


def evaluate(f: Function, args, module: Module | None = None) -> list[np.ndarray]:
    module = module if module is not None else f.module
    env = {p: np.asarray(a, dtype=p.type.dtype.numpy) for p, a in zip(f.params, args)}
    block = f.entry
    steps = 0
    while True:
        steps += 1
        assert steps < 10_000, "interpreter ran too long"
        nxt = None
        for ins in block.instrs:
            name = ins.op.name
            if name == "return":
                return [env[v] for v in ins.operands]
            if name == "br":
                nxt = ins.successors[0]
                break
            if name == "cond_br":
                nxt = ins.successors[0] if bool(env[ins.operands[0]]) else ins.successors[1]
                break
            if name == "free":
                continue
            if name == "call":
                outs = evaluate(module[ins.attrs["callee"]], [env[v] for v in ins.operands], module)
            else:
                out = kernel_for(ins, "numpy").fn(*[env[v] for v in ins.operands], **ins.attrs)
                outs = list(out) if isinstance(out, tuple) else [out]
            for r, o in zip(ins.results, outs):
                o = np.asarray(o)
                assert o.shape == r.type.shape and o.dtype == r.type.dtype.numpy, (ins, o.shape, o.dtype, r.type)
                env[r] = o
        vals = [env[v] for v in nxt.args]
        for a, v in zip(nxt.block.args, vals):
            env[a] = v
        block = nxt.block
