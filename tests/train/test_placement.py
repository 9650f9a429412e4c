"""Where a step runs: on its model's device, never on a device chosen from what the machine has.
The checks that need no accelerator (tests/cuda runs steps on one)."""
from __future__ import annotations

import pytest
import torch

import remat
from remat import zoo
from remat.backends import torch_kernels
from remat.ir import DType, Function, Module, TensorType
from remat.ir.build import Builder
from remat.runtime.vm import VM, device_dialects


def test_the_torch_dialect_runs_on_the_cpu_unless_a_vm_says_otherwise():
    # A CPU model on a machine with a GPU stays on the CPU: the kernels' device is not chosen from
    # torch.cuda.is_available() (it was, and a CPU model's updates landed on device copies).
    assert torch_kernels.DEVICE == torch.device("cpu")
    model, (x, y), loss_fn = zoo.make("mlp", "tiny")
    step = remat.compile(model, (x, y), loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert step.device is None
    before = [p.detach().clone() for p in model.parameters()]
    step(x, y)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert torch_kernels.DEVICE == torch.device("cpu")


def test_tensors_on_two_devices_are_refused_naming_both():
    model, (x, y), loss_fn = zoo.make("mlp", "tiny")
    model.to("meta")
    with pytest.raises(ValueError, match=r"one device, but parameter '.*' is on meta and input 0 is on cpu"):
        remat.compile(model, (x, y), loss_fn)


def test_a_model_on_the_meta_device_is_planned_with_dry_run():
    model, (x, y), loss_fn = zoo.make("mlp", "tiny")
    model.to("meta")
    with pytest.raises(ValueError, match="meta device.*dry_run=True"):
        remat.compile(model, (x.to("meta"), y.to("meta")), loss_fn)


def _add_fn() -> Module:
    t = TensorType(DType.f32, (4,))
    f = Function("f", [t, t], [t])
    b = Builder(f.entry)
    b.ret(b.create("add", list(f.params), {}, result_types=[t]).results[0])
    return Module([f])


def test_off_the_cpu_only_the_torch_dialect_runs():
    meta = torch.device("meta")
    assert device_dialects(meta, None) == ("torch",)
    assert device_dialects(meta, ("torch",)) == ("torch",)
    assert device_dialects(None, ("numpy",)) == ("numpy",)
    with pytest.raises(ValueError, match="cannot run on meta: off the CPU only the torch dialect"):
        device_dialects(meta, ("numpy", "torch"))
    vm = VM(_add_fn(), device=meta)
    assert vm.dialects == ("torch",) and vm.device == meta
    assert VM(_add_fn(), device="cpu").device is None
