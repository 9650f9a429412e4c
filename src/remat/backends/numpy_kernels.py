"""The reference dialect ``numpy``: a kernel for every non-control op of the IR.

Low-precision floats (f16, bf16 through ml_dtypes) are computed in f32 and rounded to the result
dtype once per op. Convolution and pooling use stride tricks and einsum. Every kernel returns a
fresh C-contiguous array owning exactly its bytes (``reshape`` returns a view), with the exact IR
result dtype and shape; rank-0 results are 0-d arrays, never NumPy scalars.
"""
from __future__ import annotations

import numpy as np
import scipy.special
from numpy.lib.stride_tricks import as_strided

from ..ir.ops.nn import with_class_axis
from ..ir.ops.resize import axis_weights
from ..ir.types import DType
from . import kernel
from ._layout import channels_at_1, nchw_kernel

_BF16 = DType.bf16.numpy
_F16 = DType.f16.numpy
_LOWP = (_BF16, _F16)


def k(op: str, checker=None):
    return kernel(op, "numpy", checker)


def _fresh(x, dtype=None) -> np.ndarray:
    """A fresh C-contiguous array (0-d for scalars) of ``dtype`` (default: x's)."""
    return np.array(x, dtype=dtype, order="C", copy=True)


def _up(x: np.ndarray) -> np.ndarray:
    """Compute dtype for float math: f16/bf16 go to f32."""
    return x.astype(np.float32) if x.dtype in _LOWP else x


def _float_unary(fn):
    def run(x):
        return _fresh(fn(_up(x)), x.dtype)

    return run


# ---------------------------------------------------------------- unary
_FLOAT_UNARY = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x), "tanh": np.tanh,
    "sigmoid": scipy.special.expit, "sin": np.sin, "cos": np.cos, "erf": scipy.special.erf,
}
for _n, _f in _FLOAT_UNARY.items():
    k(_n)(_float_unary(_f))

k("neg")(_float_unary(np.negative))
k("abs")(_float_unary(np.abs))
k("sign")(_float_unary(np.sign))
k("floor")(_float_unary(np.floor))
k("relu")(_float_unary(lambda x: np.maximum(x, np.zeros((), x.dtype))))


@k("relu_grad")
def relu_grad(g, y):
    """PyTorch's threshold_backward at 0: 0 where y <= 0, else g (so a NaN y passes g through)."""
    return _fresh(np.where(y <= 0, np.zeros((), g.dtype), g), g.dtype)


@k("hardtanh")
def hardtanh(x, min_val=-1.0, max_val=1.0):
    return _fresh(np.minimum(np.maximum(x, np.asarray(min_val, x.dtype)), np.asarray(max_val, x.dtype)), x.dtype)


@k("hardtanh_grad")
def hardtanh_grad(g, v, min_val=-1.0, max_val=1.0):
    """PyTorch's hardtanh_backward: 0 where v <= min_val or v >= max_val, else g (a NaN v passes g)."""
    out = (v <= np.asarray(min_val, v.dtype)) | (v >= np.asarray(max_val, v.dtype))
    return _fresh(np.where(out, np.zeros((), g.dtype), g), g.dtype)


@k("gelu")
def gelu(x, approximate="none"):
    y = _up(x)
    if approximate == "tanh":
        c = np.sqrt(2.0 / np.pi).astype(y.dtype) if y.dtype == np.float32 else np.sqrt(2.0 / np.pi)
        r = 0.5 * y * (1.0 + np.tanh(c * (y + 0.044715 * y ** 3)))
    else:
        r = 0.5 * y * (1.0 + scipy.special.erf(y / np.sqrt(2.0).astype(y.dtype)))
    return _fresh(r, x.dtype)


@k("silu")
def silu(x):
    y = _up(x)
    return _fresh(y * scipy.special.expit(y), x.dtype)


@k("silu_grad")
def silu_grad(g, x):
    """PyTorch's silu_backward: g * s (1 + x (1 - s)), s = sigmoid(x)."""
    y = _up(x)
    s = scipy.special.expit(y)
    return _fresh(_up(g) * (s * (1.0 + y * (1.0 - s))), x.dtype)


@k("not")
def not_(x):
    return _fresh(np.logical_not(x))


# ---------------------------------------------------------------- binary
def _binary(fn):
    def run(a, b):
        return _fresh(fn(_up(a), _up(b)), a.dtype)

    return run


for _n, _f in {"add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum,
               "minimum": np.minimum}.items():
    k(_n)(_binary(_f))


@k("div")
def div(a, b):
    """True division for floats; floor division for integers (as Python and torch's 'floor' mode)."""
    if a.dtype.kind in "iu":
        return _fresh(np.floor_divide(a, b), a.dtype)
    return _fresh(np.true_divide(_up(a), _up(b)), a.dtype)


@k("pow")
def pow_(a, b):
    return _fresh(np.power(_up(a), _up(b)), a.dtype)


def _cmp(fn):
    def run(a, b):
        return _fresh(fn(_up(a), _up(b)))

    return run


for _n, _f in {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
               "ge": np.greater_equal}.items():
    k(_n)(_cmp(_f))
k("and")(lambda a, b: _fresh(np.logical_and(a, b)))
k("or")(lambda a, b: _fresh(np.logical_or(a, b)))


@k("select")
def select(c, a, b):
    return _fresh(np.where(c, a, b), a.dtype)


@k("cast")
def cast(x, dtype):
    dt = dtype.numpy
    if x.dtype in _LOWP and dt not in _LOWP and dt != np.float32:
        x = x.astype(np.float32)  # ml_dtypes casts low precision through f32 for ints and bool
    return _fresh(x, dt)


@k("copy")
def copy(x):
    return _fresh(x)


# ---------------------------------------------------------------- reductions and softmax
@k("reduce_sum")
def reduce_sum(x, axes, keepdims=False):
    if x.dtype == np.bool_:
        return _fresh(np.any(x, axis=tuple(axes), keepdims=keepdims))
    acc = np.float32 if x.dtype in _LOWP else x.dtype
    return _fresh(np.sum(x, axis=tuple(axes), keepdims=keepdims, dtype=acc), x.dtype)


@k("cumsum")
def cumsum(x, axis, reverse=False):
    acc = np.float32 if x.dtype in _LOWP else x.dtype
    if reverse:
        return _fresh(np.flip(np.cumsum(np.flip(x, axis), axis=axis, dtype=acc), axis), x.dtype)
    return _fresh(np.cumsum(x, axis=axis, dtype=acc), x.dtype)


@k("reduce_mean")
def reduce_mean(x, axes, keepdims=False):
    return _fresh(np.mean(_up(x), axis=tuple(axes), keepdims=keepdims), x.dtype)


@k("reduce_max")
def reduce_max(x, axes, keepdims=False):
    return _fresh(np.max(_up(x), axis=tuple(axes), keepdims=keepdims), x.dtype)


@k("softmax")
def softmax(x, axis):
    y = _up(x)
    e = np.exp(y - np.max(y, axis=axis, keepdims=True))
    return _fresh(e / np.sum(e, axis=axis, keepdims=True), x.dtype)


@k("log_softmax")
def log_softmax(x, axis):
    y = _up(x)
    z = y - np.max(y, axis=axis, keepdims=True)
    return _fresh(z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True)), x.dtype)


@k("matmul")
def matmul(a, b, transpose_a=False, transpose_b=False):
    a = np.swapaxes(a, -1, -2) if transpose_a else a  # views
    b = np.swapaxes(b, -1, -2) if transpose_b else b
    return _fresh(np.matmul(_up(a), _up(b)), a.dtype)


# ---------------------------------------------------------------- composite ops with native backward kernels
# (issue 8: linear, softmax/log_softmax backward, gelu backward, negative log-likelihood)
@k("linear")
def linear(x, w, b):
    return _fresh(np.matmul(_up(x), _up(w).T) + _up(b), x.dtype)


@k("softmax_grad")
def softmax_grad(g, y, axis):
    g32, y32 = _up(g), _up(y)
    return _fresh(y32 * (g32 - np.sum(g32 * y32, axis=axis, keepdims=True)), y.dtype)


@k("log_softmax_grad")
def log_softmax_grad(g, y, axis):
    g32, y32 = _up(g), _up(y)
    return _fresh(g32 - np.exp(y32) * np.sum(g32, axis=axis, keepdims=True), y.dtype)


def gelu_derivative(x: np.ndarray, approximate: str) -> np.ndarray:
    """gelu'(x) (exact, or of the tanh approximation), in x's dtype."""
    if approximate == "tanh":
        k, a = np.sqrt(2.0 / np.pi), 0.044715
        t = np.tanh(k * (x + a * x ** 3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * a * x * x)
    cdf = 0.5 * (1.0 + scipy.special.erf(x / np.sqrt(2.0)))
    return cdf + x * np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)


@k("gelu_grad")
def gelu_grad(g, x, approximate="none"):
    return _fresh(_up(g) * gelu_derivative(_up(x), approximate), x.dtype)


def _min_max(idx) -> tuple[int, int]:
    """The smallest and largest element of a non-empty index array (NumPy) or tensor (torch: one
    ``aminmax`` pass, one synchronisation)."""
    if isinstance(idx, np.ndarray):
        return int(idx.min()), int(idx.max())
    lo, hi = idx.aminmax()
    return int(lo), int(hi)


def check_indices(op: str, idx, n: int, what: str = "index", ignore_index: int | None = None) -> tuple[int, int] | None:
    """Raise IndexError naming ``op``, the first offending value and the valid range when an
    element of ``idx`` is outside [0, n) (and is not ``ignore_index``). Cheap when all are in range:
    one min/max reduction; only a failing check looks for the offending element. Works on NumPy
    arrays and torch tensors alike; every dialect's index-carrying kernels call it before writing.
    Returns the smallest and largest index (None for no indices)."""
    size = idx.numel() if callable(getattr(idx, "numel", None)) else idx.size
    if size == 0:
        return None
    lo, hi = _min_max(idx)
    if lo >= 0 and hi < n:
        return lo, hi
    bad = idx[(idx < 0) | (idx >= n)] if ignore_index is None else idx[((idx < 0) | (idx >= n)) & (idx != ignore_index)]
    if len(bad.reshape(-1)):
        also = "" if ignore_index is None else f" or equal ignore_index ({ignore_index})"
        raise IndexError(f"'{op}': {what} {int(bad.reshape(-1)[0])} is out of range; valid: [0, {n}){also} "
                         f"(min {lo}, max {hi} over {size} values)")
    return lo, hi


def check_targets(op: str, target, num_classes: int, ignore_index: int) -> bool:
    """Raise IndexError naming ``op`` when a class target (other than ``ignore_index``) is outside
    [0, num_classes) (PyTorch's nll_loss/cross_entropy rule). Returns whether every row counts
    (no target equals ``ignore_index``), decided from the same min/max: kernels then skip the
    row mask."""
    span = check_indices(op, target, num_classes, "target", ignore_index)
    return span is not None and 0 <= span[0] and span[1] < num_classes and not span[0] <= ignore_index <= span[1]


def _nll_rows(target, ignore_index):
    keep = target != ignore_index
    return keep, np.where(keep, target, 0)


@k("nll_loss")
def nll_loss(logp, target, reduction="mean", ignore_index=-100):
    # logp [N, C] or [N, C, d1, ...] with targets [N] or [N, d1, ...]: one class per row or position
    check_targets("nll_loss", target, logp.shape[1], ignore_index)
    keep, t = _nll_rows(target, ignore_index)
    picked = np.take_along_axis(_up(logp), np.expand_dims(t.astype(np.intp), 1), axis=1)[:, 0]
    per_row = np.where(keep, -picked, 0)
    if reduction == "none":
        return _fresh(per_row, logp.dtype)
    total = np.sum(per_row)
    if reduction == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            total = total / per_row.dtype.type(np.count_nonzero(keep))
    return _fresh(total, logp.dtype)


@k("nll_loss_grad")
def nll_loss_grad(g, target, num_classes, reduction="mean", ignore_index=-100):
    check_targets("nll_loss_grad", target, num_classes, ignore_index)
    keep, t = _nll_rows(target, ignore_index)
    g32 = _up(g)
    if reduction == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            g32 = g32 / g32.dtype.type(np.count_nonzero(keep))
    out = np.zeros(with_class_axis(target.shape, num_classes), dtype=g32.dtype)
    at = np.nonzero(keep)  # the kept rows (and positions); the class index goes in at axis 1
    out[(at[0], t[keep]) + at[1:]] = -(g32[keep] if reduction == "none" else g32)
    return _fresh(out, g.dtype)


# ---------------------------------------------------------------- layouts (remat.backends._layout)
def _nchw_kernel(op: str):
    return nchw_kernel(lambda a, perm: a.transpose(perm), _fresh, op)


def _channels_at_1(n_acts: int):
    return channels_at_1(lambda a, perm: a.transpose(perm), _fresh, n_acts)


# ---------------------------------------------------------------- convolution (NCHW, OIHW)
def _windows(xp: np.ndarray, kh: int, kw: int, oh: int, ow: int, stride, dilation) -> np.ndarray:
    """Read-only view [N, C, OH, OW, kH, kW] of the windows of a padded input."""
    n, c = xp.shape[:2]
    sn, sc, sh, sw = xp.strides
    return as_strided(xp, (n, c, oh, ow, kh, kw),
                      (sn, sc, sh * stride[0], sw * stride[1], sh * dilation[0], sw * dilation[1]), writeable=False)


def _pad_hw(x: np.ndarray, padding, value=0.0) -> np.ndarray:
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def _out_hw(h, w, kh, kw, stride, padding, dilation):
    return ((h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1,
            (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1)


@k("conv2d")
@_nchw_kernel("conv2d")
def conv2d(x, w, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    xd = _up(x)
    wd = _up(w)
    n, c, h, wid = x.shape
    o, cg, kh, kw = w.shape
    oh, ow = _out_hw(h, wid, kh, kw, stride, padding, dilation)
    win = _windows(_pad_hw(xd, padding), kh, kw, oh, ow, stride, dilation)
    win = win.reshape(n, groups, cg, oh, ow, kh, kw)
    wg = wd.reshape(groups, o // groups, cg, kh, kw)
    y = np.einsum("ngcijhw,gochw->ngoij", win, wg, optimize=True)
    return _fresh(y.reshape(n, o, oh, ow), x.dtype)


@k("conv2d_input_grad")
@_nchw_kernel("conv2d_input_grad")
def conv2d_input_grad(gy, w, input_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    gyd, wd = _up(gy), _up(w)
    n, c, h, wid = input_shape
    o, cg, kh, kw = w.shape
    _, _, oh, ow = gy.shape
    gp = np.zeros((n, groups, cg, h + 2 * padding[0], wid + 2 * padding[1]), dtype=gyd.dtype)
    gyg = gyd.reshape(n, groups, o // groups, oh, ow)
    wg = wd.reshape(groups, o // groups, cg, kh, kw)
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dilation[0], j * dilation[1]
            gp[:, :, :, r0:r0 + stride[0] * (oh - 1) + 1:stride[0], c0:c0 + stride[1] * (ow - 1) + 1:stride[1]] += \
                np.einsum("ngoij,goc->ngcij", gyg, wg[:, :, :, i, j], optimize=True)
    gx = gp[:, :, :, padding[0]:padding[0] + h, padding[1]:padding[1] + wid]
    return _fresh(gx.reshape(n, c, h, wid), gy.dtype)


@k("conv2d_weight_grad")
@_nchw_kernel("conv2d_weight_grad")
def conv2d_weight_grad(x, gy, weight_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    xd, gyd = _up(x), _up(gy)
    n, c, h, wid = x.shape
    o, cg, kh, kw = weight_shape
    _, _, oh, ow = gy.shape
    win = _windows(_pad_hw(xd, padding), kh, kw, oh, ow, stride, dilation).reshape(n, groups, cg, oh, ow, kh, kw)
    gyg = gyd.reshape(n, groups, o // groups, oh, ow)
    gw = np.einsum("ngcijhw,ngoij->gochw", win, gyg, optimize=True)
    return _fresh(gw.reshape(o, cg, kh, kw), x.dtype)


@k("conv2d_grads")
@_nchw_kernel("conv2d_grads")
def conv2d_grads(gy, x, w, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    a = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return conv2d_input_grad(gy, w, x.shape, **a), conv2d_weight_grad(x, gy, w.shape, **a)


# ---------------------------------------------------------------- pooling (NCHW)
def _pool_windows(x, kernel, stride, padding, fill):
    n, c, h, w = x.shape
    oh, ow = _out_hw(h, w, kernel[0], kernel[1], stride, padding, (1, 1))
    return _windows(_pad_hw(x, padding, fill), kernel[0], kernel[1], oh, ow, stride, (1, 1)), oh, ow


@k("max_pool2d")
@_nchw_kernel("max_pool2d")
def max_pool2d(x, kernel, stride, padding=(0, 0)):
    win, _, _ = _pool_windows(_up(x), kernel, stride, padding, -np.inf)  # padding never wins
    return _fresh(win.max(axis=(4, 5)), x.dtype)


@k("avg_pool2d")
@_nchw_kernel("avg_pool2d")
def avg_pool2d(x, kernel, stride, padding=(0, 0)):
    # Padding counts as zeros in the mean (torch's count_include_pad=True).
    win, _, _ = _pool_windows(_up(x), kernel, stride, padding, 0.0)
    return _fresh(win.sum(axis=(4, 5)) / (kernel[0] * kernel[1]), x.dtype)


def _max_pool_argmax(x, kernel, stride, padding):
    """Per window, the (row, col) of its first maximum in row-major window order, in unpadded input
    coordinates (torch's CPU rule for ties; with NaNs torch picks the last NaN, this the first)."""
    n, c, h, w = x.shape
    kh, kw = kernel
    win, oh, ow = _pool_windows(x, kernel, stride, padding, -np.inf)
    arg = win.reshape(n, c, oh, ow, kh * kw).argmax(axis=-1)
    di, dj = np.divmod(arg, kw)
    rows = np.arange(oh)[:, None] * stride[0] + di - padding[0]
    cols = np.arange(ow)[None, :] * stride[1] + dj - padding[1]
    return rows, cols


def _route(gy, rows, cols, input_shape, dtype):
    """Zeros of the input's shape with each window's gradient added at (rows, cols)."""
    n, c, h, w = input_shape
    gx = np.zeros((n, c, h, w), dtype=gy.dtype)
    np.add.at(gx, (np.arange(n)[:, None, None, None], np.arange(c)[None, :, None, None], rows, cols), gy)
    return _fresh(gx, dtype)


@k("max_pool2d_grad")
@_nchw_kernel("max_pool2d_grad")
def max_pool2d_grad(x, gy, kernel, stride, padding=(0, 0)):
    rows, cols = _max_pool_argmax(_up(x), kernel, stride, padding)
    return _route(_up(gy), rows, cols, x.shape, x.dtype)


@k("max_pool2d_with_indices")
@_nchw_kernel("max_pool2d_with_indices")
def max_pool2d_with_indices(x, kernel, stride, padding=(0, 0), index_dtype=DType.i64):
    rows, cols = _max_pool_argmax(_up(x), kernel, stride, padding)
    return max_pool2d(x, kernel, stride, padding), _fresh(rows * x.shape[3] + cols, index_dtype.numpy)


@k("max_pool2d_index_grad")
@_nchw_kernel("max_pool2d_index_grad")
def max_pool2d_index_grad(gy, indices, input_shape, kernel, stride, padding=(0, 0)):
    rows, cols = np.divmod(indices, input_shape[3])
    return _route(_up(gy), rows, cols, input_shape, gy.dtype)


@k("avg_pool2d_grad")
@_nchw_kernel("avg_pool2d_grad")
def avg_pool2d_grad(gy, input_shape, kernel, stride, padding=(0, 0)):
    gyd = _up(gy)
    n, c, h, w = input_shape
    _, _, oh, ow = gy.shape
    gp = np.zeros((n, c, h + 2 * padding[0], w + 2 * padding[1]), dtype=gyd.dtype)
    share = gyd / (kernel[0] * kernel[1])
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            gp[:, :, i:i + stride[0] * (oh - 1) + 1:stride[0], j:j + stride[1] * (ow - 1) + 1:stride[1]] += share
    return _fresh(gp[:, :, padding[0]:padding[0] + h, padding[1]:padding[1] + w], gy.dtype)


# ---------------------------------------------------------------- bilinear resize (remat.ir.ops.resize)
def _bilinear(h: int, w: int, oh: int, ow: int, align_corners: bool, scale_h: float, scale_w: float):
    """The row and column weight matrices ([oh, h], [ow, w]) of a bilinear resize."""
    return axis_weights(h, oh, align_corners, scale_h), axis_weights(w, ow, align_corners, scale_w)


@k("upsample_bilinear2d")
@_nchw_kernel("upsample_bilinear2d")
def upsample_bilinear2d(x, size, align_corners=False, scale_h=0.0, scale_w=0.0):
    ah, aw = _bilinear(*x.shape[2:], *size, align_corners, scale_h, scale_w)
    return _fresh(np.einsum("oh,nchw,pw->ncop", ah, x.astype(np.float64), aw), x.dtype)


@k("upsample_bilinear2d_grad")
@_nchw_kernel("upsample_bilinear2d_grad")
def upsample_bilinear2d_grad(gy, input_shape, align_corners=False, scale_h=0.0, scale_w=0.0):
    ah, aw = _bilinear(*input_shape[2:], *gy.shape[2:], align_corners, scale_h, scale_w)
    return _fresh(np.einsum("oh,ncop,pw->nchw", ah, gy.astype(np.float64), aw), gy.dtype)


# ---------------------------------------------------------------- random (shared with the torch dialect)
_M64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    """The splitmix64 finaliser on an unsigned 64-bit integer."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def fold_seed_int(seed: int, salt: int) -> int:
    """Derive a seed from (seed, salt) as a signed 64-bit integer; a fixed hash, stable across runs."""
    z = splitmix64((splitmix64(seed & _M64) ^ (salt & _M64)) & _M64)
    return z - (1 << 64) if z >= 1 << 63 else z


def generator(seed: int) -> np.random.Generator:
    """The Philox generator both dialects draw from, so their samples are bit-identical."""
    return np.random.Generator(np.random.Philox(key=int(seed) & _M64))


def sample_uniform(seed: int, shape, dtype: DType, low: float, high: float) -> np.ndarray:
    u = generator(seed).random(tuple(shape), dtype=np.float64)
    return _fresh(low + (high - low) * u, dtype.numpy)


def sample_normal(seed: int, shape, dtype: DType, mean: float, std: float) -> np.ndarray:
    z = generator(seed).standard_normal(tuple(shape), dtype=np.float64)
    return _fresh(mean + std * z, dtype.numpy)


SPLITMIX_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (see splitmix64 above)


def splitmix64_words(seed: int, n: int) -> np.ndarray:
    """The first ``n`` outputs of SplitMix64 started at ``seed``: word j is the splitmix64 finaliser of
    ``seed + (j + 1) * gamma``. Counter-based (each word depends on its index alone), so a generated
    kernel computes the same words in any order, in parallel, without state."""
    z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(SPLITMIX_GAMMA) + np.uint64(int(seed) & _M64)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def bernoulli_threshold(p: float) -> int:
    """``p`` quantised to 2**-32: an element is True when its 32-bit word is below this."""
    return min(round(p * 2.0 ** 32), 2 ** 32 - 1)


def sample_bernoulli(seed: int, shape, p: float) -> np.ndarray:
    """True with probability ``p`` (quantised to 2**-32): element i compares half ``i % 2`` (low half
    first) of SplitMix64 word ``i // 2`` (:func:`splitmix64_words`) with ``p * 2**32``. The reference
    of every dialect's dropout masks (the numba dialect draws the same bits several times faster)."""
    n = int(np.prod(shape, dtype=np.int64))
    if p <= 0.0 or p >= 1.0:
        return np.full(tuple(shape), p >= 1.0, dtype=np.bool_)
    words = splitmix64_words(seed, (n + 1) // 2).astype("<u8", copy=False).view("<u4")
    return _fresh((words[:n] < np.uint32(bernoulli_threshold(p))).reshape(tuple(shape)))


def sample_bernoulli_range(seed: int, start: int, n: int, p: float) -> np.ndarray:
    """Elements ``start .. start + n`` (flat) of ``sample_bernoulli(seed, shape, p)`` for any shape
    holding them, drawn alone: word ``j`` of SplitMix64 from ``seed`` is word 0's successor ``j`` times,
    so the words from ``start // 2`` on are those of the seed advanced by ``start // 2`` increments."""
    j0 = start // 2
    m = sample_bernoulli((int(seed) + j0 * SPLITMIX_GAMMA) & _M64, (n + start % 2,), p)
    return m[start % 2:]


@k("uniform")
def uniform(seed, shape, dtype=DType.f32, low=0.0, high=1.0):
    return sample_uniform(int(seed), shape, dtype, low, high)


@k("normal")
def normal(seed, shape, dtype=DType.f32, mean=0.0, std=1.0):
    return sample_normal(int(seed), shape, dtype, mean, std)


@k("bernoulli")
def bernoulli(seed, shape, p):
    return sample_bernoulli(int(seed), shape, p)


@k("fold_seed")
def fold_seed(seed, salt):
    return np.array(fold_seed_int(int(seed), salt), dtype=np.int64)


# ---------------------------------------------------------------- data movement
@k("transpose")
def transpose(x, perm):
    return _fresh(x.transpose(perm))


@k("reshape")
def reshape(x, shape):
    """A view of the operand (operands are contiguous, so numpy never copies here)."""
    return x.reshape(shape)


@k("broadcast")
def broadcast(x, shape):
    return _fresh(np.broadcast_to(x, tuple(shape)))


@k("slice")
def slice_(x, start, stop, step=()):
    step = step or (1,) * x.ndim
    return _fresh(x[tuple(slice(a, b, s) for a, b, s in zip(start, stop, step))])


@k("pad")
def pad(x, low, high, interior=(), value=0.0):
    interior = interior or (0,) * x.ndim
    shape = tuple(lo + hi + d + max(d - 1, 0) * it for lo, hi, it, d in zip(low, high, interior, x.shape))
    out = np.full(shape, value, dtype=np.float32 if x.dtype in _LOWP else x.dtype)
    if x.size:
        idx = tuple(slice(lo, lo + (d - 1) * (it + 1) + 1, it + 1) for lo, it, d in zip(low, interior, x.shape))
        out[idx] = x
    return _fresh(out, x.dtype)


@k("concat")
def concat(*xs, axis):
    return _fresh(np.concatenate(xs, axis=axis))


@k("gather")
def gather(table, idx, axis=0, padding_idx=-1):
    """numpy.take (``padding_idx`` only shapes the gradient); indices must lie in [0, n) (negative or out-of-range indices are errors)."""
    check_indices("gather", idx, table.shape[axis], f"index (axis {axis})")
    return _fresh(np.take(table, idx, axis=axis))


@k("scatter_add")
def scatter_add(idx, upd, shape, axis=0):
    check_indices("scatter_add", idx, shape[axis], f"index (axis {axis})")
    acc = np.float32 if upd.dtype in _LOWP else upd.dtype
    out = np.zeros(tuple(shape), dtype=acc)
    om = np.moveaxis(out, axis, 0)
    um = np.moveaxis(upd.astype(acc, copy=False), tuple(range(axis, axis + idx.ndim)), tuple(range(idx.ndim)))
    np.add.at(om, idx, um)
    return _fresh(out, upd.dtype)


@k("constant")
def constant(value, shape=(), dtype=DType.f32):
    return np.full(tuple(shape), value, dtype=dtype.numpy)


@k("iota")
def iota(shape, axis=0, dtype=DType.i64):
    shape = tuple(shape)
    r = np.arange(shape[axis], dtype=np.int64).reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return _fresh(np.broadcast_to(r, shape), dtype.numpy)


# ---------------------------------------------------------------- normalisation (composite ops of remat.ir.ops.norm)
def _norm_core(x: np.ndarray, axes: tuple[int, ...], eps: float):
    """(x - mean) * rstd over ``axes`` with mean and rstd (dims kept), in the compute dtype."""
    xu = _up(x)
    mean = np.mean(xu, axis=axes, keepdims=True)
    var = np.mean(np.square(xu - mean), axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    return (xu - mean) * rstd, mean, rstd, var


def _norm_backward(gy, xhat, rstd, w, axes):
    """grad_x of y = xhat * w (+ b) with xhat normalised over ``axes``: rstd (ĝ - mean ĝ - xhat mean(ĝ xhat))."""
    gh = gy * w if w is not None else gy
    return rstd * (gh - np.mean(gh, axis=axes, keepdims=True) - xhat * np.mean(gh * xhat, axis=axes, keepdims=True))


@k("layer_norm")
def layer_norm(x, *affine, axis, eps=1e-5):
    axes = tuple(range(axis, x.ndim))
    y, mean, rstd, _ = _norm_core(x, axes, eps)
    if affine:
        y = y * _up(affine[0])
    if len(affine) > 1:
        y = y + _up(affine[1])
    st = affine[0].dtype if affine else x.dtype  # mixed types (f16/bf16 input, f32 weight): f32 statistics
    return _fresh(y, x.dtype), _fresh(mean, st), _fresh(rstd, st)


@k("layer_norm_grad")
def layer_norm_grad(gy, x, mean, rstd, *w, axis):
    axes = tuple(range(axis, x.ndim))
    lead = tuple(range(axis))
    gy, rstd = _up(gy), _up(rstd)
    xhat = (_up(x) - _up(mean)) * rstd
    gx = _fresh(_norm_backward(gy, xhat, rstd, _up(w[0]) if w else None, axes), x.dtype)
    if not w:
        return gx
    return gx, _fresh(np.sum(gy * xhat, axis=lead), w[0].dtype), _fresh(np.sum(gy, axis=lead), w[0].dtype)


def _channel_np(v: np.ndarray, rank: int) -> np.ndarray:
    return _up(v).reshape((1, -1) + (1,) * (rank - 2))


@k("batch_norm")
@_channels_at_1(1)
def batch_norm(x, *rest, training=True, momentum=0.1, eps=1e-5, affine=True):
    na = 2 if affine else 0
    w, b = (rest[0], rest[1]) if affine else (None, None)
    running = rest[na:]
    r, axes = x.ndim, (0,) + tuple(range(2, x.ndim))
    if training:
        xhat, mean, rstd, var = _norm_core(x, axes, eps)
    else:
        mean, var = _channel_np(running[0], r), _channel_np(running[1], r)
        rstd = 1.0 / np.sqrt(var + eps)
        xhat = (_up(x) - mean) * rstd
    y = xhat * _channel_np(w, r) + _channel_np(b, r) if affine else xhat
    y = _fresh(y, x.dtype)
    if not training:
        return y
    c = x.shape[1]
    sd = rest[0].dtype if rest else x.dtype  # the statistics' dtype: float32 for a mixed-dtype batch norm
    out = (y, _fresh(mean.reshape(c), sd), _fresh(rstd.reshape(c), sd))
    if running:
        n = x.size // c
        new_mean = (1 - momentum) * _up(running[0]) + momentum * mean.reshape(c)
        new_var = (1 - momentum) * _up(running[1]) + momentum * var.reshape(c) * (n / max(n - 1, 1))
        out += (_fresh(new_mean, running[0].dtype), _fresh(new_var, running[1].dtype))
    return out


@k("batch_norm_stats")
@_channels_at_1(1)
def batch_norm_stats(x, *running, momentum=0.1, eps=1e-5):
    """In float64 (the numba kernel's precision), rounded to x's dtype once."""
    x64 = x.astype(np.float64)
    axes = (0,) + tuple(range(2, x.ndim))
    mean = x64.mean(axis=axes)
    var = np.square(x64 - _channel_np(mean, x.ndim)).mean(axis=axes)
    sd = running[0].dtype if running else x.dtype  # float32 for a half-precision x (mixed dtypes)
    out = (_fresh(mean, sd), _fresh(1.0 / np.sqrt(var + eps), sd))
    if running:
        n = x.size // x.shape[1]
        out += (_fresh((1 - momentum) * running[0].astype(np.float64) + momentum * mean, running[0].dtype),
                _fresh((1 - momentum) * running[1].astype(np.float64) + momentum * var * (n / max(n - 1, 1)),
                       running[1].dtype))
    return out


@k("batch_norm_grad")
@_channels_at_1(2)
def batch_norm_grad(gy, x, s1, s2, *w, training=True, eps=1e-5):
    """s1, s2: (save_mean, save_invstd) in training, (running_mean, running_var) in eval."""
    r, axes = x.ndim, (0,) + tuple(range(2, x.ndim))
    gy = _up(gy)
    mean = _channel_np(s1, r)
    rstd = _channel_np(s2, r) if training else 1.0 / np.sqrt(_channel_np(s2, r) + eps)
    xhat = (_up(x) - mean) * rstd
    wc = _channel_np(w[0], r) if w else None
    if training:
        gx = _norm_backward(gy, xhat, rstd, wc, axes)
    else:
        gx = gy * rstd * (wc if w else 1.0)
    gx = _fresh(gx, x.dtype)
    if not w:
        return gx
    sd = w[0].dtype  # float32 for a half-precision x (mixed dtypes)
    return gx, _fresh(np.sum(gy * xhat, axis=axes), sd), _fresh(np.sum(gy, axis=axes), sd)


@k("batch_norm_grad_sums")
@_channels_at_1(2)
def batch_norm_grad_sums(gy, x, mean, invstd):
    """(Σ gy·(x − mean)·invstd, Σ gy) per channel, in float64, rounded once."""
    r, axes = x.ndim, (0,) + tuple(range(2, x.ndim))
    gy = _up(gy)
    xhat = (_up(x) - _channel_np(mean, r)) * _channel_np(invstd, r)
    return _fresh(np.sum(gy * xhat, axis=axes), mean.dtype), _fresh(np.sum(gy, axis=axes), mean.dtype)


# ---------------------------------------------------------------- optimizer updates (in place)
def _write(dst: np.ndarray, value: np.ndarray) -> None:
    """Store ``value`` into ``dst`` in place, rounding to dst's dtype."""
    dst[...] = value.astype(dst.dtype, copy=False)


@k("nonfinite")
def nonfinite(*xs):
    """True when an element of an operand is NaN or infinite."""
    return np.array(not all(np.isfinite(x).all() for x in xs))


@k("sgd_step")
def sgd_step(param, grad, buf, step, hyper, skip, *, nesterov, maximize):
    """torch.optim.SGD's single-tensor update; param and buf are updated in place and returned.

    ``step`` is 1-based; at step 1 the momentum buffer is initialised to the first update direction.
    ``hyper``: [lr, momentum, dampening, weight_decay]; ``skip`` true: nothing changes.
    """
    if bool(skip):
        return param, buf
    lr, momentum, dampening, weight_decay = np.asarray(hyper).tolist()
    p, g = _up(param), _up(grad)
    d = -g if maximize else g
    if weight_decay != 0:
        d = d + weight_decay * p
    if momentum != 0:
        b = d.copy() if int(step) <= 1 else _up(buf) * momentum + (1 - dampening) * d
        _write(buf, b)
        b = _up(buf)
        d = d + momentum * b if nesterov else b
    _write(param, p - lr * d)
    return param, buf


@k("adam_step")
def adam_step(param, grad, m, v, step, hyper, skip, *, decoupled, maximize):
    """torch.optim.Adam (AdamW when ``decoupled``), single-tensor form; updates param, m, v in place.
    ``hyper``: [lr, beta1, beta2, eps, weight_decay]; ``skip`` true: nothing changes."""
    if bool(skip):
        return param, m, v
    lr, beta1, beta2, eps, weight_decay = np.asarray(hyper).tolist()
    p, g = _up(param), _up(grad)
    if maximize:
        g = -g
    if weight_decay != 0:
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    mm = _up(m) + (g - _up(m)) * (1 - beta1)
    vv = _up(v) * beta2 + (1 - beta2) * g * g
    _write(m, mm)
    _write(v, vv)
    t = int(step)
    step_size = lr / (1 - beta1 ** t)
    denom = np.sqrt(_up(v)) / np.sqrt(1 - beta2 ** t) + eps
    _write(param, p - step_size * _up(m) / denom)
    return param, m, v


# ---------------------------------------------------------------- collectives (a group of one rank)
def _one_rank(instr) -> bool:
    """The reference runs collectives only for ``world=1``, where each is a copy (mean = sum)."""
    return instr.attrs["world"] == 1


def _results(outs: tuple):
    """A variadic collective's results: the value itself for one operand (the kernel contract)."""
    return outs[0] if len(outs) == 1 else outs


@k("all_reduce", checker=_one_rank)
def all_reduce(*xs, world, op="mean"):
    return _results(tuple(_fresh(x) for x in xs))


@k("reduce_scatter", checker=_one_rank)
def reduce_scatter(*xs, world, op="mean"):
    return _results(tuple(_fresh(x) for x in xs))


@k("all_gather", checker=_one_rank)
def all_gather(*xs, world):
    return _results(tuple(_fresh(x) for x in xs))


@k("assign")
def assign(dst, src):
    """``dst``'s elements, in order, become the first ``dst.size`` of flat ``src``; in place."""
    dst.reshape(-1)[...] = src[:dst.size]
    return dst


# ---------------------------------------------------------------- fused element-wise bodies
@k("fused")
def fused(*args, body):
    """The reference: the body's nodes one by one with the numpy kernels (``remat.backends._fused``)."""
    from ..ir.types import TensorType
    from ._fused import interpret

    types = tuple(TensorType(DType.from_numpy(a.dtype), a.shape) for a in args)
    return interpret(body, args, types, ("numpy",), {"numpy": np.asarray},
                     lambda x, shape: np.array(np.broadcast_to(x, shape), order="C", copy=True))

# ---------------------------------------------------------------- attention (explicit softmax reference)
from ..ir.ops.attention import reference_backward, reference_forward  # noqa: E402


def _f32_mask(mask):
    return None if mask is None else (mask if mask.dtype == np.bool_ else _up(mask))


def _heads_first(x, seq_first: bool):
    """A [..., T, H, D] operand of a ``seq_first`` attention as the [..., H, T, D] view it computes on (and back)."""
    return np.swapaxes(x, -3, -2) if seq_first else x


@k("attention")
def attention(q, k, v, mask=None, *, scale, is_causal=False, seq_first=False, chunks=1):
    # ``chunks`` bounds a workspace of the scores; the reference computes the same values whole.
    dt = q.dtype
    q, k, v = (_heads_first(_up(x), seq_first) for x in (q, k, v))
    out, lse = reference_forward(q, k, v, _f32_mask(mask), scale=scale, is_causal=is_causal)
    return _fresh(_heads_first(out, seq_first), dt), _fresh(lse)


@k("attention_grad")
def attention_grad(g, q, k, v, out, lse, mask=None, *, scale, is_causal=False, seq_first=False, chunks=1):
    dt = q.dtype
    g, q, k, v, out = (_heads_first(_up(x), seq_first) for x in (g, q, k, v, out))
    grads = reference_backward(g, q, k, v, out, _up(lse), _f32_mask(mask), scale=scale, is_causal=is_causal)
    return tuple(_fresh(_heads_first(x, seq_first), dt) for x in grads)


# ---------------------------------------------------------------- cross-entropy fused with the head (chunked)
from ..ir.ops import crossentropy as _ce  # noqa: E402


@k("linear_cross_entropy")
def linear_cross_entropy(x, w, target, *, reduction="mean", ignore_index=-100, chunk=_ce.DEFAULT_CHUNK,
                         upcast=False):
    check_targets("linear_cross_entropy", target, w.shape[0], ignore_index)
    loss, lse = _ce.reference_forward(_up(x), _up(w), target, reduction=reduction, ignore_index=ignore_index,
                                      chunk=chunk)
    out = np.float32 if upcast else x.dtype
    return _fresh(loss, out), _fresh(lse, out)


@k("linear_cross_entropy_grad")
def linear_cross_entropy_grad(g, x, w, target, lse, *, reduction="mean", ignore_index=-100,
                              chunk=_ce.DEFAULT_CHUNK, upcast=False):
    check_targets("linear_cross_entropy_grad", target, w.shape[0], ignore_index)
    dx, dw = _ce.reference_backward(_up(g), _up(x), _up(w), target, _up(lse), reduction=reduction,
                                    ignore_index=ignore_index, chunk=chunk)
    return _fresh(dx, x.dtype), _fresh(dw, x.dtype)


@k("cross_entropy")
def cross_entropy(z, target, *, reduction="mean", ignore_index=-100, upcast=False):
    check_targets("cross_entropy", target, z.shape[1], ignore_index)
    loss, lse = _ce.logits_forward(_up(z), target, reduction=reduction, ignore_index=ignore_index)
    out = np.float32 if upcast else z.dtype
    return _fresh(loss, out), _fresh(lse, out)


@k("cross_entropy_grad")
def cross_entropy_grad(g, z, lse, target, *, reduction="mean", ignore_index=-100, upcast=False):
    check_targets("cross_entropy_grad", target, z.shape[1], ignore_index)
    return _fresh(_ce.logits_backward(_up(g), _up(z), _up(lse), target, reduction=reduction,
                                      ignore_index=ignore_index), z.dtype)


# ---------------------------------------------------------------- convolution -> batch norm -> ReLU -> max pool (batch-tiled)
from ..ir.ops import convblock as _cb  # noqa: E402
from ..ir.ops import nn as _nn  # noqa: E402


def _cb_nchw(a: np.ndarray, layout: str) -> np.ndarray:
    return a if layout in ("", "NCHW") else a.transpose(_nn.TO_NCHW)


def _cb_stats(n_a: int, mean_a, m2_a, c: np.ndarray):
    """Chan's combination of running (count, mean, M2) with a tile's per-channel moments (float64)."""
    n_b = c.shape[0] * c.shape[2] * c.shape[3]
    cd = c.astype(np.float64)
    mean_b = cd.mean(axis=(0, 2, 3))
    m2_b = ((cd - mean_b[None, :, None, None]) ** 2).sum(axis=(0, 2, 3))
    if n_a == 0:
        return n_b, mean_b, m2_b
    n = n_a + n_b
    delta = mean_b - mean_a
    return n, mean_a + delta * (n_b / n), m2_a + m2_b + delta * delta * (n_a * n_b / n)


def _cb_stats_pass(x, w, *running, stride=(1, 1), padding=(0, 0), dilation=(1, 1), layout="NCHW", input_layout="",
                   eps=1e-5, momentum=0.1, tile=1):
    xn = _cb_nchw(x, input_layout or layout)
    ca = dict(stride=stride, padding=padding, dilation=dilation)
    n_all, mean, m2 = 0, None, None
    for a in range(0, xn.shape[0], tile):
        n_all, mean, m2 = _cb_stats(n_all, mean, m2, conv2d(xn[a:a + tile], w, **ca))
    var = m2 / n_all
    dt = x.dtype
    out = (mean.astype(dt), (1.0 / np.sqrt(var + eps)).astype(dt))
    if running:
        rm, rv = running
        unbiased = var * (n_all / max(n_all - 1, 1))
        out += (((1 - momentum) * rm + momentum * mean).astype(dt), ((1 - momentum) * rv + momentum * unbiased).astype(dt))
    return out


def _cb_apply(x, w, gamma, beta, mean, invstd, *, stride=(1, 1), padding=(0, 0), dilation=(1, 1), layout="NCHW",
              input_layout="", eps=1e-5, pool_kernel=(), pool_stride=(), pool_padding=(0, 0), tile=1, input_grad=True):
    xn = _cb_nchw(x, input_layout or layout)
    ca = dict(stride=stride, padding=padding, dilation=dilation)
    pa = dict(kernel=pool_kernel, stride=pool_stride, padding=pool_padding)
    dt = x.dtype
    scale = (gamma * invstd).astype(dt)
    shift = (beta - mean * scale).astype(dt)
    parts = []
    for a in range(0, xn.shape[0], tile):
        c = conv2d(xn[a:a + tile], w, **ca)
        r = np.maximum(c * scale[None, :, None, None] + shift[None, :, None, None], dt.type(0))
        parts.append(max_pool2d(r, **pa))
    y = np.concatenate(parts)
    return np.ascontiguousarray(y if layout == "NCHW" else y.transpose(_nn.TO_NHWC))


def _cb_tiles(x, gy, w, gamma, beta, mean, invstd, *, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
              layout="NCHW", input_layout="", pool_kernel=(), pool_stride=(), pool_padding=(0, 0), tile=1, **_):
    """Per tile of the batch, (its slice, dz, x̂): the gradient at batch norm's output and its
    normalised input, the tile's forward recomputed."""
    xn, gyn = _cb_nchw(x, input_layout or layout), _cb_nchw(gy, layout)
    ca = dict(stride=stride, padding=padding, dilation=dilation)
    pa = dict(kernel=pool_kernel, stride=pool_stride, padding=pool_padding)
    ch = (None, slice(None), None, None)
    dt = x.dtype
    for a in range(0, xn.shape[0], tile):
        c = conv2d(xn[a:a + tile], w, **ca)
        xhat = (c - mean[ch]) * invstd[ch]
        z = xhat * gamma[ch] + beta[ch]
        r = np.maximum(z, dt.type(0))
        _, idx = max_pool2d_with_indices(r, **pa)
        dr = max_pool2d_index_grad(gyn[a:a + tile], idx, r.shape, **pa)
        yield slice(a, a + tile), np.where(z > 0, dr, dt.type(0)), xhat


def _cb_sums(x, gy, w, gamma, beta, mean, invstd, **attrs):
    """Batch norm's sums (Σ dz·x̂, Σ dz), each tile recomputed (the reference; the torch kernel reads
    them from the pooled output)."""
    s_dz = np.zeros(w.shape[0], dtype=x.dtype)
    s_dzx = np.zeros(w.shape[0], dtype=x.dtype)
    for _, dz, xhat in _cb_tiles(x, gy, w, gamma, beta, mean, invstd, **attrs):
        s_dz += dz.sum(axis=(0, 2, 3))
        s_dzx += (dz * xhat).sum(axis=(0, 2, 3))
    return s_dzx, s_dz


def _cb_grad(x, gy, w, gamma, beta, mean, invstd, s_dzx, s_dz, *, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
             layout="NCHW", input_layout="", input_grad=True, **attrs):
    xn = _cb_nchw(x, input_layout or layout)
    ca = dict(stride=stride, padding=padding, dilation=dilation)
    ch = (None, slice(None), None, None)
    dt = x.dtype
    hw = _nn.conv_out_hw("conv_bn_relu_pool_grad", xn.shape[2:], w.shape[2:], ca)
    m = dt.type(xn.shape[0] * hw[0] * hw[1])  # the count batch norm's statistics average over
    k = (gamma * invstd).astype(dt)
    gw = np.zeros_like(w)
    gx = np.empty_like(xn) if input_grad else None
    for part, dz, xhat in _cb_tiles(x, gy, w, gamma, beta, mean, invstd, layout=layout, input_layout=input_layout,
                                    **ca, **attrs):
        dc = k[ch] * (dz - (s_dz / m)[ch] - xhat * (s_dzx / m)[ch])
        gw += conv2d_weight_grad(xn[part], dc, w.shape, **ca)
        if input_grad:
            gx[part] = conv2d_input_grad(dc, w, xn[part].shape, **ca)
    if not input_grad:
        return gw
    return gw, np.ascontiguousarray(gx if layout == "NCHW" else gx.transpose(_nn.TO_NHWC))


@k("conv_bn_stats")
def conv_bn_stats(x, w, *running, **attrs):
    return tuple(_fresh(o, x.dtype) for o in _cb_stats_pass(*(_up(a) for a in (x, w, *running)), **attrs))


@k("conv_bn_relu_pool_apply")
def conv_bn_relu_pool_apply(x, w, gamma, beta, mean, invstd, **attrs):
    return _fresh(_cb_apply(*(_up(a) for a in (x, w, gamma, beta, mean, invstd)), **attrs), x.dtype)


@k("conv_bn_relu_pool")
def conv_bn_relu_pool(x, w, gamma, beta, *running, **attrs):
    # Its two passes, as the split-conv-bn-relu-pool pass runs them (bit for bit the same).
    stats = conv_bn_stats(x, w, *running, **_cb.stats_attrs(attrs))
    return (conv_bn_relu_pool_apply(x, w, gamma, beta, stats[0], stats[1], **_cb.output_attrs(attrs)), *stats)


@k("conv_bn_relu_pool_sums")
def conv_bn_relu_pool_sums(x, gy, w, gamma, beta, mean, invstd, y, **attrs):
    return tuple(_fresh(o, x.dtype) for o in _cb_sums(*(_up(a) for a in (x, gy, w, gamma, beta, mean, invstd)), **attrs))


@k("conv_bn_relu_pool_grad")
def conv_bn_relu_pool_grad(x, gy, w, gamma, beta, mean, invstd, ggamma, gbeta, **attrs):
    outs = _cb_grad(*(_up(a) for a in (x, gy, w, gamma, beta, mean, invstd, ggamma, gbeta)), **attrs)
    return _fresh(outs, x.dtype) if isinstance(outs, np.ndarray) else tuple(_fresh(o, x.dtype) for o in outs)


# ---------------------------------------------------------------- attention with dropout (explicit reference)
from ..ir.ops import attention as _att  # noqa: E402


def _keep(seed, q, k, p):
    """The keep mask over the scores' shape ``[..., T, S]``, as the explicit form's ``bernoulli`` draws it."""
    return sample_bernoulli(int(seed), q.shape[:-1] + (k.shape[-2],), 1.0 - p)


@k("dropout_attention")
def dropout_attention(q, k, v, seed, mask=None, *, scale, is_causal=False, p):
    out, lse = _att.reference_dropout_forward(_up(q), _up(k), _up(v), _keep(seed, q, k, p), _f32_mask(mask),
                                              scale=scale, is_causal=is_causal, p=p)
    return _fresh(out, q.dtype), _fresh(lse)


@k("dropout_attention_grad")
def dropout_attention_grad(g, q, k, v, out, lse, seed, mask=None, *, scale, is_causal=False, p):
    grads = _att.reference_dropout_backward(_up(g), _up(q), _up(k), _up(v), _up(out), _up(lse),
                                            _keep(seed, q, k, p), _f32_mask(mask), scale=scale,
                                            is_causal=is_causal, p=p)
    return tuple(_fresh(x, q.dtype) for x in grads)


# ---------------------------------------------------------------- routing (remat.ir.ops.routing)
def sort_order(x: np.ndarray, axis: int, descending: bool) -> np.ndarray:
    """Indices of a stable sort along ``axis`` (NaN largest; equal values in order of position):
    descending is the reversed ascending sort of the reversed array."""
    x = _up(x)
    if not descending:
        return np.argsort(x, axis=axis, kind="stable")
    n = x.shape[axis]
    return (n - 1) - np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)


@k("sort")
def sort(x, axis=-1, descending=False):
    idx = sort_order(x, axis, descending)
    return _fresh(np.take_along_axis(x, idx, axis)), _fresh(idx, np.int64)


@k("topk")
def topk(x, k, axis=-1, largest=True):
    idx = np.take(sort_order(x, axis, largest), np.arange(k), axis=axis)
    return _fresh(np.take_along_axis(x, idx, axis)), _fresh(idx, np.int64)


@k("histc")
def histc(x, bins, min, max):
    lo, hi = np.asarray(min, x.dtype), np.asarray(max, x.dtype)
    v = x.reshape(-1)
    v = v[(v >= lo) & (v <= hi)]
    pos = np.floor((v - lo) * np.asarray(bins, x.dtype) / (hi - lo)).astype(np.int64)
    pos[v == hi] = bins - 1
    return _fresh(np.bincount(np.clip(pos, 0, bins - 1), minlength=bins), x.dtype)


@k("index_put")
def index_put(x, idx, upd, axis=0, accumulate=False):
    check_indices("index_put", idx, x.shape[axis], f"index (axis {axis})")
    out = _up(x).copy()
    om = np.moveaxis(out, axis, 0)
    um = np.moveaxis(_up(upd), tuple(range(axis, axis + idx.ndim)), tuple(range(idx.ndim)))
    if accumulate:
        np.add.at(om, idx, um)
    else:
        om[idx] = um
    return _fresh(out, x.dtype)


def check_offsets(op: str, offs, rows: int) -> list[int]:
    """The group ends as Python ints; ValueError naming ``op`` unless nondecreasing within [0, rows]."""
    ends = [int(v) for v in offs.tolist()]
    prev = 0
    for e, end in enumerate(ends):
        if not prev <= end <= rows:
            raise ValueError(f"'{op}': offsets must be nondecreasing within [0, {rows}] (the rows); offset {e} is "
                             f"{end} after {prev}")
        prev = end
    return ends


@k("grouped_mm")
def grouped_mm(x, w, offs, transpose_w=False):
    x32, w32 = _up(x), _up(w)
    out = np.zeros((x.shape[0], w.shape[1] if transpose_w else w.shape[2]), x32.dtype)
    start = 0
    for e, end in enumerate(check_offsets("grouped_mm", offs, x.shape[0])):
        if end > start:
            out[start:end] = x32[start:end] @ (w32[e].T if transpose_w else w32[e])
        start = end
    return _fresh(out, x.dtype)


@k("grouped_mm_weight_grad")
def grouped_mm_weight_grad(x, g, offs, transpose_w=False):
    x32, g32 = _up(x), _up(g)
    k_, n = x.shape[1], g.shape[1]
    out = np.zeros((len(offs), n, k_) if transpose_w else (len(offs), k_, n), x32.dtype)
    start = 0
    for e, end in enumerate(check_offsets("grouped_mm_weight_grad", offs, x.shape[0])):
        if end > start:
            out[e] = g32[start:end].T @ x32[start:end] if transpose_w else x32[start:end].T @ g32[start:end]
        start = end
    return _fresh(out, x.dtype)


# ---------------------------------------------------------------- group norm (remat.ir.ops.norm)
@k("group_norm")
@_channels_at_1(1)
def group_norm(x, *affine, groups, eps=1e-5):
    n = x.shape[0]
    xhat, mean, rstd, _ = _norm_core(x.reshape(n, groups, -1), (2,), eps)
    y = xhat.reshape(x.shape)
    if affine:
        y = y * _channel_np(affine[0], x.ndim) + _channel_np(affine[1], x.ndim)
    st = affine[0].dtype if affine else x.dtype  # mixed types (f16/bf16 input, f32 weight): f32 statistics
    return _fresh(y, x.dtype), _fresh(mean.reshape(n, groups), st), _fresh(rstd.reshape(n, groups), st)


@k("group_norm_grad")
@_channels_at_1(2)
def group_norm_grad(gy, x, mean, rstd, *w, groups):
    n, shape = x.shape[0], x.shape
    gyu = _up(gy)
    r = _up(rstd).reshape(n, groups, 1)
    xhat = (_up(x).reshape(n, groups, -1) - _up(mean).reshape(n, groups, 1)) * r
    gh = (gyu * _channel_np(w[0], x.ndim) if w else gyu).reshape(n, groups, -1)
    gx = _fresh(_norm_backward(gh, xhat, r, None, (2,)).reshape(shape), x.dtype)
    if not w:
        return gx
    axes = (0,) + tuple(range(2, x.ndim))
    return (gx, _fresh(np.sum(gyu * xhat.reshape(shape), axis=axes), w[0].dtype),
            _fresh(np.sum(gyu, axis=axes), w[0].dtype))
