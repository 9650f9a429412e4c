"""Helpers for the autodiff tests: wrap an op sample in a function, differentiate, evaluate."""
from __future__ import annotations

import numpy as np

from remat.autodiff import differentiate
from remat.ir import Builder, DType, Function, GradientSpec, Module, TensorType, verify

from _interp import evaluate


def ttype(a: np.ndarray) -> TensorType:
    return TensorType(DType.from_numpy(np.asarray(a).dtype), np.asarray(a).shape)


def op_function(name: str, op: str, args, attrs) -> Function:
    """A function applying ``op`` to its parameters, returning the op's first result (the one the
    op is differentiated through; e.g. attention's logsumexp is an auxiliary result)."""
    f = Function(name, [ttype(a) for a in args])
    b = Builder(f.entry)
    r = b.create(op, f.params, attrs).results[0]
    f.result_types = [r.type]
    b.ret(r)
    return f


def grad_module(f: Function, wrt, with_value: bool = False, adjoints: str = "outputs", extra=()) -> Module:
    m = Module([f, *extra, Function(f.name + "_grad", gradient=GradientSpec(f.name, tuple(wrt), with_value))])
    verify(m)
    out = differentiate(m, adjoints)
    verify(out)
    return out


def float_indices(args) -> list[int]:
    return [i for i, a in enumerate(args) if np.asarray(a).dtype.kind == "f"]


def check_vjp(f: Function, args, rng, eps: float = 1e-6, rtol: float = 1e-6, module=None) -> None:
    """<J u, v> (central differences along a random u) == <u, J^T v> (the generated backward)."""
    fl = float_indices(args)
    m = grad_module(f, fl, extra=[g for g in (module or ()) if g.name != f.name])
    y = evaluate(f, args, m)[0]
    scalar = y.size == 1 and y.dtype.kind == "f"
    v = np.ones_like(y) if scalar else rng.standard_normal(y.shape).astype(y.dtype)
    us = {i: rng.standard_normal(np.shape(args[i])) for i in fl}
    gargs = list(args) + ([] if scalar else [v])
    grads = evaluate(m[f.name + "_grad"], gargs, m)

    def shifted(s):
        a = [np.asarray(x) + s * us[i] if i in us else x for i, x in enumerate(args)]
        return evaluate(f, a, m)[0].astype(np.float64)

    jvp = (shifted(eps) - shifted(-eps)) / (2 * eps)
    lhs = float(np.sum(jvp * v))
    rhs = float(sum(np.sum(grads[k].astype(np.float64) * us[i]) for k, i in enumerate(fl)))
    scale = max(1.0, abs(lhs), abs(rhs))
    assert abs(lhs - rhs) <= rtol * scale * 100 + 1e-7, f"<Ju,v>={lhs} but <u,J^T v>={rhs}"
