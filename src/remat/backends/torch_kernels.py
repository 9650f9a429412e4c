"""The ``torch`` dialect: PyTorch kernels, on :data:`DEVICE` (the CPU, or the device of the VM running them).

Operands arrive as torch tensors on :data:`DEVICE` (the VM converts NumPy arrays zero-copy on
CPU). Random ops draw with the numpy dialect's own samplers (Philox for uniform/normal, the
SplitMix64 counter stream for bernoulli masks) and convert the result, so both dialects give
bit-identical samples. Checkers refuse what torch cannot do here
(e.g. integer or bool matmul), so those instructions fall back to the numpy dialect.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..ir.ops.nn import with_class_axis
from ..ir.types import DType
from . import kernel, numpy_kernels as npk, out_kernel
from ._layout import channels_at_1, nchw_kernel

DEVICE = torch.device("cpu")
"""Where the kernels run and create tensors: the CPU, or the device of the VM running them
(``remat.runtime.vm.VM(device=...)`` sets it for the duration of a run; a compiled step runs on its
model's device). Never chosen from what the machine has: a CPU model on a machine with a GPU stays
on the CPU."""


@contextlib.contextmanager
def on_device(device: torch.device | None) -> Iterator[None]:
    """Kernels run, and their checkers decide, for ``device`` inside the block (None: leave it)."""
    global DEVICE
    if device is None:
        yield
        return
    saved, DEVICE = DEVICE, device
    try:
        yield
    finally:
        DEVICE = saved


TORCH_DTYPE = {DType.bool: torch.bool, DType.i32: torch.int32, DType.i64: torch.int64, DType.f16: torch.float16,
               DType.bf16: torch.bfloat16, DType.f32: torch.float32, DType.f64: torch.float64}
FROM_TORCH = {v: k for k, v in TORCH_DTYPE.items()}
_LOWP = (torch.float16, torch.bfloat16)


def to_torch(a) -> torch.Tensor:
    """A tensor on :data:`DEVICE` for a NumPy array (zero-copy on CPU; bf16 through an int16 view)."""
    if isinstance(a, torch.Tensor):
        return a if a.device == DEVICE else a.to(DEVICE)
    a = np.asarray(a)
    if not a.flags.writeable:  # torch.from_numpy warns on read-only arrays; copying keeps the contract simple
        a = a.copy()
    if a.dtype == DType.bf16.numpy:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if DEVICE.type == "cpu" else t.to(DEVICE)


def to_numpy(t) -> np.ndarray:
    """A NumPy array for a tensor (zero-copy for CPU tensors)."""
    if isinstance(t, np.ndarray):
        return t
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(DType.bf16.numpy)
    return t.numpy()


def _operand_dtypes(instr):
    return {v.type.dtype for v in instr.operands} | {r.type.dtype for r in instr.results}


def no_bool(instr) -> bool:
    return DType.bool not in {v.type.dtype for v in instr.operands}


def floats_only(instr) -> bool:
    return all(v.type.dtype.is_float for v in instr.operands)


def k(op: str, checker=None):
    return kernel(op, "torch", checker)


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it already owns exactly its contiguous bytes, else a contiguous copy."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


# ---------------------------------------------------------------- unary
for _n, _f in {"exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "tanh": torch.tanh,
               "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos, "erf": torch.erf,
               "neg": torch.neg, "abs": torch.abs, "sign": torch.sign, "floor": torch.floor}.items():
    k(_n)(_f)


@k("relu")
def relu(x):
    return torch.clamp_min(x, 0)


@k("relu_grad")
def relu_grad(g, y):
    return torch.ops.aten.threshold_backward(g, y, 0)


@k("hardtanh")
def hardtanh(x, min_val=-1.0, max_val=1.0):
    return F.hardtanh(x, min_val, max_val)


@k("hardtanh_grad")
def hardtanh_grad(g, v, min_val=-1.0, max_val=1.0):
    return _fresh(torch.ops.aten.hardtanh_backward(g, v, min_val, max_val))


@k("silu")
def silu(x):
    return F.silu(x)


@k("silu_grad")
def silu_grad(g, x):
    return _fresh(torch.ops.aten.silu_backward(g, x))


@k("gelu")
def gelu(x, approximate="none"):
    return F.gelu(x, approximate=approximate)


@k("not")
def not_(x):
    return torch.logical_not(x)


# ---------------------------------------------------------------- binary
for _n, _f in {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum,
               "minimum": torch.minimum, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le,
               "gt": torch.gt, "ge": torch.ge, "and": torch.logical_and, "or": torch.logical_or}.items():
    k(_n)(_f)


@k("div")
def div(a, b):
    if a.dtype.is_floating_point:
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="floor")


@k("pow", checker=floats_only)  # integer pow with negative exponents errors in torch
def pow_(a, b):
    return torch.pow(a, b)


@k("select")
def select(c, a, b):
    return torch.where(c, a, b)


@k("cast")
def cast(x, dtype):
    return x.to(TORCH_DTYPE[dtype], copy=True)


@k("copy")
def copy(x):
    return x.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- reductions, softmax, matmul
@k("cumsum")
def cumsum(x, axis, reverse=False):
    if reverse:
        return _fresh(torch.cumsum(x.flip(axis), dim=axis, dtype=x.dtype).flip(axis))
    return _fresh(torch.cumsum(x, dim=axis, dtype=x.dtype))


@k("reduce_sum")
def reduce_sum(x, axes, keepdims=False):
    if not axes:
        return x.clone(memory_format=torch.contiguous_format)
    if x.dtype == torch.bool:
        return _fresh(torch.any(x, dim=tuple(axes), keepdim=keepdims) if len(axes) == 1 else
                      x.sum(dim=tuple(axes), keepdim=keepdims) > 0)
    return _fresh(torch.sum(x, dim=tuple(axes), keepdim=keepdims, dtype=x.dtype))


@k("reduce_mean")
def reduce_mean(x, axes, keepdims=False):
    if not axes:
        return x.clone(memory_format=torch.contiguous_format)
    return _fresh(torch.mean(x, dim=tuple(axes), keepdim=keepdims))


@k("reduce_max")
def reduce_max(x, axes, keepdims=False):
    if not axes:
        return x.clone(memory_format=torch.contiguous_format)
    return _fresh(torch.amax(x, dim=tuple(axes), keepdim=keepdims))


@k("softmax")
def softmax(x, axis):
    return torch.softmax(x, dim=axis)


@k("log_softmax")
def log_softmax(x, axis):
    return torch.log_softmax(x, dim=axis)


@k("matmul", checker=lambda ins: all(v.type.dtype.is_float for v in ins.operands))
def matmul(a, b, transpose_a=False, transpose_b=False):
    """Transposed operands are ``.mT`` views: BLAS reads them in place, as eager's mm/bmm do."""
    return _fresh(torch.matmul(a.mT if transpose_a else a, b.mT if transpose_b else b))


# ---------------------------------------------------------------- composite ops with native backward kernels
# (issue 8: linear, softmax/log_softmax backward, gelu backward, negative log-likelihood)
_REDUCTION = {"none": 0, "mean": 1, "sum": 2}  # ATen's Reduction enum


@k("linear", checker=floats_only)
def linear(x, w, b):
    """F.linear: one addmm with the bias fused, like eager."""
    return _fresh(F.linear(x, w, b))


# ---------------------------------------------------------------- oneDNN matrix products (f32, large)
# PyTorch ships two CPU GEMMs: ATen's f32 mm/addmm call MKL's sgemm, and its bundled oneDNN runs
# the bf16 products and Inductor's CPU linear (``mkldnn::_linear_pointwise``). On this project's
# CPUs oneDNN is 5-15% faster for X·Wᵀ (+ bias) and G·W from 2^25 multiply-adds up (and slower
# below, where its per-call set-up dominates); with a transposed left operand (a weight gradient
# Gᵀ·X) it copies that operand and loses, so those stay with MKL. ``bench/gemm.py`` measures both
# over the zoo's and Hugging Face models' shapes. The choice is the instruction's (its shapes), made
# once when the program is planned, so every budget's plan runs the same kernel on the same shapes and
# gradients stay bit-identical across budgets; results differ from MKL's in the last bits (a different
# summation order). REMAT_ONEDNN_GEMM=0 in the environment turns it off (read once, at import: programs
# planned in one process agree; tests and benchmarks that flip :data:`ONEDNN_GEMM` call
# ``remat.runtime.allocator.clear_cache()``, whose workspaces are per implementation).
ONEDNN_MIN_MACS = 2**25
ONEDNN_GEMM = os.environ.get("REMAT_ONEDNN_GEMM", "1") != "0"
_LINEAR_POINTWISE = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def _onednn_gemm_on() -> bool:
    return (ONEDNN_GEMM and DEVICE.type == "cpu" and _LINEAR_POINTWISE is not None
            and torch.backends.mkldnn.is_available())


def onednn_gemm(ins) -> bool:
    """Whether a ``linear`` or ``matmul`` instruction runs on oneDNN: f32 operands, a 2-D right
    operand (the weight), no transposed left operand, at least :data:`ONEDNN_MIN_MACS` multiply-adds."""
    if not all(v.type.dtype == DType.f32 for v in ins.operands) or not _onednn_gemm_on():
        return False
    a, w = ins.operands[0].type, ins.operands[1].type
    if w.rank != 2 or a.rank < 2 or ins.attrs.get("transpose_a", False):
        return False
    k = a.shape[-1]
    n = w.shape[0] if ins.op.name == "linear" or ins.attrs.get("transpose_b", False) else w.shape[1]
    return int(np.prod(a.shape[:-1], dtype=np.int64)) * k * n >= ONEDNN_MIN_MACS


@kernel("linear", "torch", checker=onednn_gemm, priority=15)
def linear_onednn(x, w, b):
    """x·wᵀ + b in one oneDNN call (the bias a post-op, as addmm adds it)."""
    return _fresh(_LINEAR_POINTWISE(x, w, b, "none", [], ""))


@kernel("matmul", "torch", checker=onednn_gemm, priority=15)
def matmul_onednn(a, b, transpose_a=False, transpose_b=False):
    """a·b (or a·bᵀ) as oneDNN's linear of a with weight bᵀ (or b): a strided view, not a copy."""
    return _fresh(_LINEAR_POINTWISE(a, b if transpose_b else b.mT, None, "none", [], ""))


@k("softmax_grad")
def softmax_grad(g, y, axis):
    return _fresh(torch.ops.aten._softmax_backward_data(g, y, axis, y.dtype))


@k("log_softmax_grad")
def log_softmax_grad(g, y, axis):
    return _fresh(torch.ops.aten._log_softmax_backward_data(g, y, axis, y.dtype))


@k("gelu_grad")
def gelu_grad(g, x, approximate="none"):
    return _fresh(torch.ops.aten.gelu_backward(g, x, approximate=approximate))


# ---------------------------------------------------------------- out-variants (remat.ir.reuse)
# Each element-wise kernel above, writing into ``out`` (an operand of the result's type that dies
# here): the same ATen kernel with ``out=`` (full overlap with an input is what ``x.add_(y)`` does),
# so the same bits.
def _out(op: str):
    return out_kernel(op, "torch")


for _n, _f in {"exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "tanh": torch.tanh,
               "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos, "erf": torch.erf, "neg": torch.neg,
               "abs": torch.abs, "sign": torch.sign, "floor": torch.floor, "not": torch.logical_not}.items():
    _out(_n)(lambda out, x, _f=_f: _f(x, out=out))
for _n, _f in {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum,
               "minimum": torch.minimum, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le,
               "gt": torch.gt, "ge": torch.ge, "and": torch.logical_and, "or": torch.logical_or}.items():
    _out(_n)(lambda out, a, b, _f=_f: _f(a, b, out=out))


@_out("relu")
def relu_out(out, x):
    return torch.clamp_min(x, 0, out=out)


@_out("relu_grad")
def relu_grad_out(out, g, y):
    return torch.ops.aten.threshold_backward.grad_input(g, y, 0, grad_input=out)


@_out("hardtanh")
def hardtanh_out(out, x, min_val=-1.0, max_val=1.0):
    return torch.ops.aten.hardtanh.out(x, min_val, max_val, out=out)


@_out("hardtanh_grad")
def hardtanh_grad_out(out, g, v, min_val=-1.0, max_val=1.0):
    return torch.ops.aten.hardtanh_backward.grad_input(g, v, min_val, max_val, grad_input=out)


@_out("silu")
def silu_out(out, x):
    return torch.ops.aten.silu.out(x, out=out)


@_out("silu_grad")
def silu_grad_out(out, g, x):
    return torch.ops.aten.silu_backward.grad_input(g, x, grad_input=out)


@_out("gelu")
def gelu_out(out, x, approximate="none"):
    return torch.ops.aten.gelu.out(x, approximate=approximate, out=out)


@_out("gelu_grad")
def gelu_grad_out(out, g, x, approximate="none"):
    return torch.ops.aten.gelu_backward.grad_input(g, x, approximate=approximate, grad_input=out)


@_out("div")
def div_out(out, a, b):
    if a.dtype.is_floating_point:
        return torch.div(a, b, out=out)
    return torch.div(a, b, rounding_mode="floor", out=out)


@_out("pow")
def pow_out(out, a, b):
    return torch.pow(a, b, out=out)


@_out("select")
def select_out(out, c, a, b):
    return torch.where(c, a, b, out=out)


def _nll_4d(logp, t):
    """Log-probabilities [N, C, d1, ...] and targets [N, d1, ...] as ATen's nll_loss2d takes them
    ([N, C, H, W] and [N, H, W]; other ranks with their positions in one axis, as ATen's nll_loss_nd)."""
    if logp.dim() == 4:
        return logp, t
    n, c = logp.shape[:2]
    return logp.reshape(n, c, 1, -1), t.reshape(n, 1, -1)


@k("nll_loss", checker=lambda ins: ins.operands[0].type.dtype.is_float)
def nll_loss(logp, target, reduction="mean", ignore_index=-100):
    npk.check_targets("nll_loss", target, logp.shape[1], ignore_index)
    t = target.to(torch.int64)
    if logp.dim() == 2:
        out, _ = torch.ops.aten.nll_loss_forward(logp, t, None, _REDUCTION[reduction], ignore_index)
    else:  # one class per position: ATen's nll_loss2d
        out, _ = torch.ops.aten.nll_loss2d_forward(*_nll_4d(logp, t), None, _REDUCTION[reduction], ignore_index)
        out = out.reshape(target.shape) if reduction == "none" else out
    return _fresh(out)


@k("nll_loss_grad", checker=lambda ins: ins.operands[0].type.dtype.is_float)
def nll_loss_grad(g, target, num_classes, reduction="mean", ignore_index=-100):
    npk.check_targets("nll_loss_grad", target, num_classes, ignore_index)
    t = target.to(torch.int64)
    shape = with_class_axis(tuple(t.shape), num_classes)
    # ATen reads only the shape and dtype of the forward input: a broadcast scalar stands for it.
    like = torch.empty((), dtype=g.dtype, device=g.device).expand(shape)
    total = (t != ignore_index).sum().to(g.dtype) if reduction == "mean" else torch.ones((), dtype=g.dtype, device=g.device)
    if t.dim() == 1:
        return _fresh(torch.ops.aten.nll_loss_backward(g, like, t, None, _REDUCTION[reduction], ignore_index, total))
    like4, t4 = _nll_4d(like, t)
    g4 = g.reshape(t4.shape) if reduction == "none" else g
    gx = torch.ops.aten.nll_loss2d_backward(g4, like4, t4, None, _REDUCTION[reduction], ignore_index, total)
    return _fresh(gx.reshape(shape))


# ---------------------------------------------------------------- layouts (remat.backends._layout)
# An NHWC operand is handed to ATen as an NCHW view with channels-last strides (no copy): ATen then
# runs its channels-last kernels and returns channels-last results, whose NHWC view is contiguous
# (``_act`` keeps them as they are, so the view needs no ``fresh``). An NCHW input of a
# channels-last convolution (``input_layout``) is read as it is.
def _nchw_kernel(op: str):
    return nchw_kernel(lambda a, perm: a.permute(perm), None, op, pass_channels_last=True)


def _channels_at_1(n_acts: int):
    return channels_at_1(lambda a, perm: a.permute(perm), _fresh, n_acts, pass_channels_last=True)


def _act(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """An activation result: fresh and contiguous, or with ``channels_last`` dense channels-last (as
    ATen returns it: its NHWC view is then contiguous); copied only when it is neither."""
    if not channels_last:
        return _fresh(t)
    if (t.is_contiguous(memory_format=torch.channels_last) and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
        return t
    return t.clone(memory_format=torch.channels_last)


def _cl_weight(w: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """The weight a channels-last convolution backward reads: a channels-last copy (ATen makes one
    anyway; made here, oneDNN's backward runs 2-7% faster on the zoo's shapes)."""
    return w.contiguous(memory_format=torch.channels_last) if channels_last else w


def _weight_grad(gw: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A weight gradient: with ``channels_last`` (an OHWI weight, ``weight_layout``) in channels-last
    strides, as oneDNN computes it for NHWC activations (its OHWI view is then contiguous: no copy);
    else OIHW and contiguous (a copy of a channels-last one)."""
    return _act(gw, True) if channels_last else _fresh(gw)


def _like(shape, t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """An uninitialised stand-in of ``shape`` (ATen reads only its shape and memory format)."""
    return torch.empty(tuple(shape), dtype=t.dtype, device=t.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)


# ---------------------------------------------------------------- convolution and pooling
@k("conv2d")
@_nchw_kernel("conv2d")
def conv2d(x, w, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, channels_last=False,
           weight_channels_last=False):
    if channels_last and not x.is_contiguous(memory_format=torch.channels_last):
        # An NCHW input (input_layout): with a channels-last weight ATen computes channels-last.
        w = w.contiguous(memory_format=torch.channels_last)
    return _act(F.conv2d(x, w, None, stride, padding, dilation, groups), channels_last)


@k("conv2d_input_grad")
@_nchw_kernel("conv2d_input_grad")
def conv2d_input_grad(gy, w, input_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1,
                      channels_last=False, weight_channels_last=False):
    """The transposed convolution of ``gy`` with ``w`` (ATen's ``conv_transpose2d``), its output
    padding chosen to give ``input_shape``. Bit-identical to ``convolution_backward``'s input
    gradient (``conv2d_grads``, which the siblings pass merges a pair into where the plan's peak
    allows, so the two must agree for gradients to stay bit-identical across budgets), which needs
    an input-sized stand-in for the input (ATen reads only its shape), an allocation as large as the
    result: on the zoo U-Net's channels-last shapes this is 1-4 MiB less workspace and up to 3.5x
    faster (stride-2 2x2 kernels).

    But for 1x1 kernels: on one thread oneDNN's transposed convolution and its backward differ in
    the last bits when the input channels are no multiple of 4 on some small maps (1x1 and 3x3,
    NCHW and channels-last; EfficientNet's squeeze-excite), so those take ``convolution_backward``
    itself: 2-4% slower on 1x1 convolutions, with an input-sized stand-in. Ungrouped larger kernels
    agreed on every shape scanned (2-16 pixels, strides 1-2, both layouts, 1 and 2 threads); grouped
    ones do not, and ``conv2d_grads`` computes their input gradient here instead."""
    return _input_grad(gy, w, input_shape, stride, padding, dilation, groups, channels_last)


def _input_grad(gy, w, input_shape, stride, padding, dilation, groups, channels_last):
    if tuple(w.shape[2:]) == (1, 1):
        gx = torch.ops.aten.convolution_backward(gy, _like(input_shape, gy, channels_last), _cl_weight(w, channels_last),
                                                 None, list(stride), list(padding), list(dilation), False, [0, 0],
                                                 groups, [True, False, False])[0]
        return _act(gx, channels_last)
    out_padding = [size - ((o - 1) * s - 2 * p + d * (k - 1) + 1)
                   for size, o, s, p, d, k in zip(input_shape[2:], gy.shape[2:], stride, padding, dilation, w.shape[2:])]
    gx = torch.conv_transpose2d(gy, _cl_weight(w, channels_last), None, list(stride), list(padding), out_padding,
                                groups, list(dilation))
    return _act(gx, channels_last)


@k("conv2d_weight_grad")
@_nchw_kernel("conv2d_weight_grad")
def conv2d_weight_grad(x, gy, weight_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1,
                       channels_last=False, weight_channels_last=False):
    # As for the input gradient: only the weight's shape and layout are read, and a contiguous stand-in
    # (not torch.nn.grad.conv2d_weight's stride-0 expanded one) is 5-15% faster; bit-identical results.
    return _weight_grad_of(x, gy, weight_shape, stride, padding, dilation, groups, channels_last, weight_channels_last)


def _weight_grad_of(x, gy, weight_shape, stride, padding, dilation, groups, channels_last, weight_channels_last):
    like = _like(weight_shape, gy, channels_last)  # channels-last also for an NCHW input (input_layout)
    gw = torch.ops.aten.convolution_backward(gy, x, like, None, list(stride), list(padding), list(dilation), False,
                                             [0, 0], groups, [False, True, False])[1]
    return _weight_grad(gw, weight_channels_last)


@k("conv2d_grads")
@_nchw_kernel("conv2d_grads")
def conv2d_grads(gy, x, w, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, channels_last=False,
                 weight_channels_last=False):
    # One call for both gradients: bit-identical to the two single-gradient calls above (same oneDNN
    # algorithms), and ~30% faster on small feature maps, where preparing gy once dominates. But for
    # grouped kernels larger than 1x1: there oneDNN's backward and the transposed convolution of
    # conv2d_input_grad differ in the last bits (groups 2-16, channels-last on 1 and 2 threads, some
    # strided NCHW; Hugging Face RegNet: 54 of 82 gradients 1e-7 apart between two budgets, the pairs
    # merged in one and not the other), so both gradients come from the single kernels: about 4%
    # slower on depthwise shapes, and no input-sized stand-in for an unmerged input gradient (which,
    # as convolution_backward, cost MobileNetV2 at its floor +12% of recomputation).
    if groups != 1 and tuple(w.shape[2:]) != (1, 1):
        gx = _input_grad(gy, w, tuple(x.shape), stride, padding, dilation, groups, channels_last)
        return gx, _weight_grad_of(x, gy, tuple(w.shape), stride, padding, dilation, groups, channels_last,
                                   weight_channels_last)
    wc = _cl_weight(w, channels_last)
    gx, gw, _ = torch.ops.aten.convolution_backward(gy, x, wc, None, list(stride), list(padding), list(dilation),
                                                    False, [0, 0], groups, [True, True, False])
    del wc  # freed before a channels-last gw is copied to OIHW: two weight-sized buffers at once, not three
    return _act(gx, channels_last), _weight_grad(gw, weight_channels_last)


@k("max_pool2d")
@_nchw_kernel("max_pool2d")
def max_pool2d(x, kernel, stride, padding=(0, 0), channels_last=False):
    return _act(F.max_pool2d(x, kernel, stride, padding), channels_last)


@k("avg_pool2d")
@_nchw_kernel("avg_pool2d")
def avg_pool2d(x, kernel, stride, padding=(0, 0), channels_last=False):
    return _act(F.avg_pool2d(x, kernel, stride, padding, ceil_mode=False, count_include_pad=True), channels_last)


@k("max_pool2d_grad")
@_nchw_kernel("max_pool2d_grad")
def max_pool2d_grad(x, gy, kernel, stride, padding=(0, 0), channels_last=False):
    """Routes each window's gradient to the index torch's forward picks (first maximum on ties)."""
    _, idx = F.max_pool2d(x, kernel, stride, padding, return_indices=True)
    return _act(torch.ops.aten.max_pool2d_with_indices_backward(gy, x, list(kernel), list(stride), list(padding),
                                                                [1, 1], False, idx), channels_last)


@k("max_pool2d_with_indices")
@_nchw_kernel("max_pool2d_with_indices")
def max_pool2d_with_indices(x, kernel, stride, padding=(0, 0), index_dtype=DType.i64, channels_last=False):
    y, idx = torch.ops.aten.max_pool2d_with_indices(x, list(kernel), list(stride), list(padding))
    return _act(y, channels_last), _act(idx.to(TORCH_DTYPE[index_dtype]), channels_last)


@k("max_pool2d_index_grad")
@_nchw_kernel("max_pool2d_index_grad")
def max_pool2d_index_grad(gy, indices, input_shape, kernel, stride, padding=(0, 0), channels_last=False):
    """ATen's backward (the ``grad_input=`` form) into a result buffer that is also the input it is
    given: the index-based backward reads only the input's shape and memory format, so no input-sized
    stand-in is allocated beside the result (the kernel's workspace is the int64 copy of the indices)."""
    gx = _like(input_shape, gy, channels_last)  # ATen reads the input's shape and memory format only
    return _act(torch.ops.aten.max_pool2d_with_indices_backward.grad_input(
        gy, gx, list(kernel), list(stride), list(padding), [1, 1], False, indices.long(), grad_input=gx), channels_last)


@k("avg_pool2d_grad")
@_nchw_kernel("avg_pool2d_grad")
def avg_pool2d_grad(gy, input_shape, kernel, stride, padding=(0, 0), channels_last=False):
    gx = _like(input_shape, gy, channels_last)  # the input's stand-in and the result (see max_pool2d_index_grad)
    return _act(torch.ops.aten.avg_pool2d_backward.grad_input(gy, gx, list(kernel), list(stride), list(padding),
                                                              False, True, None, grad_input=gx), channels_last)


# ---------------------------------------------------------------- bilinear resize (remat.ir.ops.resize)
@k("upsample_bilinear2d")
@_nchw_kernel("upsample_bilinear2d")
def upsample_bilinear2d(x, size, align_corners=False, scale_h=0.0, scale_w=0.0, channels_last=False):
    y = torch.ops.aten.upsample_bilinear2d(x, list(size), align_corners, scale_h or None, scale_w or None)
    return _act(y, channels_last)


@k("upsample_bilinear2d_grad")
@_nchw_kernel("upsample_bilinear2d_grad")
def upsample_bilinear2d_grad(gy, input_shape, align_corners=False, scale_h=0.0, scale_w=0.0, channels_last=False):
    gx = torch.ops.aten.upsample_bilinear2d_backward(gy, list(gy.shape[2:]), list(input_shape), align_corners,
                                                     scale_h or None, scale_w or None)
    return _act(gx, channels_last)


# ---------------------------------------------------------------- random: the numpy samplers, converted
def _from_np(a: np.ndarray) -> torch.Tensor:
    return to_torch(a)


@k("uniform")
def uniform(seed, shape, dtype=DType.f32, low=0.0, high=1.0):
    return _from_np(npk.sample_uniform(int(seed.item()), shape, dtype, low, high))


@k("normal")
def normal(seed, shape, dtype=DType.f32, mean=0.0, std=1.0):
    return _from_np(npk.sample_normal(int(seed.item()), shape, dtype, mean, std))


@k("bernoulli")
def bernoulli(seed, shape, p):
    return _from_np(npk.sample_bernoulli(int(seed.item()), shape, p))


@k("fold_seed")
def fold_seed(seed, salt):
    return torch.tensor(npk.fold_seed_int(int(seed.item()), salt), dtype=torch.int64, device=seed.device)


# ---------------------------------------------------------------- data movement
@k("transpose")
def transpose(x, perm):
    return x.permute(perm).clone(memory_format=torch.contiguous_format)


@k("reshape")
def reshape(x, shape):
    """A view of the operand (operands are contiguous)."""
    return x.view(tuple(shape))


@k("broadcast")
def broadcast(x, shape):
    return x.expand(tuple(shape)).clone(memory_format=torch.contiguous_format)


@k("slice")
def slice_(x, start, stop, step=()):
    step = step or (1,) * x.dim()
    return x[tuple(slice(a, b, s) for a, b, s in zip(start, stop, step))].clone(memory_format=torch.contiguous_format)


@k("pad")
def pad(x, low, high, interior=(), value=0.0):
    interior = interior or (0,) * x.dim()
    shape = tuple(lo + hi + d + max(d - 1, 0) * it for lo, hi, it, d in zip(low, high, interior, x.shape))
    out = torch.full(shape, value, dtype=x.dtype, device=x.device)
    if x.numel():
        idx = tuple(slice(lo, lo + (d - 1) * (it + 1) + 1, it + 1) for lo, it, d in zip(low, interior, x.shape))
        out[idx] = x
    return out


@k("concat")
def concat(*xs, axis):
    return torch.cat(xs, dim=axis)


@k("gather")
def gather(table, idx, axis=0, padding_idx=-1):  # padding_idx only shapes the gradient
    npk.check_indices("gather", idx, table.shape[axis], f"index (axis {axis})")
    out_shape = tuple(table.shape[:axis]) + tuple(idx.shape) + tuple(table.shape[axis + 1:])
    return _fresh(torch.index_select(table, axis, idx.reshape(-1).to(torch.int64)).reshape(out_shape))


@k("scatter_add")
def scatter_add(idx, upd, shape, axis=0):
    npk.check_indices("scatter_add", idx, shape[axis], f"index (axis {axis})")
    out = torch.zeros(tuple(shape), dtype=upd.dtype, device=upd.device)
    src = upd.reshape(tuple(shape[:axis]) + (-1,) + tuple(shape[axis + 1:]))
    return out.index_add_(axis, idx.reshape(-1).to(torch.int64), src)


@k("constant")
def constant(value, shape=(), dtype=DType.f32):
    return torch.full(tuple(shape), value, dtype=TORCH_DTYPE[dtype], device=DEVICE)


@k("iota")
def iota(shape, axis=0, dtype=DType.i64):
    shape = tuple(shape)
    r = torch.arange(shape[axis], dtype=torch.int64, device=DEVICE)
    r = r.reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return r.expand(shape).to(TORCH_DTYPE[dtype]).clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- normalisation (composite ops of remat.ir.ops.norm)
# ATen's native kernels, as eager PyTorch runs them. Their results are fresh contiguous tensors.
@k("layer_norm")
def layer_norm(x, *affine, axis, eps=1e-5):
    w = affine[0] if affine else None
    b = affine[1] if len(affine) > 1 else None
    y, mean, rstd = torch.ops.aten.native_layer_norm(x, list(x.shape[axis:]), w, b, eps)
    return _fresh(y), _fresh(mean), _fresh(rstd)


@k("layer_norm_grad")
def layer_norm_grad(gy, x, mean, rstd, *w, axis):
    weight = w[0] if w else None
    # The bias is only read for grad_bias's shape and dtype, which are the weight's.
    gx, gw, gb = torch.ops.aten.native_layer_norm_backward(gy, x, list(x.shape[axis:]), mean, rstd, weight, weight,
                                                            [True, bool(w), bool(w)])
    return (_fresh(gx), _fresh(gw), _fresh(gb)) if w else _fresh(gx)


@k("batch_norm")
@_channels_at_1(1)
def batch_norm(x, *rest, training=True, momentum=0.1, eps=1e-5, affine=True, channels_last=False):
    na = 2 if affine else 0
    w, b = (rest[0], rest[1]) if affine else (None, None)
    running = [t.clone() for t in rest[na:]]  # fresh results: the kernel updates the running statistics in place
    rm, rv = running if running else (None, None)
    y, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, rm, rv, training, momentum, eps)
    if not training:
        return _act(y, channels_last)
    return (_act(y, channels_last), _fresh(mean), _fresh(invstd), *running)


@k("batch_norm_stats")
@_channels_at_1(1)
def batch_norm_stats(x, *running, momentum=0.1, eps=1e-5, channels_last=False):
    # ATen's statistics pass alone (the one native_batch_norm runs before normalising): mean and
    # biased variance accumulated in double, the running statistics updated in place (on copies).
    running = [t.clone() for t in running]
    rm, rv = running if running else (None, None)
    mean, var = torch.ops.aten.batch_norm_update_stats(x, rm, rv, momentum)
    return (_fresh(mean), torch.rsqrt(var.add_(eps)), *running)


@k("batch_norm_grad")
@_channels_at_1(2)
def batch_norm_grad(gy, x, s1, s2, *w, training=True, eps=1e-5, channels_last=False):
    weight = w[0] if w else None
    stats = (None, None, s1, s2) if training else (s1, s2, None, None)
    gx, gw, gb = torch.ops.aten.native_batch_norm_backward(gy, x, weight, *stats, training, eps,
                                                            [True, bool(w), bool(w)])
    return (_act(gx, channels_last), _fresh(gw), _fresh(gb)) if w else _act(gx, channels_last)


@k("batch_norm_grad_sums")
@_channels_at_1(2)
def batch_norm_grad_sums(gy, x, mean, invstd, channels_last=False):
    # ATen's backward without grad_input: its reduction pass alone, whose grad_weight (Σ gy·(x − mean)
    # times invstd) and grad_bias (Σ gy) need no weight. With grad_input, ATen allocates the
    # input-sized result twice (the first one unused), a workspace this avoids.
    _, gw, gb = torch.ops.aten.native_batch_norm_backward(gy, x, None, None, None, mean, invstd, True, 0.0,
                                                          [False, True, True])
    return _fresh(gw), _fresh(gb)


# ---------------------------------------------------------------- optimizer updates (in place)
# In f32/f64 ATen's fused optimizer kernels (``torch.optim.SGD/Adam/AdamW(fused=True)``, one tensor per
# call): one pass over the parameter and its state, no temporaries. Measured on the zoo's parameters
# (``bench/optimizer_kernels.py``) against the single-tensor updates below, which stay for the other
# dtypes. Values agree within a few ulps (weight decay, dampening and Adam's bias corrections round
# differently); every budget runs the same kernel, so gradients and updates stay bit-identical across them.
_FUSED_OPTIM_DTYPES = (torch.float32, torch.float64)


def _fusable(*ts: torch.Tensor) -> bool:
    return ts[0].dtype in _FUSED_OPTIM_DTYPES and all(t.dtype == ts[0].dtype for t in ts)


def sgd_single(param, grad, buf, step, *, lr, momentum, dampening, weight_decay, nesterov, maximize):
    """torch.optim.SGD's single-tensor update (``foreach=False``), in place on param and buf."""
    d = -grad if maximize else grad
    if weight_decay != 0:
        d = d.add(param, alpha=weight_decay)
    if momentum != 0:
        if int(step.item()) <= 1:
            buf.copy_(d)
        else:
            buf.mul_(momentum).add_(d, alpha=1 - dampening)
        d = d.add(buf, alpha=momentum) if nesterov else buf
    param.add_(d, alpha=-lr)
    return param, buf


def _skip(skip: torch.Tensor, like: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """The ``skip`` operand for an update of ``like``: (skip it now, the fused kernels' ``found_inf``).
    On the CPU the flag is read here (no synchronisation to avoid) and the kernel gets no
    ``found_inf``; on an accelerator the kernel reads it itself (1.0: change nothing), so the host
    never waits for it."""
    if skip.device.type == "cpu" and like.device.type == "cpu":
        return bool(skip), None
    return False, skip.to(device=like.device, dtype=torch.float32)


@k("sgd_step")
def sgd_step(param, grad, buf, step, hyper, skip, *, nesterov, maximize):
    """torch.optim.SGD's update, in place on param and buf (step is 1-based; ``hyper`` = [lr,
    momentum, dampening, weight_decay]; ``skip`` true: nothing changes): with momentum ATen's fused
    kernel, else (or in another dtype) :func:`sgd_single`."""
    lr, momentum, dampening, weight_decay = hyper.tolist()
    skip_now, found_inf = _skip(skip, param)
    if skip_now:
        return param, buf
    if momentum != 0 and _fusable(param, grad, buf):
        torch._fused_sgd_([param], [grad], [buf], weight_decay=weight_decay, momentum=momentum, lr=lr,
                          dampening=dampening, nesterov=nesterov, maximize=maximize,
                          is_first_step=int(step.item()) <= 1, found_inf=found_inf)
        return param, buf
    if found_inf is not None and bool(skip):  # the single-tensor update: the flag read on the host
        return param, buf
    return sgd_single(param, grad, buf, step, lr=lr, momentum=momentum, dampening=dampening,
                      weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)


def adam_single(param, grad, m, v, step, *, lr, beta1, beta2, eps, weight_decay, decoupled, maximize):
    """torch.optim.Adam / AdamW's single-tensor update, in place on param, m, v."""
    g = -grad if maximize else grad
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    t = int(step.item())
    step_size = lr / (1 - beta1 ** t)
    # In place after the sqrt: one parameter-sized temporary, not torch's two (same values).
    denom = v.sqrt().div_((1 - beta2 ** t) ** 0.5).add_(eps)
    param.addcdiv_(m, denom, value=-step_size)
    return param, m, v


@k("adam_step")
def adam_step(param, grad, m, v, step, hyper, skip, *, decoupled, maximize):
    """torch.optim.Adam / AdamW's update, in place on param, m, v (step is 1-based, an integer tensor
    the fused kernel reads as it is; ``hyper`` = [lr, beta1, beta2, eps, weight_decay]; ``skip`` true:
    nothing changes): ATen's fused kernel, else :func:`adam_single`."""
    lr, beta1, beta2, eps, weight_decay = hyper.tolist()
    skip_now, found_inf = _skip(skip, param)
    if skip_now:
        return param, m, v
    if _fusable(param, grad, m, v):
        if not step.is_cpu:  # the device kernels read their step count as a float on the device
            step = step.to(torch.float32)
        (torch._fused_adamw_ if decoupled else torch._fused_adam_)(
            [param], [grad], [m], [v], [], [step], lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
            eps=eps, amsgrad=False, maximize=maximize, found_inf=found_inf)
        return param, m, v
    if found_inf is not None and bool(skip):  # the single-tensor update: the flag read on the host
        return param, m, v
    return adam_single(param, grad, m, v, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=weight_decay, decoupled=decoupled, maximize=maximize)


@k("nonfinite")
def nonfinite(*xs):
    """True when an element of an operand is NaN or infinite: each operand's minimum and maximum
    (one pass, no temporary; NaN propagates through both), then one check of those few scalars.
    Operands of one element on the host (the loss, the usual only operand) are read directly: the
    five tiny kernels cost more than the check."""
    if all(x.numel() == 1 and x.device.type == "cpu" for x in xs):
        return torch.tensor(not all(math.isfinite(x.item()) for x in xs))
    ends = [e for x in xs if x.numel() for e in torch.aminmax(x.reshape(-1))]
    if not ends:
        return torch.zeros((), dtype=torch.bool)
    return torch.logical_not(torch.isfinite(torch.stack(ends)).all())


# ---------------------------------------------------------------- collectives (torch.distributed)
def _group_size(world: int) -> int:
    """The default process group's size, checked against the ``world`` the program was compiled for.

    A program for one rank runs without a process group (every collective is then a copy)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if world == 1:
            return 1
        raise RuntimeError(f"this program was compiled for {world} ranks but no torch.distributed process group is "
                           "initialised; call torch.distributed.init_process_group first")
    n = dist.get_world_size()
    if n != world:
        raise RuntimeError(f"this program was compiled for {world} ranks but the process group has {n}")
    return n


def _results(outs: tuple):
    """A variadic collective's results: the value itself for one operand (the kernel contract)."""
    return outs[0] if len(outs) == 1 else outs


def _wait(works) -> None:
    for w in works:
        w.wait()


# Collectives cannot be measured alone (a collective waits for ranks that do not take part), so their
# workspaces are declared, and on the CPU the kernels make them exact. gloo runs each collective on
# threads of its own, which drop their references to its tensors (and free its internal buffers) a
# moment after the collective completes: its ``reduce_scatter_tensor`` copies its whole input, its
# ``all_gather_into_tensor`` gathers into a buffer of its whole output, and either could still be
# alive at the next instruction (measured: a 2 KB excess over the allocator bound, now and then, on
# ZeRO-1 with 1.5 KB buckets). So on the CPU every collective is an in-place ``all_reduce`` on tensors
# the kernel owns (gloo makes no copy of a contiguous dense tensor), and the kernel returns once gloo
# has let go of them (:func:`_settle`): ``reduce_scatter`` sums a copy of its input (its workspace,
# the whole bucket at once) and keeps its slice; ``all_gather`` sums zeros holding this rank's shard
# (no workspace; twice the traffic of a gather, and a -0.0 element arrives as +0.0). The mean's
# division by the world size wraps it as an int64 scalar cast to the operands' dtype (8 + itemsize
# bytes, one operand at a time). On an accelerator (NCCL) the collectives are PyTorch's own and
# their workspaces are not measured (0).
SETTLE_SECONDS = 5.0
"""How long a collective waits for gloo's threads to drop their references to its tensors."""


def _settle(works: list, tensors) -> None:
    """Wait for ``works``, then until gloo's threads hold no reference to ``tensors`` (each held by
    this kernel alone), so that whatever the kernel frees is freed before it returns."""
    import time

    while works:  # no reference kept to a work object: it holds the tensors too
        works.pop().wait()
    deadline = time.monotonic() + SETTLE_SECONDS
    for t in tensors:
        while t._use_count() > 1 and time.monotonic() < deadline:
            time.sleep(0)


def _mean_scalar(ins) -> int:
    return 8 + max(v.type.dtype.itemsize for v in ins.operands) if ins.attrs.get("op", "mean") == "mean" else 0


def _all_reduce_workspace(ins, device) -> int:
    return 0 if device is not None or ins.attrs["world"] == 1 else _mean_scalar(ins)


def _reduce_scatter_workspace(ins, device) -> int:
    if device is not None or ins.attrs["world"] == 1:
        return 0
    return max(sum(v.type.nbytes for v in ins.operands), _mean_scalar(ins))


def _summed(ts: tuple) -> None:
    """Each of ``ts`` summed over the ranks, in place: one async ``all_reduce`` per tensor, then one
    wait (a bucket is one collective)."""
    import torch.distributed as dist

    works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True) for t in ts]
    if ts and ts[0].device.type == "cpu":
        _settle(works, ts)
    else:
        _wait(works)


@kernel("all_reduce", "torch", workspace=_all_reduce_workspace)
def all_reduce(*xs, world, op="mean"):
    outs = tuple(x.clone(memory_format=torch.contiguous_format) for x in xs)
    if _group_size(world) > 1:
        _summed(outs)
        if op == "mean":
            for o in outs:
                o.div_(world)
    return _results(outs)


@kernel("reduce_scatter", "torch", workspace=_reduce_scatter_workspace)
def reduce_scatter(*xs, world, op="mean"):
    import torch.distributed as dist

    if _group_size(world) == 1:
        return _results(tuple(x.clone(memory_format=torch.contiguous_format) for x in xs))
    if xs[0].device.type == "cpu":
        whole = tuple(x.clone(memory_format=torch.contiguous_format) for x in xs)
        _summed(whole)
        rank = dist.get_rank()
        outs = tuple(w[rank * (w.shape[0] // world):(rank + 1) * (w.shape[0] // world)].clone() for w in whole)
        del whole
    else:
        outs = tuple(torch.empty(x.shape[0] // world, dtype=x.dtype, device=x.device) for x in xs)
        _wait([dist.reduce_scatter_tensor(o, x.contiguous(), op=dist.ReduceOp.SUM, async_op=True)
               for o, x in zip(outs, xs)])
    if op == "mean":
        for o in outs:
            o.div_(world)
    return _results(outs)


@k("all_gather")
def all_gather(*xs, world):
    import torch.distributed as dist

    if _group_size(world) == 1:
        return _results(tuple(x.clone(memory_format=torch.contiguous_format) for x in xs))
    if xs[0].device.type == "cpu":
        rank = dist.get_rank()
        outs = tuple(torch.zeros(x.shape[0] * world, dtype=x.dtype, device=x.device) for x in xs)
        for o, x in zip(outs, xs):
            o[rank * x.shape[0]:(rank + 1) * x.shape[0]].copy_(x)
        _summed(outs)
        return _results(outs)
    outs = tuple(torch.empty(x.shape[0] * world, dtype=x.dtype, device=x.device) for x in xs)
    _wait([dist.all_gather_into_tensor(o, x.contiguous(), async_op=True) for o, x in zip(outs, xs)])
    return _results(outs)


@k("assign")
def assign(dst, src):
    dst.view(-1).copy_(src[:dst.numel()])
    return dst


# ---------------------------------------------------------------- fused element-wise bodies
@k("fused")
def fused(*args, body):
    """The body's nodes one by one with the kernels the VM would pick for each (torch, else numpy):
    always available, and bit-identical to the unfused program by construction."""
    from ..ir.types import TensorType
    from ._fused import interpret

    types = tuple(TensorType(FROM_TORCH[a.dtype], tuple(a.shape)) for a in args)
    return interpret(body, args, types, ("torch", "numpy"), {"torch": to_torch, "numpy": to_numpy},
                     lambda x, shape: to_torch(x).expand(shape).clone(memory_format=torch.contiguous_format))


# ---------------------------------------------------------------- attention
# The fused CPU flash kernels take [B, H, T, D] operands with D == Dv and an additive mask of q's
# dtype (2-d or 4-d, broadcasting); other ranks are viewed as 4-d and bool masks become additive
# (as F.scaled_dot_product_attention does). Anything else runs the explicit math version.
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


FLASH_MIN_LOWP_QUERIES = 128
"""Below this many queries per head, f16/bf16 attention runs :func:`attention_lowp` instead of the CPU
flash kernels, whose blocked loops are slow on short sequences in low precision (forward and
backward, 8192 query rows of width 32-64, two threads, AVX-512 BF16: flash 1.5-7x the explicit
kernels' time at 16-64 queries, 1.3-2.1x at 128, even at 160, 0.6x at 256). Swin's 4x4 windows (16
queries) are where it shows. The explicit kernels hold [T, S] f32 scores as their workspace, so
the limit stays where the flash kernels' smaller workspace costs little time."""


def _qkv(ins):
    """The types of q, k and v of an ``attention`` (operands 0-2) or ``attention_grad`` (1-3)."""
    first = 0 if ins.op.name == "attention" else 1
    return tuple(o.type for o in ins.operands[first:first + 3])


def _short_lowp(ins) -> bool:
    """f16/bf16 attention with fewer than :data:`FLASH_MIN_LOWP_QUERIES` queries per head."""
    q = _qkv(ins)[0]
    queries = q.shape[-3] if ins.attrs.get("seq_first", False) and q.rank >= 3 else q.shape[-2] if q.rank >= 2 else 0
    return q.dtype.value in ("bf16", "f16") and queries < FLASH_MIN_LOWP_QUERIES


def _flash_ok(ins) -> bool:
    """The flash kernels accept rank 2-4 operands with equal q/k and v head sizes, on CPU; grouped-query
    (fewer key/value heads) at rank 4, where they read the shared heads themselves; in f16/bf16, at
    least :data:`FLASH_MIN_LOWP_QUERIES` queries per head."""
    q, k, v = _qkv(ins)
    grouped = q.shape[-2] != k.shape[-2] if ins.attrs.get("seq_first", False) else q.shape[:-2] != k.shape[:-2]
    return (DEVICE.type == "cpu" and 2 <= q.rank <= 4 and q.shape[-1] == v.shape[-1] and (not grouped or q.rank == 4)
            and not _short_lowp(ins))


def _as4(x: torch.Tensor) -> torch.Tensor:
    """A rank 2-4 tensor viewed as [B, H, T, D] (rank 2: [1, 1, T, D]; rank 3: [B, 1, T, D])."""
    if x.dim() == 3:
        return x.unsqueeze(1)
    return x if x.dim() == 4 else x.reshape((1, 1) + tuple(x.shape))


def _all_true(b: torch.Tensor) -> bool:
    """Whether a bool tensor is true everywhere: its bytes' minimum (``Tensor.all`` on bool is ~20x slower
    on CPU, 130 µs on an [8, 1, 256, 256] mask)."""
    return b.numel() == 0 or bool(b.view(torch.uint8).min())


def _flash_args(mask, q: torch.Tensor, k: torch.Tensor, is_causal: bool):
    """``(additive 4-d mask or None, is_causal)`` for the flash kernels, as eager's SDPA path gets them.

    A mask that hides nothing (all true, or an additive mask of zeros: a Hugging Face encoder's
    all-ones ``attention_mask``) is dropped, and one that is exactly the causal pattern (top-left
    aligned, as ``is_causal`` means it: a causal model's mask built from positions, without padding)
    becomes ``is_causal``, as eager PyTorch runs these models. The results are the same bits (the
    flash kernels give an explicit mask's and ``is_causal``'s alike); what goes is the additive
    float copy of a bool mask made per call (an [8, 1, 256, 256] one: ~0.2 ms, 2 MiB) and 1-10% of
    the kernels' own time (measured on [8, 4, 256, 64] operands). The check costs ~6 µs for an
    all-true mask, ~45 µs for the causal comparison; forward and backward decide alike, since they
    see the same mask, so a recomputed attention gives the same bits."""
    if mask is None:
        return None, is_causal
    if mask.dtype == torch.bool:
        if _all_true(mask):
            return None, is_causal
        t, s = q.shape[-2], k.shape[-2]
        if not is_causal and mask.shape[-2:] == (t, s):
            # A temporary, not a template cached across calls: the kernel's workspace (measured once
            # on zeros, remat.runtime.allocator) must not depend on what earlier calls left behind.
            tril = torch.ones(t, s, dtype=torch.bool, device=mask.device).tril_()
            if _all_true(mask == tril):
                return None, True
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    elif _all_true(mask == 0):
        return None, is_causal
    mask = mask.reshape((1,) * (q.dim() - mask.dim()) + tuple(mask.shape))
    return _as4(mask), is_causal


def _heads_first(x: torch.Tensor, seq_first: bool) -> torch.Tensor:
    """A [..., T, H, D] operand of a ``seq_first`` attention as the [..., H, T, D] view it computes on."""
    return x.transpose(-3, -2) if seq_first else x


def _over_chunks(kernel: Callable, chunks: int, batched: tuple, mask, **attrs) -> tuple:
    """``kernel(*batched, mask, **attrs)`` computed over ``chunks`` slices of the leading axis, one
    after the other, its results concatenated along it: the same values as one call (each leading
    index is computed alone either way), a workspace a chunk's size. ``batched``: the operands with
    that leading axis (q and what shares its batch); a mask is sliced where it has it too (the
    scores' rank and that length), else read whole by every chunk."""
    n = batched[0].shape[0]
    if chunks <= 1 or batched[0].dim() < (4 if attrs.get("seq_first") else 3) or n < 2:
        return kernel(*batched, mask, **attrs)  # no batch axis before [T, D] ([T, H, D])
    split = mask is not None and mask.dim() == batched[0].dim() and mask.shape[0] == n
    parts = [t.tensor_split(chunks) for t in batched]
    masks = mask.tensor_split(chunks) if split else (mask,) * chunks
    outs = [kernel(*args, m, **attrs) for *args, m in zip(*parts, masks)]
    return tuple(torch.cat(rs) for rs in zip(*outs))


@k("attention", checker=_flash_ok)
def attention_flash(q, k, v, mask=None, *, scale, is_causal=False, seq_first=False, chunks=1):
    """With ``seq_first`` the kernel reads the [B, T, H, D] operands through transposed views and
    writes its output [B, T, H, D]-contiguous (ATen's CPU flash kernels allocate it so): no copy.
    ``chunks`` is not needed: the flash kernels hold one block of scores at a time."""
    q, k, v = (_heads_first(x, seq_first) for x in (q, k, v))
    mask, is_causal = _flash_args(mask, q, k, is_causal)
    out, lse = _FLASH(_as4(q), _as4(k), _as4(v), 0.0, is_causal, attn_mask=mask, scale=scale)
    out = out.reshape(q.shape[:-1] + v.shape[-1:])
    return _fresh(_heads_first(out, seq_first)), _fresh(lse.reshape(q.shape[:-1]))


def _lse_for(lse, q):
    """The logsumexp in the dtype the kernels compute in (f32 for f16/bf16 queries)."""
    return lse.to(torch.float32 if q.dtype in _LOWP else q.dtype)


@k("attention_grad", checker=_flash_ok)
def attention_grad_flash(g, q, k, v, out, lse, mask=None, *, scale, is_causal=False, seq_first=False, chunks=1):
    g, q, k, v, out = (_heads_first(x, seq_first) for x in (g, q, k, v, out))
    q4 = _as4(q)
    mask, is_causal = _flash_args(mask, q, k, is_causal)
    gq, gk, gv = _FLASH_BWD(_as4(g), q4, _as4(k), _as4(v), _as4(out), _lse_for(lse, q).reshape(q4.shape[:-1]), 0.0, is_causal,
                            attn_mask=mask, scale=scale)
    return tuple(_fresh(_heads_first(x.reshape(t.shape), seq_first)) for x, t in ((gq, q), (gk, k), (gv, v)))


def _math_scores(q, k, mask, scale, is_causal):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if is_causal:
        t, n = s.shape[-2:]
        s = s.masked_fill(~torch.ones(t, n, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    return s


def _up(x):
    return x.float() if x.dtype in _LOWP else x


def _repeat_kv(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Grouped-query key/value heads repeated to the query's (head h reads head h // groups)."""
    return x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3) if x.dim() >= 3 and x.shape[-3] != q.shape[-3] else x


def _sum_groups(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if g.shape == like.shape:
        return g
    return g.unflatten(-3, (like.shape[-3], g.shape[-3] // like.shape[-3])).sum(-3)


EXP_NORMAL_MIN = -87.0
"""At or below this, :func:`_exp_normal` gives 0: exp would give (nearly) a subnormal f32 (under 1.2e-38)."""


def _exp_normal(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` in place, with 0 where it would be subnormal (x <= :data:`EXP_NORMAL_MIN`). ATen's CPU
    exp takes ~35x longer on arguments whose result is subnormal (131k f32 scores near -100: 2.0 ms
    against 60 us), which an additive mask of -100 (Swin's shifted windows) gives every softmax;
    a probability under 1.2e-38 is zero in bf16 products and sums anyway. One pass before the exp
    (``threshold_``: those arguments become -inf); NaN stays NaN and -inf gives 0, as exp does."""
    return F.threshold_(x, EXP_NORMAL_MIN, float("-inf")).exp_()


@kernel("attention", "torch", checker=_short_lowp, priority=7)
def attention_lowp(q, k, v, mask=None, *, scale, is_causal=False, seq_first=False, chunks=1):
    """f16/bf16 attention over short sequences, as eager's math path computes it: products in the
    low precision (scores rounded to it, as eager's), the softmax in f32 (exponentials of the
    scores less their row maximum, over their row sum: :func:`_exp_normal`), probabilities rounded
    to the low precision for the product with v; no f32 copy of q, k or v. The logsumexp the
    backward reads is the row maximum plus the log of that sum. Over ``chunks`` slices of the
    batch (:func:`_over_chunks`) when asked."""
    return _over_chunks(_attention_lowp, chunks, (q, k, v), mask, scale=scale, is_causal=is_causal,
                        seq_first=seq_first)


def _attention_lowp(q, k, v, mask, *, scale, is_causal, seq_first):
    q, k, v = (_heads_first(x, seq_first) for x in (q, k, v))
    k, v = _repeat_kv(k, q), _repeat_kv(v, q)
    s = _math_scores(q, k, mask, scale, is_causal).float()
    m = s.amax(-1, keepdim=True)
    m.masked_fill_(m == float("-inf"), 0.0)  # a row masked everywhere: 0 / 0 probabilities, logsumexp -inf
    e = _exp_normal(s.sub_(m))
    total = e.sum(-1, keepdim=True)
    out = torch.matmul(e.div_(total).to(q.dtype), v)
    return _fresh(_heads_first(out, seq_first)), _fresh(total.log_().add_(m).squeeze(-1))


@kernel("attention_grad", "torch", checker=_short_lowp, priority=7)
def attention_grad_lowp(g, q, k, v, out, lse, mask=None, *, scale, is_causal=False, seq_first=False, chunks=1):
    """The backward of :func:`attention_lowp`: its products in the low precision, the element-wise
    work on the scores in f32, the scores' gradient scaled in the low precision before the products
    (as eager's backward of ``(q @ k.mT) * scale`` does). Operands read through transposed views
    (``seq_first``) are made heads-first once each, not once per product. Over ``chunks`` slices of
    the batch when asked."""
    return _over_chunks(_attention_grad_lowp, chunks, (g, q, k, v, out, lse), mask, scale=scale,
                        is_causal=is_causal, seq_first=seq_first)


def _attention_grad_lowp(g, q, k, v, out, lse, mask, *, scale, is_causal, seq_first):
    rows = _heads_first((g.float() * out.float()).sum(-1, keepdim=True), seq_first)
    if seq_first:
        g, q, k0, v0 = (_heads_first(x, True).contiguous() for x in (g, q, k, v))
    else:
        k0, v0 = k, v
    k, v = _repeat_kv(k0, q), _repeat_kv(v0, q)
    p = _exp_normal(_math_scores(q, k, mask, scale, is_causal).float().sub_(_lse_for(lse, q).unsqueeze(-1)))
    dv = torch.matmul(p.to(q.dtype).transpose(-1, -2), g)
    ds = p.mul_(torch.matmul(g, v.transpose(-1, -2)).float().sub_(rows)).to(q.dtype).mul_(scale)
    dq = torch.matmul(ds, k)
    dk = _sum_groups(torch.matmul(ds.transpose(-1, -2), q), k0)
    return tuple(_fresh(_heads_first(x, seq_first)) for x in (dq, dk, _sum_groups(dv, v0)))


@kernel("attention", "torch", priority=5)
def attention_math(q, k, v, mask=None, *, scale, is_causal=False, seq_first=False, chunks=1):
    """Explicit softmax (any rank, any head sizes, grouped-query); f16/bf16 compute in f32. Over
    ``chunks`` slices of the batch when asked."""
    return _over_chunks(_attention_math, chunks, (q, k, v), mask, scale=scale, is_causal=is_causal,
                        seq_first=seq_first)


def _attention_math(q, k, v, mask, *, scale, is_causal, seq_first):
    q, k, v = (_heads_first(x, seq_first) for x in (q, k, v))
    k, v = _repeat_kv(k, q), _repeat_kv(v, q)
    s = _math_scores(_up(q), _up(k), mask, scale, is_causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _up(v))
    return _fresh(_heads_first(out.to(q.dtype), seq_first)), _fresh(lse)


@kernel("attention_grad", "torch", priority=5)
def attention_grad_math(g, q, k, v, out, lse, mask=None, *, scale, is_causal=False, seq_first=False, chunks=1):
    return _over_chunks(_attention_grad_math, chunks, (g, q, k, v, out, lse), mask, scale=scale,
                        is_causal=is_causal, seq_first=seq_first)


def _attention_grad_math(g, q, k, v, out, lse, mask, *, scale, is_causal, seq_first):
    g, q, k0, v0, out = (_heads_first(x, seq_first) for x in (g, q, k, v, out))
    g, q32, k32, v32, out = _up(g), _up(q), _up(_repeat_kv(k0, q)), _up(_repeat_kv(v0, q)), _up(out)
    p = torch.exp(_math_scores(q32, k32, mask, scale, is_causal) - _lse_for(lse, q).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), g)
    ds = p * (torch.matmul(g, v32.transpose(-1, -2)) - (g * out).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k32) * scale
    dk = _sum_groups(torch.matmul(ds.transpose(-1, -2), q32) * scale, k0)
    return tuple(_fresh(_heads_first(x.to(q.dtype), seq_first)) for x in (dq, dk, _sum_groups(dv, v0)))


# ---------------------------------------------------------------- convolution -> batch norm -> ReLU -> max pool (batch-tiled)
# ``remat.ir.ops.convblock``: two passes over tiles of the batch, in NCHW views of any layout; a
# tile's convolution output and its normalised, rectified and routed-back forms are the only
# full-resolution temporaries.
from ..ir.ops import convblock as _cb  # noqa: E402
from ..ir.ops.nn import conv_out_hw as _conv_out_hw  # noqa: E402


def _nchw_of(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout in ("", "NCHW") else t.permute(0, 3, 1, 2)


def _empty_nchw(shape, dtype, layout: str) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, memory_format=torch.channels_last if layout == "NHWC"
                       else torch.contiguous_format)


def _stored(t: torch.Tensor, layout: str, dtype) -> torch.Tensor:
    return _fresh((t if layout == "NCHW" else t.permute(0, 2, 3, 1)).to(dtype))


def _tile_conv(xn: torch.Tensor, wc: torch.Tensor, a: int, tile: int, dt, stride, padding, dilation) -> torch.Tensor:
    """One tile's convolution, in the weight's memory format (channels-last weight: channels-last
    output, whatever the input's layout, the form ATen's pooling and batch norm run fastest in)."""
    return F.conv2d(xn[a:a + tile].to(dt), wc, None, list(stride), list(padding), list(dilation))


@k("conv_bn_stats")
def conv_bn_stats(x, w, *running, stride=(1, 1), padding=(0, 0), dilation=(1, 1), layout="NCHW", input_layout="",
                  eps=1e-5, momentum=0.1, tile=1):
    dt = torch.float32 if x.dtype in _LOWP else x.dtype
    xn = _nchw_of(x, input_layout or layout)
    wc = _cl_weight(w.to(dt), layout == "NHWC")
    count, mean, m2 = 0, None, None
    for a in range(0, xn.shape[0], tile):  # per-channel moments, combined tile by tile (Chan et al.)
        c = _tile_conv(xn, wc, a, tile, dt, stride, padding, dilation)
        mean_b, var_b = torch.ops.aten.batch_norm_update_stats(c, None, None, 0.0)  # ATen's statistics pass
        nb = c.numel() // c.shape[1]
        del c
        mean_b, m2_b = mean_b.double(), var_b.double() * nb
        if mean is None:
            count, mean, m2 = nb, mean_b, m2_b
        else:
            total = count + nb
            delta = mean_b - mean
            mean = mean + delta * (nb / total)
            m2 = m2 + m2_b + delta * delta * (count * nb / total)
            count = total
    var = m2 / count
    out = (_fresh(mean.to(x.dtype)), _fresh(torch.rsqrt(var + eps).to(dt).to(x.dtype)))
    if running:
        rm, rv = running
        unbiased = var * (count / max(count - 1, 1))
        out += (_fresh(((1 - momentum) * rm.double() + momentum * mean).to(x.dtype)),
                _fresh(((1 - momentum) * rv.double() + momentum * unbiased).to(x.dtype)))
    return out


@k("conv_bn_relu_pool_apply")
def conv_bn_relu_pool_apply(x, w, gamma, beta, mean, invstd, *, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                            layout="NCHW", input_layout="", eps=1e-5, pool_kernel=(), pool_stride=(),
                            pool_padding=(0, 0), tile=1, input_grad=True):
    dt = torch.float32 if x.dtype in _LOWP else x.dtype
    xn = _nchw_of(x, input_layout or layout)
    wc = _cl_weight(w.to(dt), layout == "NHWC")
    n = xn.shape[0]
    scale = gamma.to(dt) * invstd.to(dt)
    scale_c, shift_c = scale[None, :, None, None], (beta.to(dt) - mean.to(dt) * scale)[None, :, None, None]
    y = None
    for a in range(0, n, tile):  # normalise, rectify and pool each tile into the result
        c = _tile_conv(xn, wc, a, tile, dt, stride, padding, dilation)
        c.mul_(scale_c).add_(shift_c).relu_()
        p = F.max_pool2d(c, list(pool_kernel), list(pool_stride), list(pool_padding))
        del c
        if y is None:
            y = _empty_nchw((n,) + tuple(p.shape[1:]), dt, layout)
        y[a:a + tile] = p
        del p
    return _stored(y, layout, x.dtype)


@k("conv_bn_relu_pool")
def conv_bn_relu_pool(x, w, gamma, beta, *running, **attrs):
    # Its two passes, as the split-conv-bn-relu-pool pass runs them (bit for bit the same).
    stats = conv_bn_stats(x, w, *running, **_cb.stats_attrs(attrs))
    return (conv_bn_relu_pool_apply(x, w, gamma, beta, stats[0], stats[1], **_cb.output_attrs(attrs)), *stats)


def _cb_tile_grads(x, gy, w, mean, invstd, gamma, beta, layout, input_layout, stride, padding, dilation,
                   pool_kernel, pool_stride, pool_padding, tile):
    """(compute dtype, x in NCHW view, the weight as the convolutions read it, ``tile_grads``):
    ``tile_grads(a)`` recomputes the forward of the tile starting at sample ``a`` and gives (dz, c),
    the gradient at batch norm's output and the convolution output."""
    dt = torch.float32 if x.dtype in _LOWP else x.dtype
    xn, gyn = _nchw_of(x, input_layout or layout), _nchw_of(gy, layout)
    wc = _cl_weight(w.to(dt), layout == "NHWC")
    ch = (None, slice(None), None, None)
    pk, ps, pp = list(pool_kernel), list(pool_stride), list(pool_padding)
    scale = gamma.to(dt) * invstd.to(dt)
    scale_c, shift_c = scale[ch], (beta.to(dt) - mean.to(dt) * scale)[ch]

    def tile_grads(a: int):
        c = _tile_conv(xn, wc, a, tile, dt, stride, padding, dilation)
        r = torch.addcmul(shift_c, c, scale_c).relu_()
        _, idx = torch.ops.aten.max_pool2d_with_indices(r, pk, ps, pp)
        g = gyn[a:a + tile].to(dt)
        dr = torch.ops.aten.max_pool2d_with_indices_backward(g, r, pk, ps, pp, [1, 1], False, idx)
        del idx, g
        dz = torch.ops.aten.threshold_backward(dr, r, 0)  # ReLU's backward: r > 0 where z > 0
        return dz, c

    return dt, xn, wc, tile_grads


@k("conv_bn_relu_pool_sums")
def conv_bn_relu_pool_sums(x, gy, w, gamma, beta, mean, invstd, y, *, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                           layout="NCHW", input_layout="", eps=1e-5, pool_kernel=(), pool_stride=(), pool_padding=(0, 0),
                           tile=1, input_grad=True):
    dt, n = (torch.float32 if x.dtype in _LOWP else x.dtype), x.shape[0]
    s_dz = torch.zeros(w.shape[0], dtype=torch.float64)
    if bool((gamma != 0).all()):
        # Each window's gradient reaches its maximum, which the ReLU passes where y > 0, and there batch
        # norm's output is y: x̂ = (y - beta) / gamma, Σ dz = Σ g and Σ dz·x̂ = (Σ g·y - beta Σ g) / gamma,
        # g the output gradient where y > 0.
        # In the stored layout (a channels-last sum over a permuted view is 4x slower); the
        # temporaries are pooled, not full-resolution: as many bytes as a tile's with more samples.
        dims = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)
        chunk = tile * max(1, pool_stride[0] * pool_stride[1])
        s_gy = torch.zeros(w.shape[0], dtype=torch.float64)
        for a in range(0, n, chunk):
            yt = y[a:a + chunk].to(dt)
            g = torch.gt(yt, 0, out=torch.empty_like(yt)).mul_(gy[a:a + chunk])  # one temporary, no mask
            s_dz += g.sum(dims).double()
            s_gy += g.mul_(yt).sum(dims).double()
            del yt, g
        s_dzx = (s_gy - beta.double() * s_dz) / gamma.double()
    else:  # a zero gamma leaves no x̂ in the output: each tile recomputed (ATen's reduction)
        s_dzx = torch.zeros(w.shape[0], dtype=torch.float64)
        _, _, _, tile_grads = _cb_tile_grads(x, gy, w, mean, invstd, gamma, beta, layout, input_layout, stride, padding,
                                             dilation, pool_kernel, pool_stride, pool_padding, tile)
        for a in range(0, n, tile):
            dz, c = tile_grads(a)
            _, gw_t, gb_t = torch.ops.aten.native_batch_norm_backward(dz, c, None, None, None, mean.to(dt),
                                                                      invstd.to(dt), True, eps, [False, True, True])
            s_dzx += gw_t.double()
            s_dz += gb_t.double()
            del dz, c
    return _fresh(s_dzx.to(x.dtype)), _fresh(s_dz.to(x.dtype))


@k("conv_bn_relu_pool_grad")
def conv_bn_relu_pool_grad(x, gy, w, gamma, beta, mean, invstd, ggamma, gbeta, *, stride=(1, 1), padding=(0, 0),
                           dilation=(1, 1), layout="NCHW", input_layout="", eps=1e-5, pool_kernel=(), pool_stride=(),
                           pool_padding=(0, 0), tile=1, input_grad=True):
    dt, xn, wc, tile_grads = _cb_tile_grads(x, gy, w, mean, invstd, gamma, beta, layout, input_layout, stride, padding,
                                            dilation, pool_kernel, pool_stride, pool_padding, tile)
    n = xn.shape[0]
    ch = (None, slice(None), None, None)
    hw = _conv_out_hw("conv_bn_relu_pool_grad", xn.shape[2:], w.shape[2:],
                      {"stride": stride, "padding": padding, "dilation": dilation})
    m = n * hw[0] * hw[1]  # the count batch norm's statistics average over
    mean_c, k_c = mean.to(dt)[ch], (gamma.to(dt) * invstd.to(dt))[ch]
    a_c, b_c = (gbeta.double() / m).to(dt)[ch], (ggamma.double() / m).to(dt)[ch] * invstd.to(dt)[ch]
    gw = torch.zeros(w.shape, dtype=dt)
    gx = _empty_nchw(xn.shape, dt, layout) if input_grad else None
    for a in range(0, n, tile):  # the convolution's output gradient, then its weight (and input) gradient
        dz, c = tile_grads(a)
        dc = dz.sub_(a_c).sub_(c.sub_(mean_c).mul_(b_c)).mul_(k_c)  # k (dz - Σdz/m - x̂ Σdz·x̂/m)
        del c
        gxt, gwt, _ = torch.ops.aten.convolution_backward(dc, xn[a:a + tile].to(dt), wc, None, list(stride),
                                                          list(padding), list(dilation), False, [0, 0], 1,
                                                          [bool(input_grad), True, False])
        del dc
        gw += gwt
        if input_grad:
            gx[a:a + tile] = gxt
        del gxt, gwt
    if not input_grad:
        return _fresh(gw.to(x.dtype))
    return _fresh(gw.to(x.dtype)), _stored(gx, layout, x.dtype)


# ---------------------------------------------------------------- cross-entropy fused with the head (chunked)
# One chunk's logits at a time (``remat.ir.ops.crossentropy``): the temporaries are a chunk's logits
# and their gradient, computed in place; dw accumulates chunk by chunk (addmm into the result).
def _ce_rows(target, ignore_index, all_kept=False):
    """(row mask, int64 targets with ignored rows at class 0); the mask is None when every row
    counts (``all_kept``, from :func:`~remat.backends.numpy_kernels.check_targets`): the small
    heads' common case, a few ATen calls fewer, the same values."""
    if all_kept:
        return None, target.to(torch.int64)
    keep = target != ignore_index
    return keep, torch.where(keep, target, torch.zeros((), dtype=target.dtype, device=target.device)).to(torch.int64)


def _ce_reduce(rows, keep, reduction):
    """The loss from its per-row terms: as they are ("none"), their sum, or their mean over kept rows."""
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction != "mean":
        return total
    return total / (rows.numel() if keep is None else keep.sum().to(rows.dtype))


def _ce_scale(g, keep, reduction, dt, n):
    """Each of the ``n`` rows' weight in the loss's gradient (``remat.ir.ops.crossentropy.row_scale``);
    with every row kept (``keep`` None) and a reduced loss, one 0-d weight for all."""
    g32 = g.to(dt)
    if keep is None:
        return g32 / n if reduction == "mean" else g32
    scale = g32 if reduction == "none" else g32.expand(keep.shape)
    if reduction == "mean":
        scale = scale / keep.sum().to(dt)
    return torch.where(keep, scale, torch.zeros((), dtype=dt, device=g.device))


def _softmax_grad_(p, idx, t, scale):
    """Rows ``p`` of logits less their logsumexp become the loss's gradient in place: softmax minus
    the one-hot targets ``t`` (``idx``: the row numbers), times each row's weight ``scale``."""
    p.exp_()
    p[idx, t] -= 1
    return p.mul_(scale)


def _rows(scale, a, m):
    """Rows a..a+m of a per-row weight as a column (a 0-d weight as it is)."""
    return scale if scale.dim() == 0 else scale[a:a + m, None]


@k("linear_cross_entropy", checker=lambda ins: ins.operands[0].type.dtype.is_float)
def linear_cross_entropy(x, w, target, *, reduction="mean", ignore_index=-100, chunk=1024, upcast=False):
    npk.check_targets("linear_cross_entropy", target, w.shape[0], ignore_index)
    lowp = x.dtype in _LOWP  # the head's product in x's dtype, the loss from it in f32
    dt = torch.float32 if lowp else x.dtype
    keep, t = _ce_rows(target, ignore_index)
    n = x.shape[0]
    lse = torch.empty(n, dtype=dt, device=x.device)
    rows = torch.empty(n, dtype=dt, device=x.device)
    buf = torch.empty((min(chunk, n), w.shape[0]), dtype=dt, device=x.device) if lowp else None
    for a in range(0, n, chunk):
        z = torch.mm(x[a:a + chunk], w.t())
        m = z.shape[0]
        if lowp:
            _lowp_logsumexp(z, buf[:m], lse[a:a + m])
        else:
            torch.logsumexp(z, dim=1, out=lse[a:a + m])
        picked = z.gather(1, t[a:a + m, None])[:, 0].to(dt)
        rows[a:a + m] = torch.where(keep[a:a + m], lse[a:a + m] - picked, torch.zeros((), dtype=dt, device=x.device))
        del z
    out = dt if upcast else x.dtype
    return _fresh(_ce_reduce(rows, keep, reduction).to(out).contiguous()), _fresh(lse.to(out).contiguous())


@k("linear_cross_entropy_grad", checker=lambda ins: ins.operands[0].type.dtype.is_float)
def linear_cross_entropy_grad(g, x, w, target, lse, *, reduction="mean", ignore_index=-100, chunk=1024,
                              upcast=False):
    npk.check_targets("linear_cross_entropy_grad", target, w.shape[0], ignore_index)
    lowp = x.dtype in _LOWP  # the logits' gradient rounded to x's dtype, as the reference's; dw summed in f32
    dt = torch.float32 if lowp else x.dtype
    lse32 = lse.to(dt)
    keep, t = _ce_rows(target, ignore_index)
    scale = _ce_scale(g, keep, reduction, dt, x.shape[0])
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dw = torch.zeros(w.shape, dtype=dt, device=x.device)
    buf = torch.empty((min(chunk, x.shape[0]), w.shape[0]), dtype=dt, device=x.device) if lowp else None
    idx = torch.arange(min(chunk, x.shape[0]), device=x.device)
    for a in range(0, x.shape[0], chunk):
        xc = x[a:a + chunk]
        z = torch.mm(xc, w.t())
        m = z.shape[0]
        p = buf[:m].copy_(z) if lowp else z
        del z
        _softmax_grad_(p.sub_(lse32[a:a + m, None]), idx[:m], t[a:a + m], scale[a:a + m, None])
        if lowp:
            pl = p.to(x.dtype)
            torch.mm(pl, w, out=dx[a:a + m])
            dw.add_(torch.mm(pl.t(), xc))
            del pl
        else:
            torch.mm(p, w, out=dx[a:a + m])
            dw.addmm_(p.t(), xc)
        del p
    return _fresh(dx), _fresh(dw.to(x.dtype).contiguous())


# ---------------------------------------------------------------- cross-entropy on logits
# ``remat.ir.ops.crossentropy``: rows in chunks of about CE_CHUNK_BYTES, so the logsumexp's temporaries
# stay a chunk and the gradient's passes (subtract, exp, pick, scale) run on cache-resident rows.
CE_CHUNK_BYTES = 2 * 2**20


def _ce_chunk(c: int) -> int:
    return max(1, CE_CHUNK_BYTES // (4 * max(c, 1)))


def _lowp_logsumexp(zc, buf, out):
    """``torch.logsumexp(zc.to(f32), 1)`` of a low-precision chunk ``zc`` [m, C] into ``out`` [m], with
    ATen's own steps (``logsumexp_out_impl``: the row maxima, an infinite one taken as 0, the sum of
    the exponentials of the differences, its log plus the maximum) and ``buf`` [m, C] f32 as their
    only temporary (a mixed-dtype ``sub`` would convert the chunk into another one first)."""
    maxes = torch.amax(zc, dim=1, keepdim=True).to(out.dtype)
    squeezed = maxes[:, 0]  # a view, as ATen's squeeze: the fill below sets maxes too
    squeezed.masked_fill_(squeezed.abs() == math.inf, 0)
    torch.sum(buf.copy_(zc).sub_(maxes).exp_(), dim=1, out=out)
    out.log_().add_(squeezed)


@k("cross_entropy", checker=lambda ins: ins.operands[0].type.dtype.is_float)
def cross_entropy(z, target, reduction="mean", ignore_index=-100, upcast=False):
    n, c = z.shape
    all_kept = npk.check_targets("cross_entropy", target, c, ignore_index)
    dt = torch.float32 if z.dtype in _LOWP else z.dtype
    keep, t = _ce_rows(target, ignore_index, all_kept)
    rows = _ce_chunk(c)
    if n <= rows and dt == z.dtype:  # one chunk, no conversion: no separate buffer to fill
        lse = torch.logsumexp(z, dim=1)
    elif dt == z.dtype:
        lse = torch.empty(n, dtype=dt, device=z.device)
        for a in range(0, n, rows):
            torch.logsumexp(z[a:a + rows], dim=1, out=lse[a:a + rows])
    else:  # low precision: one f32 chunk buffer for the whole loss
        lse = torch.empty(n, dtype=dt, device=z.device)
        buf = torch.empty((min(rows, n), c), dtype=dt, device=z.device)
        for a in range(0, n, rows):
            m = min(rows, n - a)
            _lowp_logsumexp(z[a:a + m], buf[:m], lse[a:a + m])
        del buf
    per = lse - z.gather(1, t[:, None])[:, 0].to(dt)
    if keep is not None:
        per = torch.where(keep, per, torch.zeros((), dtype=dt, device=z.device))
    out = dt if upcast else z.dtype  # upcast: the f32 loss of the logits converted to f32, never made whole
    return _fresh(_ce_reduce(per, keep, reduction).to(out)), _fresh(lse.to(out))


def _cross_entropy_grad_into(out, g, z, lse, target, reduction, ignore_index):
    """softmax(z) - onehot(target), times each row's weight, written into ``out`` (which may be ``z``:
    each chunk of z is read before that chunk of ``out`` is written). Low-precision logits are converted
    to f32 a chunk at a time into one buffer, computed there and rounded into ``out``: what the f32
    gradient of the logits converted to f32 rounds to, so ``upcast`` (an f32 ``g`` and ``lse``) needs
    nothing else."""
    n, c = z.shape
    all_kept = npk.check_targets("cross_entropy_grad", target, c, ignore_index)
    dt = torch.float32 if z.dtype in _LOWP else z.dtype
    keep, t = _ce_rows(target, ignore_index, all_kept)
    scale = _ce_scale(g, keep, reduction, dt, n)
    lse = lse.to(dt)
    lowp = dt != z.dtype  # computed in f32 a chunk at a time, then rounded into ``out``
    rows = _ce_chunk(c)
    idx = torch.arange(min(rows, n), device=z.device)
    buf = torch.empty((min(rows, n), c), dtype=dt, device=z.device) if lowp else None
    for a in range(0, n, rows):
        m = min(rows, n - a)
        if lowp:
            p = buf[:m].copy_(z[a:a + m]).sub_(lse[a:a + m, None])
        else:
            p = torch.sub(z[a:a + m], lse[a:a + m, None], out=out[a:a + m])
        _softmax_grad_(p, idx[:m], t[a:a + m], _rows(scale, a, m))
        if lowp:
            out[a:a + m].copy_(p)
    return out


@k("cross_entropy_grad", checker=lambda ins: ins.operands[1].type.dtype.is_float)
def cross_entropy_grad(g, z, lse, target, reduction="mean", ignore_index=-100, upcast=False):
    return _cross_entropy_grad_into(torch.empty_like(z, memory_format=torch.contiguous_format), g, z, lse, target,
                                    reduction, ignore_index)


@_out("cross_entropy_grad")
def cross_entropy_grad_out(out, g, z, lse, target, reduction="mean", ignore_index=-100, upcast=False):
    return _cross_entropy_grad_into(out, g, z, lse, target, reduction, ignore_index)

# ---------------------------------------------------------------- attention with dropout (one score matrix at a time)
# ``remat.ir.ops.attention``: each batch element's [T, S] scores, probabilities and keep mask are made,
# used and dropped before the next one's (the temporaries ``workspace_bytes`` bounds); the keep mask of
# element b is words b·T·S .. of the seed's SplitMix64 stream, the bits the explicit form's
# ``bernoulli`` draws over the whole [..., T, S].
def _heads(q, k, v, mask):
    """(batch element count, [B, T, D] q, [B, S, D] k, [B, S, Dv] v, mask getter for element b or None)."""
    batch = tuple(q.shape[:-2])
    n = int(np.prod(batch, dtype=np.int64))
    t, s = q.shape[-2], k.shape[-2]
    q3, k3, v3 = (_up(x).reshape((n,) + tuple(x.shape[-2:])) for x in (q, k, v))
    if mask is None:
        return n, q3, k3, v3, None
    full = mask.reshape((1,) * (len(batch) + 2 - mask.dim()) + tuple(mask.shape)).expand(batch + (t, s))
    return n, q3, k3, v3, lambda b: full[tuple(int(i) for i in np.unravel_index(b, batch))] if batch else full


def _drop_scores(q3, k3, mask_of, b, scale, is_causal):
    """Batch element ``b``'s masked, scaled scores [T, S]."""
    m = None if mask_of is None else mask_of(b)
    return _math_scores(q3[b], k3[b], m, scale, is_causal)


def _keep_of(seed: int, b: int, t: int, s: int, p: float, device) -> torch.Tensor:
    return torch.from_numpy(npk.sample_bernoulli_range(seed, b * t * s, t * s, 1.0 - p).reshape(t, s)).to(device)


@k("dropout_attention")
def dropout_attention(q, k, v, seed, mask=None, *, scale, is_causal=False, p):
    n, q3, k3, v3, mask_of = _heads(q, k, v, mask)
    t, s = q.shape[-2], k.shape[-2]
    sd = int(seed.item())
    out = torch.empty((n, t, v.shape[-1]), dtype=q3.dtype, device=q.device)
    lse = torch.empty((n, t), dtype=q3.dtype, device=q.device)
    for b in range(n):
        sc = _drop_scores(q3, k3, mask_of, b, scale, is_causal)
        torch.logsumexp(sc, dim=-1, out=lse[b])
        sc.sub_(lse[b].unsqueeze(-1)).exp_().mul_(1.0 / (1.0 - p))
        sc.masked_fill_(~_keep_of(sd, b, t, s, p, q.device), 0.0)
        torch.mm(sc, v3[b], out=out[b])
        del sc
    return (_fresh(out.reshape(q.shape[:-1] + v.shape[-1:]).to(q.dtype)),
            _fresh(lse.reshape(q.shape[:-1])))  # in the compute dtype: f32 for f16/bf16, as lse_dtype


@k("dropout_attention_grad")
def dropout_attention_grad(g, q, k, v, out, lse, seed, mask=None, *, scale, is_causal=False, p):
    n, q3, k3, v3, mask_of = _heads(q, k, v, mask)
    t, s = q.shape[-2], k.shape[-2]
    sd = int(seed.item())
    g3, o3 = (_up(x).reshape((n, t, x.shape[-1])) for x in (g, out))
    lse2 = _lse_for(lse, q).reshape(n, t).to(q3.dtype)
    rows = (g3 * o3).sum(-1)  # [B, T]: rowsum(g ⊙ out), the softmax backward's correction
    dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
    c = 1.0 / (1.0 - p)
    for b in range(n):
        prob = _drop_scores(q3, k3, mask_of, b, scale, is_causal).sub_(lse2[b].unsqueeze(-1)).exp_()
        drop = ~_keep_of(sd, b, t, s, p, q.device)
        torch.mm((prob * c).masked_fill_(drop, 0.0).t(), g3[b], out=dv[b])
        ds = torch.mm(g3[b], v3[b].t()).mul_(c).masked_fill_(drop, 0.0).sub_(rows[b].unsqueeze(-1)).mul_(prob)
        del prob
        torch.mm(ds, k3[b], out=dq[b]).mul_(scale)
        torch.mm(ds.t(), q3[b], out=dk[b]).mul_(scale)
        del ds
    return tuple(_fresh(x.reshape(ref.shape).to(q.dtype).contiguous()) for x, ref in ((dq, q), (dk, k), (dv, v)))


# ---------------------------------------------------------------- routing (remat.ir.ops.routing)
# sort and topk sort stably (torch.topk's order among equal values is unspecified), so both dialects
# and a recomputation pick the same indices.
def _no_bool_or_half(instr) -> bool:
    return all(v.type.dtype not in (DType.bool, DType.f16, DType.bf16) for v in instr.operands)


@k("sort", checker=_no_bool_or_half)
def sort(x, axis=-1, descending=False):
    values, idx = torch.sort(x, dim=axis, descending=descending, stable=True)
    return _fresh(values), _fresh(idx)


@k("topk", checker=_no_bool_or_half)
def topk(x, k, axis=-1, largest=True):
    values, idx = torch.sort(x, dim=axis, descending=largest, stable=True)
    return _fresh(values.narrow(axis, 0, k)), _fresh(idx.narrow(axis, 0, k))


@k("histc", checker=_no_bool_or_half)
def histc(x, bins, min, max):
    return _fresh(torch.histc(x, bins=bins, min=min, max=max))


@k("index_put")
def index_put(x, idx, upd, axis=0, accumulate=False):
    npk.check_indices("index_put", idx, x.shape[axis], f"index (axis {axis})")
    out = x.clone(memory_format=torch.contiguous_format)
    flat = idx.reshape(-1).to(torch.int64)
    um = upd.movedim(tuple(range(axis, axis + idx.dim())), tuple(range(idx.dim()))).reshape((-1,) + tuple(x.shape[:axis]) + tuple(x.shape[axis + 1:]))
    if not accumulate and flat.numel() > 1:
        # Of repeated indices the last one wins, as in the numpy dialect: ATen's order is unspecified.
        pos = torch.arange(flat.numel(), device=flat.device)
        last = torch.full((x.shape[axis],), -1, dtype=torch.int64, device=flat.device).scatter_reduce_(0, flat, pos, "amax")
        keep = last[flat] == pos
        if not bool(keep.all()):
            flat, um = flat[keep], um[keep]
    out.movedim(axis, 0).index_put_((flat,), um, accumulate=accumulate)
    return out


@k("grouped_mm", checker=lambda ins: all(v.type.dtype.is_float for v in ins.operands[:2]))
def grouped_mm(x, w, offs, transpose_w=False):
    out = torch.zeros((x.shape[0], w.shape[1] if transpose_w else w.shape[2]), dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(npk.check_offsets("grouped_mm", offs, x.shape[0])):
        if end > start:
            torch.mm(x[start:end], w[e].t() if transpose_w else w[e], out=out[start:end])
        start = end
    return out


@k("grouped_mm_weight_grad", checker=lambda ins: all(v.type.dtype.is_float for v in ins.operands[:2]))
def grouped_mm_weight_grad(x, g, offs, transpose_w=False):
    k_, n = x.shape[1], g.shape[1]
    out = torch.zeros((offs.shape[0], n, k_) if transpose_w else (offs.shape[0], k_, n), dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(npk.check_offsets("grouped_mm_weight_grad", offs, x.shape[0])):
        if end > start:
            if transpose_w:
                torch.mm(g[start:end].t(), x[start:end], out=out[e])
            else:
                torch.mm(x[start:end].t(), g[start:end], out=out[e])
        start = end
    return out


# ---------------------------------------------------------------- group norm (remat.ir.ops.norm)
@k("group_norm")
@_channels_at_1(1)
def group_norm(x, *affine, groups, eps=1e-5, channels_last=False):
    n, c = x.shape[:2]
    w, b = (affine[0], affine[1]) if affine else (None, None)
    y, mean, rstd = torch.ops.aten.native_group_norm(x, w, b, n, c, x[0, 0].numel(), groups, eps)
    return _act(y, channels_last), _fresh(mean), _fresh(rstd)


@k("group_norm_grad")
@_channels_at_1(2)
def group_norm_grad(gy, x, mean, rstd, *w, groups, channels_last=False):
    n, c = x.shape[:2]
    weight = w[0] if w else None
    gx, gw, gb = torch.ops.aten.native_group_norm_backward(gy, x, mean, rstd, weight, n, c, x[0, 0].numel(), groups,
                                                           [True, bool(w), bool(w)])
    return (_act(gx, channels_last), _fresh(gw), _fresh(gb)) if w else _act(gx, channels_last)
