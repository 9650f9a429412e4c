"""Helpers for the autodiff tests: wrap an op sample in a function, differentiate, evaluate."""
from __future__ import annotations

import numpy as np

from remat.autodiff import differentiate
from remat.ir import Builder, DType, Function, GradientSpec, Module, TensorType, verify

from _interp import evaluate


def ttype(a: np.ndarray) -> TensorType:
    return TensorType(DType.from_numpy(np.asarray(a).dtype), np.asarray(a).shape)


def op_function(name: str, op: str, args, attrs, results: tuple[int, ...] | None = None) -> Function:
    """A function applying ``op`` once and returning its results (all, or those in ``results``:
    e.g. attention's logsumexp is an auxiliary result it is not differentiated through)."""
    f = Function(name, [ttype(a) for a in args])
    b = Builder(f.entry)
    r = b.op(op, *f.params, **attrs)
    rs = list(r) if isinstance(r, tuple) else [r]
    if results is not None:
        rs = [rs[i] for i in results]
    f.result_types = [v.type for v in rs]
    b.ret(*rs)
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
    """<J u, v> (central differences along a random u) == <u, J^T v> (the generated backward).

    With several outputs, v has one random part per floating-point output and <J u, v> sums them.
    """
    fl = float_indices(args)
    m = grad_module(f, fl, extra=[g for g in (module or ()) if g.name != f.name])
    ys = evaluate(f, args, m)
    fo = [k for k, y in enumerate(ys) if y.dtype.kind == "f"]
    scalar = len(ys) == 1 and ys[0].size == 1 and ys[0].dtype.kind == "f"
    vs = {k: np.ones_like(ys[k]) if scalar else rng.standard_normal(ys[k].shape).astype(ys[k].dtype) for k in fo}
    us = {i: rng.standard_normal(np.shape(args[i])) for i in fl}
    gargs = list(args) + ([] if scalar else [vs[k] for k in fo])
    grads = evaluate(m[f.name + "_grad"], gargs, m)

    def shifted(s):
        a = [np.asarray(x) + s * us[i] if i in us else x for i, x in enumerate(args)]
        return [o.astype(np.float64) for o in evaluate(f, a, m)]

    hi, lo = shifted(eps), shifted(-eps)
    lhs = float(sum(np.sum((hi[k] - lo[k]) / (2 * eps) * vs[k]) for k in fo))
    rhs = float(sum(np.sum(grads[k].astype(np.float64) * us[i]) for k, i in enumerate(fl)))
    scale = max(1.0, abs(lhs), abs(rhs))
    assert abs(lhs - rhs) <= rtol * scale * 100 + 1e-7, f"<Ju,v>={lhs} but <u,J^T v>={rhs}"
