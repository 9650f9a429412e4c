"""Running a ``fused`` body node by node with a dialect's primitive kernels (the reference semantics).

A fused instruction must give exactly what its nodes give one by one, so the numpy and torch
kernels of ``fused`` interpret the body with the very kernels the VM would pick for each node as
a separate instruction. Intermediates are dropped at their last use.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Sequence

from ..ir import OPS, Instruction, TensorType, Value
from ..ir.ops.fused import Body, parse_body


@lru_cache(maxsize=4096)
def _program(body_text: str, types: tuple[TensorType, ...], dialects: tuple[str, ...]
             ) -> tuple[Body, tuple[tuple[Callable, str, dict], ...], tuple[tuple[int, ...], ...]]:
    """Per node: (kernel fn, its dialect, attrs); and per node the values dying after it."""
    from . import select

    body = parse_body(body_text)
    vals = body.value_types(list(types))
    steps = []
    for k, n in enumerate(body.nodes):
        op = OPS[n.op]
        ins = Instruction(op, [Value(vals[a]) for a in n.args], n.attr_dict, [vals[body.num_inputs + k]])
        impl = select(ins, dialects)
        steps.append((impl.fn, impl.dialect, n.attr_dict))
    last: dict[int, int] = {}
    for k, n in enumerate(body.nodes):
        for a in n.args:
            last[a] = k
    keep = set(body.outputs)
    dies = tuple(tuple(a for a, k2 in last.items() if k2 == k and a not in keep and a >= body.num_inputs)
                 for k in range(len(body.nodes)))
    return body, tuple(steps), dies


def interpret(body_text: str, args: Sequence[Any], types: tuple[TensorType, ...], dialects: tuple[str, ...],
              convert: dict[str, Callable[[Any], Any]], materialize: Callable[[Any, tuple[int, ...]], Any]) -> Any:
    """Run the body on ``args`` with the kernels of ``dialects`` (priority order); one result or a tuple.

    ``materialize(x, shape)`` gives a fresh dense buffer of ``x`` broadcast to ``shape``, for a result
    whose node is narrower than the iteration space or is an operand itself.
    """
    body, steps, dies = _program(body_text, types, dialects)
    shape = OPS["fused"].result_types(list(types), {"body": body_text})[0].shape
    env: dict[int, Any] = dict(enumerate(args))
    base = body.num_inputs
    for k, (fn, dialect, attrs) in enumerate(steps):
        cv = convert[dialect]
        env[base + k] = fn(*[cv(env[a]) for a in body.nodes[k].args], **attrs)
        for a in dies[k]:
            del env[a]
    outs = []
    for o in body.outputs:
        x = env[o]
        if o < base or tuple(x.shape) != shape or any(x is y for y in outs):
            x = materialize(x, shape)
        outs.append(x)
    return outs[0] if len(outs) == 1 else tuple(outs)
