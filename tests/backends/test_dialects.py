"""Dialect selection: priorities, checkers, enable/disable/only, explicit lists, errors, printing."""
from __future__ import annotations

import numpy as np
import pytest

import remat
from remat import backends
from remat.ir import Builder, DType, Function, Module, TensorType, parse, verify

F32 = TensorType(DType.f32, (2, 3))
I32 = TensorType(DType.i32, (2, 2))


@pytest.fixture(autouse=True)
def _restore_dialects():
    backends.reset()
    yield
    backends.reset()


def module_add_matmul() -> Module:
    f = Function("f", [F32, I32], [F32, I32])
    b = Builder(f.entry)
    x, n = f.params
    y = b.op("exp", x)
    m = b.op("matmul", n, n)  # integer matmul: torch's checker refuses it
    b.ret(y, m)
    return Module([f])


def dialect_of(m: Module, op: str) -> str:
    return next(i.dialect for i in m["f"].instructions() if i.op.name == op)


def test_remat_dialects_is_the_backends_module():
    assert remat.dialects is backends
    assert backends.enabled() == ("numba", "torch", "numpy")


def test_torch_has_priority_and_checkers_fall_back_to_numpy():
    m = backends.assign_dialects(module_add_matmul())
    assert dialect_of(m, "exp") == "torch"
    assert dialect_of(m, "matmul") == "numpy"  # refused by torch's checker
    assert dialect_of(m, "return") is None


def test_assign_returns_a_copy():
    src = module_add_matmul()
    backends.assign_dialects(src)
    assert all(i.dialect is None for i in src["f"].instructions())


def test_printed_dialects_round_trip():
    m = backends.assign_dialects(module_add_matmul())
    text = str(m)
    assert "torch.exp" in text and "numpy.matmul" in text
    assert str(parse(text)) == text
    verify(parse(text))


def test_only_context_manager_and_restoration():
    with remat.dialects.only("numpy"):
        assert backends.enabled() == ("numpy",)
        m = backends.assign_dialects(module_add_matmul())
        assert dialect_of(m, "exp") == "numpy"
    assert backends.enabled() == ("numba", "torch", "numpy")


def test_disable_and_enable():
    remat.dialects.disable("torch")
    assert dialect_of(backends.assign_dialects(module_add_matmul()), "exp") == "numpy"
    remat.dialects.enable("torch")
    assert dialect_of(backends.assign_dialects(module_add_matmul()), "exp") == "torch"


def test_explicit_list_wins_over_global_setting():
    remat.dialects.disable("torch")
    m = backends.assign_dialects(module_add_matmul(), enabled=("torch", "numpy"))
    assert dialect_of(m, "exp") == "torch"
    assert dialect_of(backends.assign_dialects(module_add_matmul(), enabled="numpy"), "exp") == "numpy"


def test_no_enabled_dialect_error_names_op_and_dialects():
    with pytest.raises(backends.NoKernelError) as e:
        backends.assign_dialects(module_add_matmul(), enabled=("torch",))
    msg = str(e.value)
    assert "'matmul'" in msg and "i32[2,2]" in msg
    assert "enabled dialects: torch" in msg and "with a 'matmul' kernel: numpy, torch" in msg


def test_no_dialect_enabled_at_all():
    with remat.dialects.only():
        with pytest.raises(backends.NoKernelError, match="enabled dialects: none"):
            backends.assign_dialects(module_add_matmul())


def test_unknown_dialect_is_rejected_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown dialect 'cuda'.*numpy, torch"):
        remat.dialects.enable("cuda")
    with pytest.raises(ValueError, match="unknown dialect"):
        backends.assign_dialects(module_add_matmul(), enabled=("jax",))


def test_vm_respects_dialect_choice_and_results_agree():
    m = module_add_matmul()
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    n = np.arange(4, dtype=np.int32).reshape(2, 2)
    (y1, m1), _ = remat.run(m["f"], x, n, dialects="numpy")
    (y2, m2), _ = remat.run(m["f"], x, n)
    np.testing.assert_allclose(y1, y2, rtol=1e-6)
    np.testing.assert_array_equal(m1, n @ n)
    np.testing.assert_array_equal(m2, n @ n)
    vm = remat.VM(m, dialects=("numpy",))
    assert {i.dialect for i in vm.function("f").instructions()} == {"numpy", None}


def test_preassigned_disabled_dialect_is_reassigned_by_the_vm():
    m = backends.assign_dialects(module_add_matmul())  # exp is torch.exp
    vm = remat.VM(m, dialects="numpy")
    assert dialect_of(vm.module, "exp") == "numpy"
