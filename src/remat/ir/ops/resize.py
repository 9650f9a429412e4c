"""Image resizing as composite ops with native kernels: bilinear up- (or down-) sampling of an NCHW
(or, ``layout="NHWC"``, channels-last) tensor and its backward, as ATen's ``upsample_bilinear2d``
and ``upsample_bilinear2d_backward`` (``F.interpolate(..., mode="bilinear")``: segmentation
decoders, feature pyramids).

PyTorch's decomposition of the op gathers the four neighbours of every output pixel (four
``gather``s, clamped index arithmetic, and in the backward four ``scatter_add``s over input-sized
buffers); the native kernels make one pass each way (a Segformer step: 12 gathers and 12
scatter-adds, a quarter of its time). The op is linear in its input, so its backward is its
transpose: ``upsample_bilinear2d_grad``, whose own VJP is the op again.

Source positions follow ATen (``area_pixel_compute_source_index``): with ``align_corners`` the
corner pixels of input and output line up, ``src = d * (in - 1) / (out - 1)``; without it pixel
centres do, ``src = max((d + 0.5) * scale - 0.5, 0)`` with ``scale = in / out``, or ``1 / scale_h``
(``1 / scale_w``) when the caller gave a scale factor (``F.interpolate(scale_factor=...)``; 0:
none given).
"""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, OpDef, Sample, declare
from ..types import TensorType
from ._util import expect_float, ints, rand
from .nn import nchw, stored, with_nhwc

_SHARED_ATTRS = (Attr("align_corners", "bool", False), Attr("scale_h", "float", 0.0), Attr("scale_w", "float", 0.0),
           Attr("layout", "str", "NCHW"))
SHARED_KEYS = ("align_corners", "scale_h", "scale_w", "layout")
"""The attributes the op and its gradient share."""


def _check_hw(name: str, what: str, hw: tuple[int, ...]) -> None:
    if len(hw) != 2 or min(hw) < 1:
        raise TypeError(f"'{name}': {what} must be two positive sizes [H, W], got {list(hw)}")


def _check_scales(name: str, attrs) -> None:
    if attrs["scale_h"] < 0 or attrs["scale_w"] < 0:
        raise TypeError(f"'{name}': scale_h and scale_w must be positive (0: none given), got "
                        f"{attrs['scale_h']} and {attrs['scale_w']}")


def _upsample_infer(types, attrs):
    (x,) = types
    expect_float("upsample_bilinear2d", x)
    xs = nchw("upsample_bilinear2d", x, attrs)
    _check_hw("upsample_bilinear2d", "size", attrs["size"])
    _check_scales("upsample_bilinear2d", attrs)
    return x.with_shape(stored(xs[:2] + tuple(attrs["size"]), attrs))


def _upsample_grad_infer(types, attrs):
    (gy,) = types
    expect_float("upsample_bilinear2d_grad", gy)
    shape = tuple(attrs["input_shape"])
    if len(shape) != 4 or min(shape) < 1:
        raise TypeError(f"'upsample_bilinear2d_grad': input_shape must be 4 positive sizes (the input's, as its "
                        f"layout stores it), got {list(shape)}")
    _check_scales("upsample_bilinear2d_grad", attrs)
    xs = nchw("upsample_bilinear2d_grad", TensorType(gy.dtype, shape), attrs)
    gys = nchw("upsample_bilinear2d_grad", gy, attrs)
    if gys[:2] != xs[:2]:
        raise TypeError(f"'upsample_bilinear2d_grad': output gradient {gy} must have the input's N and C "
                        f"{list(xs[:2])} ({attrs.get('layout', 'NCHW')})")
    return gy.with_shape(shape)


def axis_weights(n_in: int, n_out: int, align_corners: bool, scale: float = 0.0) -> np.ndarray:
    """[n_out, n_in] float64: row d holds the weights of output position d's two source positions
    along one axis (ATen's source index and lambdas; the two coincide at the last input position)."""
    a = np.zeros((n_out, n_in))
    if align_corners:
        step = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    else:
        step = 1.0 / scale if scale > 0 else n_in / n_out
    for d in range(n_out):
        src = step * d if align_corners else max(step * (d + 0.5) - 0.5, 0.0)
        i0 = min(int(src), n_in - 1)
        i1 = i0 + (1 if i0 < n_in - 1 else 0)
        l1 = src - i0
        a[d, i0] += 1.0 - l1
        a[d, i1] += l1
    return a


def _flops(ins, outs, attrs):
    return 8.0 * max(ins[0].numel, outs[0].numel)  # four neighbours, a multiply-add each


def _samples(r: np.random.Generator) -> list[Sample]:
    return [Sample([rand(r, 2, 3, 4, 5)], {"size": (7, 9)}),
            Sample([rand(r, 1, 2, 3, 3)], {"size": (6, 5), "align_corners": True}),
            Sample([rand(r, 1, 2, 3, 4)], {"size": (6, 8), "scale_h": 2.0, "scale_w": 2.0}),
            Sample([rand(r, 1, 1, 6, 5)], {"size": (4, 3)}),  # downsampling
            Sample([rand(r, 1, 1, 1, 4)], {"size": (3, 1), "align_corners": True})]


def _grad_samples(r: np.random.Generator) -> list[Sample]:
    out = []
    for s in _samples(r):
        (x,) = s.args
        attrs = {k: v for k, v in s.attrs.items() if k != "size"}
        out.append(Sample([rand(r, *x.shape[:2], *s.attrs["size"])], {**attrs, "input_shape": x.shape}))
    return out


declare(OpDef("upsample_bilinear2d", 1, (ints("size"),) + _SHARED_ATTRS, _upsample_infer, frozenset(), flops=_flops,
              doc="bilinear resize of x [N, C, H, W] (or NHWC) to size [OH, OW] (ATen upsample_bilinear2d: "
                  "F.interpolate mode='bilinear'); scale_h/scale_w: the caller's scale factors (0: none, in/out "
                  "is used)",
              sample=with_nhwc(_samples, (0,))))
declare(OpDef("upsample_bilinear2d_grad", 1, (ints("input_shape"),) + _SHARED_ATTRS, _upsample_grad_infer, frozenset(),
              flops=_flops, doc="gradient of upsample_bilinear2d from grad_output [N, C, OH, OW] (its transpose: "
                                "each output's gradient spread over its four source pixels)",
              sample=with_nhwc(_grad_samples, (0,), "input_shape")))


# ================================================================ VJP rules (reverse mode)
from ..opdef import def_vjp  # noqa: E402


def _shared(p) -> dict:
    return {k: p.attrs[k] for k in SHARED_KEYS}


@def_vjp("upsample_bilinear2d", saves="none")
def _upsample_vjp(b, p, g):
    return [b.op("upsample_bilinear2d_grad", g, input_shape=p.in_types[0].shape, **_shared(p))]


@def_vjp("upsample_bilinear2d_grad", saves="none")
def _upsample_grad_vjp(b, p, g):
    size = nchw("upsample_bilinear2d_grad", p.in_types[0], p.attrs)[2:]
    return [b.op("upsample_bilinear2d", g, size=size, **_shared(p))]
