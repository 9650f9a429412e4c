"""Kernels of image ops written for NCHW (channels on axis 1), run in any layout: the wrappers
both dialects use for the ``layout`` / ``input_layout`` attributes of convolution and pooling ops
and the channel ``axis`` of batch norm (``remat.passes.layout`` chooses them).

Each dialect passes its own ``permute(a, perm)`` (NumPy: transposed views;
torch: views whose channels-last strides ATen recognises, so its channels-last kernels run without
a copy) and ``fresh(r)`` (a result that owns exactly its contiguous bytes). The wrapped kernels
have a ``bind(**attrs)`` that decides one instruction's permutations once (:func:`remat.backends.bound`).
"""
from __future__ import annotations

import functools
from typing import Callable

from . import bindable
from ..ir.ops.nn import LAYOUT_OPERANDS, TO_NCHW, TO_NHWC, TO_OHWI, TO_OIHW, WEIGHT_OPERANDS


def nchw_kernel(permute: Callable, fresh: Callable | None, op: str, pass_channels_last: bool = False):
    """A kernel of ``op`` written for NCHW and OIHW weights, also for NHWC (``layout``) and OHWI
    weights (``weight_layout``): its activation operands permuted to NCHW (its activation-shaped
    attribute permuted), its activation results permuted back (``remat.ir.ops.nn.LAYOUT_OPERANDS``);
    likewise its weight operand, weight-shaped attribute and weight-gradient result
    (``WEIGHT_OPERANDS``). ``input_layout`` (convolutions): operand 0's own layout, when it differs
    from ``layout``. ``pass_channels_last``: the kernel takes ``channels_last=True`` when its results
    are NHWC, and ``weight_channels_last=True`` when its weight gradient is OHWI (torch: an OIHW
    weight gradient in channels-last strides, whose OHWI view is then contiguous). ``fresh``: what
    makes a permuted result own its contiguous bytes; None where the kernel's results are already
    dense in the permuted layout (torch's channels-last results).

    The wrapped kernel has a ``bind(**attrs)`` (:func:`remat.backends.bound`): the permutations and
    keywords of one instruction decided once, returning a function of the operands alone."""
    acts, outs, shape_kw = LAYOUT_OPERANDS[op]
    w_in, w_out, w_kw = WEIGHT_OPERANDS.get(op, (None, None, None))

    def wrap(fn):
        def bind(layout="NCHW", input_layout="", weight_layout="OIHW", **kw):
            ohwi = weight_layout == "OHWI"
            if layout == "NCHW" and input_layout in ("", "NCHW") and not ohwi:
                return functools.partial(fn, **kw) if kw else fn
            perms = [(i, TO_NCHW) for i in acts if ((input_layout or layout) if i == 0 else layout) == "NHWC"]
            back: dict[int, tuple[int, ...]] = {}
            if ohwi:
                if w_in is not None:
                    perms.append((w_in, TO_OIHW))
                if w_kw is not None:
                    kw[w_kw] = tuple(kw[w_kw][i] for i in TO_OIHW)
                if pass_channels_last:
                    kw["weight_channels_last"] = True
                if w_out is not None:
                    back[w_out] = TO_OHWI
            if layout != "NCHW":
                if shape_kw is not None:
                    kw[shape_kw] = tuple(kw[shape_kw][i] for i in TO_NCHW)
                if pass_channels_last:
                    kw["channels_last"] = True
                back.update((i, TO_NHWC) for i in outs)  # (an activation result is never the weight's)
            return _bound(fn, kw, tuple(perms), back, permute, fresh)

        @functools.wraps(fn)
        def any_layout(*args, **attrs):
            return bind(**attrs)(*args)
        return bindable(any_layout, bind)
    return wrap


def _bound(fn: Callable, kw: dict, perms: tuple, back: dict, permute: Callable, fresh: Callable | None) -> Callable:
    """``fn(*operands, **kw)`` with operand i permuted by ``perms``' (i, perm) pairs first, and
    result i permuted back by ``back[i]`` (then made ``fresh``)."""
    single = back.get(0)  # a kernel returning one result: its permutation back, if any

    def run(*args):
        if perms:
            args = list(args)
            for i, p in perms:
                args[i] = permute(args[i], p)
        out = fn(*args, **kw)
        if type(out) is not tuple:
            if single is None:
                return out
            r = permute(out, single)
            return r if fresh is None else fresh(r)
        res = []
        for i, r in enumerate(out):
            p = back.get(i)
            if p is not None:
                r = permute(r, p)
                if fresh is not None:
                    r = fresh(r)
            res.append(r)
        return tuple(res)
    return run


def channels_at_1(permute: Callable, fresh: Callable, n_acts: int, pass_channels_last: bool = False):
    """A batch-norm kernel written for channels on axis 1, for any channel ``axis``: its first
    ``n_acts`` operands (x, and the output gradient before it) permuted so (``movedim(axis, 1)``),
    the results of their rank permuted back. ``pass_channels_last``: the kernel takes
    ``channels_last`` (rank 4, channels last) and then returns results of that rank dense
    channels-last (their permuted-back view is contiguous: not made ``fresh``). Has a
    ``bind(**attrs)``, as :func:`nchw_kernel`'s."""
    def wrap(fn):
        def bind(axis=1, **kw):
            if axis == 1:
                return functools.partial(fn, **kw) if kw else fn
            last = n_acts - 1
            perms: dict[int, tuple] = {}  # rank -> (to axis 1, back, channels_last)

            def perms_of(rank: int) -> tuple:
                to1 = [d for d in range(rank) if d != axis]
                to1.insert(1, axis)
                cl = rank == 4 and axis == 3
                p = perms[rank] = (tuple(to1), tuple(to1.index(d) for d in range(rank)), cl, cl and pass_channels_last)
                return p

            def run(*args):
                rank = len(args[last].shape)
                to1, back, cl, dense = perms.get(rank) or perms_of(rank)
                args = list(args)
                for i in range(n_acts):
                    args[i] = permute(args[i], to1)
                out = fn(*args, channels_last=cl, **kw) if pass_channels_last else fn(*args, **kw)

                def moved_back(r):  # results of the operands' rank: channels back at ``axis``
                    if len(r.shape) != rank:
                        return r
                    r = permute(r, back)
                    return r if dense else fresh(r)
                return tuple(map(moved_back, out)) if type(out) is tuple else moved_back(out)
            return run

        @functools.wraps(fn)
        def any_axis(*args, **attrs):
            return bind(**attrs)(*args)
        return bindable(any_axis, bind)
    return wrap
