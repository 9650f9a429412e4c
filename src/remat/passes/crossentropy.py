"""Rewrite a language-model head's ``matmul -> log_softmax -> nll_loss`` into the chunked
``linear_cross_entropy`` op (issue 10: the memory-lean algorithm of the loss).

The pattern, read backwards from the ``nll_loss``::

    z = matmul(x, w) {transpose_b=true}     # x [..., d], w [V, d]: a bias-free nn.Linear head
    z = reshape(z, [N, V])                  # optional (F.cross_entropy on a flattened [B, T, V])
    p = log_softmax(z, axis=1)
    l = nll_loss(p, target)

The logits and the log-probabilities must have no other user. The rewrite changes the algorithm,
not the function: values equal the reference's up to summation order (``dw`` is summed chunk by
chunk), so it is not part of any default pipeline; the planner applies it as a choice it reports
(``remat.plan.algorithms``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Builder, Function, Instruction, Module, Value
from ..ir.ops.crossentropy import DEFAULT_CHUNK
from ._rewrite import rewrite_matches

CHUNK_BYTES = 8 * 2**20
"""Target size of one chunk's logits (bytes): small against the whole [N, V] logits, large enough
that each chunk's matmul runs at full speed."""


def default_chunk(n: int, v: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: the largest power of two whose logits fit ``chunk_bytes`` (at least 16 rows, at
    most ``n``)."""
    rows = 16
    while rows * 2 * v * itemsize <= chunk_bytes and rows * 2 <= max(n, 16):
        rows *= 2
    return max(1, min(rows, n, DEFAULT_CHUNK * 64))


@dataclass
class Site:
    """One head-and-loss rewritten: where it came from and its sizes (bytes, rows)."""

    where: str                 # the head's module path, or "(unknown)"
    rows: int                  # N
    vocab: int                 # V
    chunk: int
    logits_bytes: int          # one [N, V] tensor: what the reference holds three of at once


def _def(v: Value, op: str) -> Instruction | None:
    ins = getattr(v, "instr", None)
    return ins if ins is not None and ins.op.name == op else None


def _match(nll: Instruction, uses: dict[Value, int]) -> tuple[Value, Value, list[Instruction]] | None:
    """(x, w, replaced instructions) of a head feeding ``nll``, or None."""
    logp = nll.operands[0]
    ls = _def(logp, "log_softmax")
    if ls is None or uses.get(logp, 0) != 1 or ls.attrs["axis"] != 1:
        return None
    chain = [nll, ls]
    z = ls.operands[0]
    r = _def(z, "reshape")
    if r is not None and uses.get(z, 0) == 1:
        chain.append(r)
        z = r.operands[0]
    mm = _def(z, "matmul")
    if mm is None or uses.get(z, 0) != 1 or mm.attrs.get("transpose_a") or not mm.attrs.get("transpose_b"):
        return None
    x, w = mm.operands
    n, v = logp.type.shape
    if w.type.rank != 2 or w.type.shape[0] != v or x.type.shape[-1] != w.type.shape[1] or x.type.numel != n * x.type.shape[-1]:
        return None  # a batched weight, or rows that do not line up with the targets
    chain.append(mm)
    return x, w, chain


def fuse_cross_entropy(f: Function, chunk: int | None = None) -> tuple[Function, list[Site]]:
    """A copy of ``f`` with every matching head and loss replaced by ``linear_cross_entropy``, and
    the sites replaced. ``chunk``: rows per chunk (default :func:`default_chunk`)."""
    def match(ins: Instruction, uses: dict[Value, int]):
        m = _match(ins, uses) if ins.op.name == "nll_loss" else None
        return None if m is None else (m[2], m)

    def emit(b: Builder, ins: Instruction, m) -> tuple[Value, Site]:
        x, w, chain = m
        n, v = ins.operands[0].type.shape
        rows = chunk or default_chunk(n, v, x.type.dtype.itemsize)
        b.loc = loc = chain[-1].loc
        x2 = x if x.type.rank == 2 else b.op("reshape", x, shape=(n, x.type.shape[-1]))
        loss, _ = b.op("linear_cross_entropy", x2, w, ins.operands[1], reduction=ins.attrs["reduction"],
                       ignore_index=ins.attrs["ignore_index"], chunk=rows)
        return loss, Site("(unknown)" if loc is None else (loc.path or "(top level)"), n, v, rows,
                          ins.operands[0].type.nbytes)

    return rewrite_matches(f, match, emit)


def cross_entropy_pass(module: Module) -> Module:
    """Replace each head's ``matmul -> log_softmax -> nll_loss`` by the chunked ``linear_cross_entropy``."""
    return Module([fuse_cross_entropy(f)[0] for f in module])
