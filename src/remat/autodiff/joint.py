"""The joint forward+backward of a function: its outputs and the gradient of its first output.

Both the training step (the loss and the other forward outputs, with parameter gradients) and a
checkpointed chain stage (the stage output and its side outputs, with a VJP at an explicit output
cotangent) are built here, so they differ only by their arguments.
"""
from __future__ import annotations

from typing import Sequence

from ..ir import Builder, Function, GradientSpec, Module
from .transform import gradient_function


def joint(forward: Function, wrt: Sequence[int], *, cotangents: bool = False, name: str = "joint") -> Module:
    """A module whose function ``name`` maps ``forward``'s params (then, with ``cotangents``, the
    cotangent of its first result) to ``(first result, other results..., gradients wrt wrt...)``.

    The gradient is of the first result alone; the other results (updated batch-norm statistics, a
    stage's side outputs) are passed through. The module still holds calls: run the ``cleanup``
    pipeline (:data:`remat.passes.CLEANUP`) to get one straight-line function.
    """
    wrt = tuple(wrt)
    m = Module([forward.clone("forward")])
    fwd = m["forward"]
    if len(fwd.result_types) == 1:  # the gradient function is the joint
        m.add(gradient_function(m, name, GradientSpec("forward", wrt, with_value=True), explicit_cotangents=cotangents))
        return m
    only = Function("first_only", fwd.param_types, fwd.result_types[:1])
    b = Builder(only.entry)
    b.ret(b.call(fwd, *only.params)[0])
    m.add(only)
    g = gradient_function(m, "value_and_grad", GradientSpec("first_only", wrt, with_value=True),
                          explicit_cotangents=cotangents)
    m.add(g)
    fn = Function(name, g.param_types, [fwd.result_types[0], *fwd.result_types[1:], *g.result_types[1:]])
    b = Builder(fn.entry)
    vg = b.call(g, *fn.params)
    fo = b.call(fwd, *fn.params[:len(fwd.params)])
    b.ret(vg[0], *fo[1:], *vg[1:])
    m.add(fn)
    return m


__all__ = ["joint"]
