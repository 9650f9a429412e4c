"""Instructions timed alone (:mod:`remat.runtime.kernel_timing`): what a profiled compile prices the
instructions its measured runs lack by."""
from __future__ import annotations

import remat  # noqa: F401  (declares every op)
from remat.ir import Builder, DType, Function, TensorType
from remat.runtime.kernel_timing import kernel_seconds


def test_kernel_seconds_times_instructions_alone():
    t = TensorType(DType.f32, (64, 64))
    f = Function("f", [t, t], [TensorType(DType.f32, (64, 64))])
    b = Builder(f.entry)
    mm = b.create("matmul", [f.params[0], f.params[1]], {})
    view = b.create("reshape", [mm.results[0]], {"shape": (64, 64)})
    b.ret(view.results[0])
    sec, none = kernel_seconds([mm, view])
    assert sec > 0 and none is None  # a view costs nothing: not timed
