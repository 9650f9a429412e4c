"""``tile-conv-bn-pool``: a convolution → training batch norm → ReLU → max pool chain (a ResNet's
stem) as one batch-tiled ``conv_bn_relu_pool`` op (issue 10: a memory-lean algorithm).

The pattern, each value with no other user::

    c = conv2d(x, w) {groups = 1}
    z, mean, invstd[, rm', rv'] = batch_norm(c, gamma, beta[, rm, rv]) {training, affine, channel axis}
    r = relu(z)
    y[, idx] = max_pool2d[_with_indices](r)           # idx unused

becomes ``y, mean, invstd[, rm', rv'] = conv_bn_relu_pool(x, w, gamma, beta[, rm, rv])``. The
convolution's full-resolution output, its normalised and rectified forms and their gradients are
never IR values (see :mod:`remat.ir.ops.convblock`); the op convolves twice in its forward and
recomputes its forward once in its backward, and its values differ from the reference's by
summation order, so the rewrite is not in a default pipeline: the planner applies it as an
algorithm choice it reports (``remat.plan.algorithms``). A model input ``x`` (the function's
parameters from ``n_params`` on) gets no input gradient (``input_grad=false``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Builder, Function, Instruction, Module, Value
from ..ir.core import BlockArg
from ..ir.ops.convblock import output_attrs, stats_attrs
from ..ir.ops.nn import nchw
from ._rewrite import apply_replacements, rewrite_matches
from .decompose import expand_matching

TILES = 64
"""The batch is cut into at most this many tiles: a tile's full-resolution temporaries are then
about 1/64 of the reference's (a stem at batch 512: 8 samples a tile)."""

MIN_TILE_BYTES = 512 * 1024
"""The faster tiling's least convolution output per tile (or the whole batch): smaller tiles cost
more in per-call overhead and fresh allocations (zoo ResNet's stem at batch 16, forward and
backward: 16 ms a step in tiles of 1 sample, 6.7 ms in tiles of 4, 8.8 ms whole; eager 3 ms). The
planner tries it first and tiles of 1/``TILES`` of the batch (``min_tile_bytes=0``) when it does not
fit, since at small batches its tiles' temporaries can set the floor (``remat.plan.algorithms``)."""


@dataclass
class Site:
    """One chain rewritten: where, the batch tile, and the bytes of one full-resolution activation."""

    where: str
    batch: int
    tile: int
    activation_bytes: int


def _match(pool: Instruction, uses: dict[Value, int]) -> tuple[Instruction, Instruction, Instruction] | None:
    """(conv, batch_norm, relu) feeding ``pool`` as the pattern says, or None."""
    if pool.op.name == "max_pool2d_with_indices" and uses.get(pool.results[1], 0):
        return None
    relu = getattr(pool.operands[0], "instr", None)
    if relu is None or relu.op.name != "relu" or uses.get(relu.results[0], 0) != 1:
        return None
    bn = getattr(relu.operands[0], "instr", None)
    if (bn is None or bn.op.name != "batch_norm" or bn.results[0] is not relu.operands[0]
            or uses.get(bn.results[0], 0) != 1 or not bn.attrs["training"] or not bn.attrs["affine"]
            or any(v.type.dtype != bn.operands[0].type.dtype for v in bn.operands)):  # one dtype, not mixed
        return None
    conv = getattr(bn.operands[0], "instr", None)
    if (conv is None or conv.op.name != "conv2d" or conv.attrs.get("groups", 1) != 1 or uses.get(conv.results[0], 0) != 1
            or conv.attrs.get("weight_layout", "OIHW") != "OIHW"):
        return None
    layout = conv.attrs.get("layout", "NCHW")
    if pool.attrs.get("layout", "NCHW") != layout or bn.attrs["axis"] != (1 if layout == "NCHW" else 3):
        return None
    # The op defines the statistics where the pool was: nothing between the two may read them.
    instrs = pool.block.instrs
    stats = set(bn.results[1:])
    if any(stats.intersection(i.operands) for i in instrs[instrs.index(bn) + 1:instrs.index(pool)]):
        return None
    return conv, bn, relu


def tile_conv_bn_pool(f: Function, n_params: int, min_tile_bytes: int = MIN_TILE_BYTES) -> tuple[Function, list[Site]]:
    """A copy of ``f`` with every matching chain replaced by ``conv_bn_relu_pool`` (see the module's
    doc), and one :class:`Site` per rewrite (none when nothing matched). ``n_params``: the leading
    parameters of ``f`` that are differentiated (the rest are inputs, given no gradient). A tile is
    1/:data:`TILES` of the batch, or more samples to hold ``min_tile_bytes`` of convolution output."""
    extra: dict[Value, Value] = {}  # batch norm's statistics -> the op's

    def match(ins: Instruction, uses: dict[Value, int]):
        if ins.op.name not in ("max_pool2d", "max_pool2d_with_indices"):
            return None
        m = _match(ins, uses)
        return None if m is None else (list(m), m)

    def emit(b: Builder, pool: Instruction, m: tuple[Instruction, Instruction, Instruction]) -> tuple[Value, Site]:
        conv, bn, _ = m
        x, w = conv.operands
        a = conv.attrs
        out_t = conv.results[0].type
        n = nchw("conv2d", out_t, a)[0]
        tile = min(n, max(-(-n // TILES), -(-min_tile_bytes * n // out_t.nbytes)))
        model_input = (isinstance(x, BlockArg) and x.index >= n_params and x.block.function is not None
                       and x.block is x.block.function.entry)
        b.loc = bn.loc
        outs = b.op("conv_bn_relu_pool", x, w, *bn.operands[1:],
                    stride=a.get("stride", (1, 1)), padding=a.get("padding", (0, 0)),
                    dilation=a.get("dilation", (1, 1)), layout=a.get("layout", "NCHW"),
                    input_layout=a.get("input_layout", ""), eps=bn.attrs["eps"], momentum=bn.attrs["momentum"],
                    pool_kernel=pool.attrs["kernel"], pool_stride=pool.attrs["stride"] or pool.attrs["kernel"],
                    pool_padding=pool.attrs["padding"], tile=tile, input_grad=not model_input)
        for old, new in zip(bn.results[1:], outs[1:]):
            extra[old] = new
        where = "(unknown)" if conv.loc is None else (conv.loc.path or "(top level)")
        return outs[0], Site(where, n, tile, conv.results[0].type.nbytes)

    out, sites = rewrite_matches(f, match, emit)
    apply_replacements(out, extra)
    return out, sites


def _split(b: Builder, xs, attrs):
    x, w, gamma, beta, *running = xs
    stats = b.op("conv_bn_stats", x, w, *running, **stats_attrs(attrs))
    y = b.op("conv_bn_relu_pool_apply", x, w, gamma, beta, stats[0], stats[1], **output_attrs(attrs))
    return [y, *stats]


def split_conv_bn_relu_pool(module: Module) -> Module:
    """The ``split-conv-bn-relu-pool`` pass, on differentiated graphs: each ``conv_bn_relu_pool`` as its
    statistics pass (``conv_bn_stats``) and its output pass (``conv_bn_relu_pool_apply``), which the
    combined kernels run bit for bit the same. The backward reads the statistics, never y, so a
    plan that drops y recomputes it with the output pass alone (one convolution per tile instead of
    two). ``module`` itself when it has none."""
    return expand_matching(module, lambda ins: ins.op.name == "conv_bn_relu_pool", _split)


def tile_conv_bn_pool_pass(module: Module, n_params: int | None = None) -> Module:
    """Replace each convolution → batch norm → ReLU → max pool chain by ``conv_bn_relu_pool``.
    ``n_params`` None: any parameter may be differentiated, so every op keeps its input gradient."""
    return Module([tile_conv_bn_pool(f, len(f.params) if n_params is None else n_params)[0] for f in module])


__all__ = ["MIN_TILE_BYTES", "Site", "TILES", "split_conv_bn_relu_pool", "tile_conv_bn_pool", "tile_conv_bn_pool_pass"]
