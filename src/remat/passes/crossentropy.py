"""Cross-entropy rewrites (a pattern and a rule each, RAF §3.2.2).

``fuse_log_softmax_nll`` (the import pipeline's ``cross-entropy`` pass): ``nll_loss(log_softmax(z,
axis=1), target)`` whose log-probabilities have no other user becomes one ``cross_entropy(z,
target)``. Its backward writes the logits' gradient over the logits, so the step holds one [N, C]
tensor where the pair holds three at once (the log-probabilities, nll_loss's one-hot gradient and
log_softmax's gradient), and runs two passes over it instead of five. Values change by rounding
only (the softmax comes from ``exp(z - logsumexp)``, not from exp of the log-probabilities), as after
the attention and GELU passes. In the same pass, ``fold_upcast``: a ``cross_entropy`` of bf16 or f16
logits converted to f32 (``torch.autocast`` computes the loss in f32; Hugging Face's losses call
``.float()``) reads the low-precision logits itself (``upcast``), so the step never holds their f32
copy nor its f32 gradient; values are unchanged, bit for bit.

``fuse_cross_entropy``: a language-model head's ``matmul -> cross_entropy`` (or ``matmul ->
log_softmax -> nll_loss``) as the chunked ``linear_cross_entropy`` op (issue 10: the memory-lean
algorithm of the loss). The pattern, read backwards from the loss::

    z = matmul(x, w) {transpose_b=true}     # x [..., d], w [V, d]: a bias-free nn.Linear head
    z = reshape(z, [N, V])                  # optional (F.cross_entropy on a flattened [B, T, V])
    l, _ = cross_entropy(z, target)         # or p = log_softmax(z, axis=1); l = nll_loss(p, target)

The logits (and log-probabilities, and logsumexp) must have no other user. The rewrite changes the
algorithm, not the function: values equal the reference's up to summation order (``dw`` is summed
chunk by chunk), so it is not part of any default pipeline; the planner applies it as a choice it
reports (``remat.plan.algorithms``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Builder, Function, Instruction, Module, Value
from ..ir.ops.crossentropy import DEFAULT_CHUNK
from ..ir.types import DType
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
    logits_bytes: int          # one [N, V] tensor
    held: int = 3              # how many of them the reference holds at once (cross_entropy: 1)


def _def(v: Value, op: str) -> Instruction | None:
    ins = getattr(v, "instr", None)
    return ins if ins is not None and ins.op.name == op else None


def _log_softmax_feeding(nll: Instruction, uses: dict[Value, int]) -> Instruction | None:
    """The ``log_softmax(z, axis=1)`` of logits [N, C] whose result ``nll`` reads and nothing else does, or None."""
    ls = _def(nll.operands[0], "log_softmax")
    return (ls if ls is not None and uses.get(ls.results[0], 0) == 1 and ls.attrs["axis"] == 1
            and ls.results[0].type.rank == 2 else None)  # cross_entropy takes rows [N, C]; not an image's pixels


def _match(nll: Instruction, uses: dict[Value, int]) -> tuple[Value, Value, list[Instruction]] | None:
    """(x, w, replaced instructions) of a head feeding ``nll`` (an ``nll_loss`` or a ``cross_entropy``), or None."""
    if nll.operands[0].type.rank != 2:
        return None  # one class per position of an image ([N, C, H, W]), not a head's rows
    if nll.op.name == "cross_entropy":
        if uses.get(nll.results[1], 0):
            return None  # the logsumexp is read
        chain, z = [nll], nll.operands[0]
    else:
        ls = _log_softmax_feeding(nll, uses)
        if ls is None:
            return None
        chain, z = [nll, ls], ls.operands[0]
    n, v = z.type.shape
    r = _def(z, "reshape")
    if r is not None and uses.get(z, 0) == 1:
        chain.append(r)
        z = r.operands[0]
    mm = _def(z, "matmul")
    if mm is None or uses.get(z, 0) != 1 or mm.attrs.get("transpose_a") or not mm.attrs.get("transpose_b"):
        return None
    x, w = mm.operands
    if w.type.rank != 2 or w.type.shape[0] != v or x.type.shape[-1] != w.type.shape[1] or x.type.numel != n * x.type.shape[-1]:
        return None  # a batched weight, or rows that do not line up with the targets
    chain.append(mm)
    return x, w, chain


def fuse_cross_entropy(f: Function, chunk: int | None = None) -> tuple[Function, list[Site]]:
    """A copy of ``f`` with every matching head and loss replaced by ``linear_cross_entropy``, and
    the sites replaced. ``chunk``: rows per chunk (default :func:`default_chunk`)."""
    def match(ins: Instruction, uses: dict[Value, int]):
        m = _match(ins, uses) if ins.op.name in ("nll_loss", "cross_entropy") else None
        return None if m is None else (m[2], m)

    def emit(b: Builder, ins: Instruction, m) -> tuple[Value, Site]:
        x, w, chain = m
        n, v = ins.operands[0].type.shape
        # A low-precision head computes each chunk in f32 too: its chunk is sized by the f32 bytes.
        rows = chunk or default_chunk(n, v, max(x.type.dtype.itemsize, 4))
        b.loc = loc = chain[-1].loc
        x2 = x if x.type.rank == 2 else b.op("reshape", x, shape=(n, x.type.shape[-1]))
        loss, _ = b.op("linear_cross_entropy", x2, w, ins.operands[1], reduction=ins.attrs["reduction"],
                       ignore_index=ins.attrs["ignore_index"], chunk=rows, upcast=ins.attrs.get("upcast", False))
        return loss, Site("(unknown)" if loc is None else (loc.path or "(top level)"), n, v, rows,
                          ins.operands[0].type.nbytes, 1 if ins.op.name == "cross_entropy" else 3)

    return rewrite_matches(f, match, emit)


def fuse_log_softmax_nll(f: Function) -> tuple[Function, int]:
    """A copy of ``f`` with each ``nll_loss(log_softmax(z, axis=1), t)`` whose log-probabilities have no
    other user replaced by ``cross_entropy(z, t)``, and how many were."""
    def match(ins: Instruction, uses: dict[Value, int]):
        ls = _log_softmax_feeding(ins, uses) if ins.op.name == "nll_loss" else None
        return None if ls is None else ([ls], ls)

    def emit(b: Builder, ins: Instruction, ls: Instruction) -> tuple[Value, None]:
        b.loc = ins.loc
        loss, _ = b.op("cross_entropy", ls.operands[0], ins.operands[1], reduction=ins.attrs["reduction"],
                       ignore_index=ins.attrs["ignore_index"])
        return loss, None

    g, sites = rewrite_matches(f, match, emit)
    return g, len(sites)


def fold_upcast(f: Function) -> tuple[Function, int]:
    """A copy of ``f`` with each ``cross_entropy(cast(z, f32), t)`` of bf16 or f16 logits ``z`` whose
    f32 copy has no other user (possibly reshaped to rows after the cast, as Hugging Face's losses do)
    replaced by ``cross_entropy(z, t) {upcast}``, and how many were. The values are the same bit for
    bit (the kernel converts a chunk of rows at a time, the gradient is rounded to z's dtype as the
    cast's gradient is); the f32 logits and their f32 gradient, each twice the bytes of z, are never
    whole."""
    def match(ins: Instruction, uses: dict[Value, int]):
        if ins.op.name != "cross_entropy" or ins.attrs["upcast"]:
            return None
        gone, v = [], ins.operands[0]
        r = _def(v, "reshape")
        if r is not None and uses.get(v, 0) == 1:
            gone.append(r)
            v = r.operands[0]
        c = _def(v, "cast")
        if (c is None or c.attrs["dtype"] != DType.f32 or not c.operands[0].type.dtype.is_low
                or uses.get(v, 0) != 1):
            return None
        return gone + [c], (c.operands[0], r)

    def emit(b: Builder, ins: Instruction, m: tuple[Value, Instruction | None]) -> tuple[tuple[Value, Value], None]:
        z, r = m
        b.loc = ins.loc
        if r is not None:
            z = b.op("reshape", z, **r.attrs)
        return tuple(b.op("cross_entropy", z, ins.operands[1], **{**ins.attrs, "upcast": True})), None

    g, sites = rewrite_matches(f, match, emit)
    return g, len(sites)


def logits_cross_entropy_pass(module: Module) -> Module:
    """Replace each ``log_softmax -> nll_loss`` by one ``cross_entropy`` (:func:`fuse_log_softmax_nll`),
    reading low-precision logits without an f32 copy where it read one (:func:`fold_upcast`)."""
    return Module([fold_upcast(fuse_log_softmax_nll(f)[0])[0] for f in module])


def cross_entropy_pass(module: Module) -> Module:
    """Replace each head's ``matmul -> log_softmax -> nll_loss`` by the chunked ``linear_cross_entropy``."""
    return Module([fuse_cross_entropy(f)[0] for f in module])
