"""Kernels of image ops written for NCHW (channels on axis 1), run in any layout: the wrappers
both dialects use for the ``layout`` / ``input_layout`` attributes of convolution and pooling ops
and the channel ``axis`` of batch norm (``remat.passes.layout`` chooses them).

Each dialect passes its own ``permute(a, perm)`` / ``move(a, src, dst)`` (NumPy: transposed views;
torch: views whose channels-last strides ATen recognises, so its channels-last kernels run without
a copy) and ``fresh(r)`` (a result that owns exactly its contiguous bytes).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from ..ir.ops.nn import LAYOUT_OPERANDS, TO_NCHW, TO_NHWC, TO_OHWI, TO_OIHW, WEIGHT_OPERANDS


def _results(out: Any, convert: Callable[[int, Any], Any]) -> Any:
    back = [convert(i, r) for i, r in enumerate(out if isinstance(out, tuple) else (out,))]
    return tuple(back) if isinstance(out, tuple) else back[0]


def nchw_kernel(permute: Callable, fresh: Callable, op: str, pass_channels_last: bool = False):
    """A kernel of ``op`` written for NCHW and OIHW weights, also for NHWC (``layout``) and OHWI
    weights (``weight_layout``): its activation operands permuted to NCHW (its activation-shaped
    attribute permuted), its activation results permuted back (``remat.ir.ops.nn.LAYOUT_OPERANDS``);
    likewise its weight operand, weight-shaped attribute and weight-gradient result
    (``WEIGHT_OPERANDS``). ``input_layout`` (convolutions): operand 0's own layout, when it differs
    from ``layout``. ``pass_channels_last``: the kernel takes ``channels_last=True`` when its results
    are NHWC, and ``weight_channels_last=True`` when its weight gradient is OHWI (torch: an OIHW
    weight gradient in channels-last strides, whose OHWI view is then contiguous)."""
    acts, outs, shape_kw = LAYOUT_OPERANDS[op]
    w_in, w_out, w_kw = WEIGHT_OPERANDS.get(op, (None, None, None))

    def wrap(fn):
        @functools.wraps(fn)
        def any_layout(*args, layout="NCHW", input_layout="", weight_layout="OIHW", **kw):
            ohwi = weight_layout == "OHWI"
            if layout == "NCHW" and input_layout in ("", "NCHW") and not ohwi:
                return fn(*args, **kw)
            nhwc = [i in acts and ((input_layout or layout) if i == 0 else layout) == "NHWC" for i in range(len(args))]
            args = [permute(a, TO_NCHW) if t else a for a, t in zip(args, nhwc)]
            if ohwi:
                if w_in is not None:
                    args[w_in] = permute(args[w_in], TO_OIHW)
                if w_kw is not None:
                    kw[w_kw] = tuple(kw[w_kw][i] for i in TO_OIHW)
                if pass_channels_last:
                    kw["weight_channels_last"] = True
            if layout == "NCHW":
                out = fn(*args, **kw)
                acts_back = ()
            else:
                if shape_kw is not None:
                    kw[shape_kw] = tuple(kw[shape_kw][i] for i in TO_NCHW)
                out = fn(*args, **({"channels_last": True} if pass_channels_last else {}), **kw)
                acts_back = outs

            def back(i, r):
                if i in acts_back:
                    return fresh(permute(r, TO_NHWC))
                return fresh(permute(r, TO_OHWI)) if ohwi and i == w_out else r
            return _results(out, back)
        return any_layout
    return wrap


def channels_at_1(move: Callable, fresh: Callable, n_acts: int, pass_channels_last: bool = False):
    """A batch-norm kernel written for channels on axis 1, for any channel ``axis``: its first
    ``n_acts`` operands (x, and the output gradient before it) moved so, the results of their rank
    moved back. ``pass_channels_last``: the kernel takes ``channels_last`` (rank 4, channels last)."""
    def wrap(fn):
        @functools.wraps(fn)
        def any_axis(*args, axis=1, **kw):
            if axis == 1:
                return fn(*args, **kw)
            rank = len(args[n_acts - 1].shape)
            args = [move(a, axis, 1) if i < n_acts else a for i, a in enumerate(args)]
            extra = {"channels_last": rank == 4 and axis == 3} if pass_channels_last else {}
            out = fn(*args, **extra, **kw)
            return _results(out, lambda i, r: fresh(move(r, 1, axis)) if len(r.shape) == rank else r)
        return any_axis
    return wrap
