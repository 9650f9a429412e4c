"""``fused``: a DAG of element-wise primitives run as one instruction (made by the ``fuse`` pass).

The body is an attribute in the canonical text, so a fused program prints and parses back::

    %9, %10 = numba.fused %2, %5, %7 {body="%3 = add(%0, %1) %4 = relu(%3) -> %3, %4"} : f32[8,64], f32[8,64]

Inside the body ``%0 … %{n-1}`` are the instruction's operands; each node defines the next number;
``->`` lists the nodes (or operands) that are the instruction's results. A node is any op tagged
``elementwise`` in the registry (with its attributes in braces), or a rank-0 ``constant``. The type
rule applies each node's own type rule, so the verifier checks the body's types; the iteration
space is the broadcast of the operands and results, and every result has that full shape.

Bit-exactness: every kernel of ``fused`` must give exactly what running its nodes one by one with
the registered primitive kernels gives (the numpy and torch kernels interpret the body that way).
``fused`` has no VJP (``nondiff``): fusion runs on the final training programs, after autodiff.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from ..opdef import OPS, Attr, OpDef, Sample, declare
from ..types import TensorType, broadcast_shapes


@dataclass(frozen=True)
class Node:
    """One body node: ``op(args) {attrs}``; ``args`` index the body's values (operands first)."""

    op: str
    args: tuple[int, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)


@dataclass(frozen=True)
class Body:
    """A fused instruction's expression DAG over ``num_inputs`` operands."""

    num_inputs: int
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]

    def text(self) -> str:
        """The canonical text (the ``body`` attribute)."""
        from ..printer import format_attr_value

        parts = []
        for k, n in enumerate(self.nodes):
            op = OPS[n.op]
            s = f"%{self.num_inputs + k} = {n.op}({', '.join(f'%{a}' for a in n.args)})"
            shown = [f"{a.name}={format_attr_value(a.kind, dict(n.attrs)[a.name])}" for a in op.attrs
                     if a.name in dict(n.attrs) and not _is_default(a, dict(n.attrs)[a.name])]
            if shown:
                s += " {" + ", ".join(shown) + "}"
            parts.append(s)
        return " ".join(parts) + " -> " + ", ".join(f"%{o}" for o in self.outputs)

    def value_types(self, types: list[TensorType]) -> list[TensorType]:
        """Types of every body value (operands, then nodes) by the nodes' own type rules."""
        if len(types) != self.num_inputs:
            raise TypeError(f"'fused' body uses {self.num_inputs} operand(s), the instruction has {len(types)}")
        vals = list(types)
        for k, n in enumerate(self.nodes):
            ts = [vals[a] for a in n.args]
            try:
                r = OPS[n.op].result_types(ts, n.attr_dict)
            except TypeError as e:
                raise TypeError(f"'fused' body node %{self.num_inputs + k} ({n.op}): {e}") from None
            vals.append(r[0])
        return vals


def _is_default(a: Attr, v: Any) -> bool:
    from ..printer import _is_default as is_default

    return is_default(a, v)


def fusible_node_op(name: str) -> bool:
    """Whether an op may appear in a body: element-wise, single-result, no randomness or effects."""
    op = OPS.get(name)
    if op is None:
        return False
    if name == "constant":
        return True
    return ("elementwise" in op.tags and op.num_results == 1
            and not op.tags & {"random", "view", "inplace", "effect"} and not op.aliases)


@lru_cache(maxsize=4096)
def parse_body(text: str) -> Body:
    """Parse (and check the structure of) a body; raise TypeError naming what is wrong."""
    from ..parser import ParseError, _Parser

    try:
        return _parse_body(_Parser(text))
    except ParseError as e:
        raise TypeError(f"'fused' body {text!r}: {e}") from None


def _parse_body(p) -> Body:
    defs: list[tuple[int, str, list[int], dict]] = []
    while p.tok.kind == "value":
        lhs = _num(p, p.next())
        p.expect("=", "after the node's name")
        optok = p.expect_kind("ident", "an op name")
        if not fusible_node_op(optok.text):
            raise p.error(f"'{optok.text}' cannot appear in a fused body; it takes element-wise ops and "
                          f"rank-0 constants", optok)
        p.expect("(", "to open the node's operands")
        args: list[int] = []
        if not p.at(")"):
            while True:
                args.append(_num(p, p.expect_kind("value", "an operand")))
                if not p.accept(","):
                    break
        p.expect(")", "to close the node's operands")
        attrs: dict[str, Any] = {}
        if p.accept("{"):
            op = OPS[optok.text]
            while True:
                key = p.expect_kind("ident", "an attribute name")
                p.expect("=", "after the attribute name")
                a = op.attr(key.text)
                if a is None:
                    raise p.error(f"'{optok.text}' has no attribute '{key.text}'", key)
                attrs[key.text] = a.coerce(optok.text, p.attr_value())
                if not p.accept(","):
                    break
            p.expect("}", "to close the attributes")
        defs.append((lhs, optok.text, args, attrs))
    p.expect_kind("arrow", "'->' before the body's results")
    outs = [_num(p, p.expect_kind("value", "a result"))]
    while p.accept(","):
        outs.append(_num(p, p.expect_kind("value", "a result")))
    p.expect_kind("eof", "after the body's results")
    if not defs:
        raise TypeError("'fused' body has no nodes")
    n_in = defs[0][0]
    nodes = []
    for k, (lhs, op, args, attrs) in enumerate(defs):
        if lhs != n_in + k:
            raise TypeError(f"'fused' body: node {k} must be named %{n_in + k} (operands are %0..%{n_in - 1}), "
                            f"got %{lhs}")
        for a in args:
            if a >= lhs:
                raise TypeError(f"'fused' body: %{lhs} uses %{a}, which is not defined before it")
        opdef = OPS[op]
        opdef.check_arity(len(args))
        full = {}
        for a in opdef.attrs:  # fill defaults so the node is in normal form
            if a.name in attrs:
                full[a.name] = attrs[a.name]
            elif a.default is not _required():
                full[a.name] = a.default
            else:
                raise TypeError(f"'fused' body: %{lhs} ({op}) requires attribute '{a.name}'")
        if op == "constant" and full["shape"] != ():
            raise TypeError(f"'fused' body: constants must be rank 0, %{lhs} has shape {list(full['shape'])}")
        nodes.append(Node(op, tuple(args), tuple(sorted(full.items()))))
    total = n_in + len(nodes)
    for o in outs:
        if o >= total:
            raise TypeError(f"'fused' body: result %{o} is not defined (values are %0..%{total - 1})")
    return Body(n_in, tuple(nodes), tuple(outs))


def _required():
    from ..opdef import REQUIRED

    return REQUIRED


def _num(p, tok) -> int:
    s = tok.text[1:]
    if not s.isdigit():
        raise p.error("body values are numbered %0, %1, …", tok)
    return int(s)


def _normalize(types, attrs):
    return {"body": parse_body(attrs["body"]).text()}


def _infer(types, attrs):
    body = parse_body(attrs["body"])
    vals = body.value_types(list(types))
    try:
        shape = broadcast_shapes(*(t.shape for t in list(types) + [vals[o] for o in body.outputs]))
    except ValueError as e:
        raise TypeError(f"'fused': {e}") from None
    # Results have the full iteration shape (a kernel writes every element of each).
    return tuple(TensorType(vals[o].dtype, shape) for o in body.outputs)


def _flops(in_types, out_types, attrs) -> float:
    """One operation per node per element of the iteration space (constants are free)."""
    body = parse_body(attrs["body"])
    n = out_types[0].numel if out_types else 0
    return float(n * sum(1 for nd in body.nodes if nd.op != "constant"))


def _sample(r: np.random.Generator) -> list[Sample]:
    a, b, c = (r.uniform(-1, 1, size=s) for s in ((3, 4), (4,), (3, 1)))
    return [
        Sample([a, b, c], {"body": "%3 = add(%0, %1) %4 = mul(%3, %2) %5 = relu(%4) -> %4, %5"}),
        Sample([a, b], {"body": "%2 = sub(%0, %1) %3 = gt(%2, %1) %4 = select(%3, %2, %1) %5 = neg(%4) -> %5"}),
    ]


def _declare() -> None:
    op = OpDef("fused", None, (Attr("body", "str"),), _infer, frozenset(), min_operands=1, nondiff=True,
               normalize=_normalize, sample=_sample, flops=_flops,
               doc="element-wise primitives run as one kernel; the body is their DAG (made by the fuse pass)")
    declare(op)


_declare()


# ---------------------------------------------------------------- decomposition: the body, node by node
from ..opdef import def_decomposition  # noqa: E402


@def_decomposition("fused")
def _fused_decomp(b, xs, attrs):
    body = parse_body(attrs["body"])
    vals = list(xs)
    for n in body.nodes:
        vals.append(b.op(n.op, *[vals[a] for a in n.args], **n.attr_dict))
    full = _infer([v.type for v in xs], attrs)[0].shape  # every result has the iteration shape
    return [v if v.type.shape == full else b.op("broadcast", v, shape=full) for v in (vals[o] for o in body.outputs)]
