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


def test_timed_runs_wait_for_the_device_at_each_instruction():
    """A device VM's timed run (``record="full"``) waits for the device's queued kernels before the run
    and at the end of each top-level instruction, so an instruction's seconds are its kernels' and not
    their launch's (a CUDA kernel returns before it has run). Checked with a stand-in wait that takes
    2 ms: every instruction's time includes it, and the lean run used for steps never waits."""
    import time

    import numpy as np

    from remat.runtime.vm import VM

    t = TensorType(DType.f32, (8, 8))
    f = Function("f", [t, t], [t])
    b = Builder(f.entry)
    s = b.create("add", [f.params[0], f.params[1]], {})
    e = b.create("exp", [s.results[0]], {})
    b.ret(e.results[0])
    vm = VM(f)
    assert vm._sync is None  # on the CPU every kernel has run when it returns
    waits = []
    vm._sync = lambda: (waits.append(1), time.sleep(2e-3))
    x = np.ones((8, 8), dtype=np.float32)
    _, st = vm.run("f", x, x)
    assert len(waits) == 1 + 3  # before the run, then after add, exp and the return
    assert [op for _, op, _ in st.instr_times][:2] == ["add", "exp"]
    assert all(sec >= 2e-3 for _, _, sec in st.instr_times)
    waits.clear()
    vm.run("f", x, x, record="peak")
    assert not waits
