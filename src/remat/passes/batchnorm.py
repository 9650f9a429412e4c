"""``split-batch-norm``: training-mode batch norm as its statistics and an element-wise normalisation.

A ``batch_norm`` in training mode becomes ``batch_norm_stats`` (the statistics pass: mean, invstd
and the running update) and one ``fused`` instruction ``y = x · α + β`` per channel, with
``α = invstd · weight`` and ``β = bias − mean · α`` (the form ATen's CPU kernel normalises with),
run by the numba dialect's generated kernel, or its interpretation in the others, bit for bit the
same. Nothing else changes: the backward already reads x and the statistics, never y
(``batch_norm_grad``). The fused instruction reads the statistics, not α and β: the backward keeps
the statistics alive anyway, so recomputing y never needs the statistics pass again.

Why: a planner that drops y now recomputes it with one element-wise pass over x, where recomputing
the composite ran the statistics again (the larger part of the kernel: ~1.7 of 1.9 ms on a
[8, 32, 64, 64] f32 input, one thread; the numba dialect's statistics kernel takes 0.2 ms). The
``fuse`` stage later runs the ReLU that usually follows in the same kernel. Forward and
recomputation evaluate y with the same ops, so a rematerialised step stays bit-identical to the
unconstrained one. Runs on every training graph before planning (``remat.step.prepare_joint``, and
the chain planner's stages). Eval-mode batch norm (running statistics, no reduction) is left whole.

Mixed-dtype batch norms (a bf16 or f16 input with float32 weight and statistics, as
``precision="bf16"`` captures them) are left whole, forward and backward: ATen's mixed-dtype kernel
reads the half-precision x and writes y (or grad_x) with no float32 copy of x, where the split form
needs statistics of a half-precision input (the numba statistics kernel takes f32 and f64 only), and
an f16 normalisation would run through the torch dialect's node-by-node interpretation of its body
(the numba dialect's element-wise kernels take bf16, not f16), each node's float32 result an
input-sized temporary.

Channels-last batch norms (channel ``axis`` not 1: ``remat.passes.layout``) are left whole too: ATen's
channels-last kernel computes statistics and normalisation together faster than its statistics pass
alone plus the element-wise instruction (zoo ResNet small, 15 batch norms per step: 1.5 ms whole
against 1.2 + 1.9 ms split), and recomputing y with it costs about one extra pass over x.
"""
from __future__ import annotations

from ..ir import Instruction, Module
from ..ir.ops.fused import Body, Node
from ..ir.ops.norm import _channel
from .decompose import expand_matching


def _body(affine: bool) -> str:
    """y from (x, mean, invstd[, weight, bias]), per channel as ATen's CPU kernel normalises:
    y = x * scale + shift with scale = invstd * weight, shift = bias - mean * scale."""
    if affine:  # operands 0-4; nodes from 5
        nodes = (Node("mul", (2, 3)), Node("mul", (1, 5)), Node("sub", (4, 6)), Node("mul", (0, 5)),
                 Node("add", (8, 7)))
        return Body(5, nodes, (9,)).text()
    nodes = (Node("mul", (1, 2)), Node("neg", (3,)), Node("mul", (0, 2)), Node("add", (5, 4)))  # from 3
    return Body(3, nodes, (6,)).text()


def _split(b, xs, attrs):
    x, affine = xs[0], attrs["affine"]
    running = xs[1 + 2 * affine:]
    stats = b.op("batch_norm_stats", x, *running, momentum=attrs["momentum"], eps=attrs["eps"], axis=attrs["axis"])
    rank = x.type.rank
    per_channel = [_channel(b, v, rank, attrs["axis"]) for v in [stats[0], stats[1]] + list(xs[1:3] if affine else [])]
    y = b.op("fused", x, *per_channel, body=_body(affine))
    return [y, *stats]


def _grad_body(affine: bool, n: int, dtype) -> str:
    """grad_x from (gy, x, mean, invstd, Σ gy·x̂, Σ gy[, weight]) as ATen's CPU backward computes it:
    ((gy − Σgy / n) − (x − mean) · (Σ gy·x̂ · invstd / n)) · invstd · weight."""
    const = Node("constant", (), tuple(sorted({"value": float(n), "shape": (), "dtype": dtype}.items())))
    k = 6 + affine  # the first node's number
    nodes = [const,                               # k     n
             Node("mul", (4, 3)),                 # k+1   Σ gy·x̂ · invstd
             Node("div", (k + 1, k)),             # k+2   the x̂ coefficient
             Node("sub", (1, 2)),                 # k+3   x − mean
             Node("mul", (k + 3, k + 2)),         # k+4
             Node("div", (5, k)),                 # k+5   the mean of gy
             Node("sub", (0, k + 5)),             # k+6
             Node("sub", (k + 6, k + 4)),         # k+7
             Node("mul", (k + 7, 3))]             # k+8
    if affine:
        nodes.append(Node("mul", (k + 8, 6)))     # k+9   · weight
    return Body(k, tuple(nodes), (k + len(nodes) - 1,)).text()


def _split_grad(b, xs, attrs):
    gy, x, mean, invstd, *w = xs
    rank, axis = x.type.rank, attrs["axis"]
    sums = b.op("batch_norm_grad_sums", gy, x, mean, invstd, axis=axis)
    per_channel = [_channel(b, v, rank, axis) for v in [mean, invstd, sums[0], sums[1], *w]]
    gx = b.op("fused", gy, x, *per_channel, body=_grad_body(bool(w), x.type.numel // x.type.shape[axis], x.type.dtype))
    return [gx, sums[0], sums[1]] if w else [gx]


def _mixed(ins: Instruction) -> bool:
    """A mixed-dtype batch norm (forward or backward): a half-precision input with float32
    per-channel operands, as under ``torch.autocast``."""
    return ins.operands[-1].type.dtype != ins.operands[0].type.dtype


def _is_training_bn(ins: Instruction) -> bool:
    """A training-mode batch norm with its channels on axis 1 (NCHW) and one dtype, the form this
    pass splits."""
    return ins.op.name == "batch_norm" and ins.attrs["training"] and ins.attrs["axis"] == 1 and not _mixed(ins)


def _is_training_bn_grad(ins: Instruction) -> bool:
    """A training-mode batch norm backward of one dtype, in any layout."""
    return ins.op.name == "batch_norm_grad" and ins.attrs["training"] and not _mixed(ins)


def split_batch_norm(module: Module) -> Module:
    """The ``split-batch-norm`` pass: a copy of ``module`` with every training-mode ``batch_norm``
    split (see the module's doc); ``module`` itself when it has none."""
    return expand_matching(module, _is_training_bn, _split)


def split_batch_norm_grad(module: Module) -> Module:
    """The ``split-batch-norm-grad`` pass: a copy of ``module`` with every training-mode
    ``batch_norm_grad`` (any layout) as ``batch_norm_grad_sums`` and one element-wise instruction
    for grad_x (ATen's formula, its operations in its order); ``module`` itself when it has none.

    Why: ATen's backward allocates its input-sized result twice (the first buffer unused), so the
    whole op needs an input-sized workspace beside its operands and result; split, the reduction
    allocates none. It is a memory-lean algorithm, not a default: on the zoo's conv nets the split
    step runs 4-6% slower than ATen's single kernel, and grad_x differs from it in the last bit of
    some elements. The planner uses it where the reference does not fit
    (``remat.train.api.TrainStep._lean_variants``)."""
    return expand_matching(module, _is_training_bn_grad, _split_grad)


def split_batch_norms(module: Module, grads: bool = False) -> Module:
    """What every differentiated training graph goes through (the whole step's joint and the chain
    planner's blocks alike, so that all plans run the same kernels): ``split-batch-norm`` and
    ``split-conv-bn-relu-pool``, and with ``grads`` (the lean algorithm chosen) ``split-batch-norm-grad``."""
    from .convblock import split_conv_bn_relu_pool

    module = split_conv_bn_relu_pool(split_batch_norm(module))
    return split_batch_norm_grad(module) if grads else module


__all__ = ["split_batch_norm", "split_batch_norm_grad", "split_batch_norms"]
