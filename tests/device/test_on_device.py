"""Steps on an accelerator: a model on a CUDA device trains there, exactly and within its budget.

Skipped where torch sees no CUDA device (CI has none). ``REMAT_TEST_DEVICE`` names the device
(default ``cuda``); ``REMAT_TEST_DEVICE=cpu`` runs the same checks on the CPU. Each check: one SGD
step of a zoo or Hugging Face model on the device equals eager PyTorch's on the same device, the
parameters stay there, the VM's measured peak equals the predicted one within the budget, and the
device allocator's peak of the step is reported."""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

import remat
from remat import zoo

DEVICE = torch.device(os.environ.get("REMAT_TEST_DEVICE", "cuda"))
if DEVICE.type == "cuda" and DEVICE.index is None and torch.cuda.is_available():
    DEVICE = torch.device("cuda", torch.cuda.current_device())  # as tensors report it
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA device (REMAT_TEST_DEVICE=cpu runs these checks on the CPU)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
LR = 0.05


@pytest.fixture(autouse=True)
def _full_float32():
    """Float32 products and convolutions in full precision on both sides (cuDNN's default runs
    convolutions in TF32, whose rounding differs with the algorithm and layout each side picks)."""
    saved = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cudnn.allow_tf32 = saved[0]
    torch.set_float32_matmul_precision(saved[1])


def _to(inputs, device):
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    return tuple(t.to(device) for t in inputs)


def _eager_step(model, opt, inputs, loss_fn):
    opt.zero_grad(set_to_none=True)
    loss = model(**inputs).loss if isinstance(inputs, dict) else loss_fn(model(inputs[0]), *inputs[1:])
    loss.backward()
    opt.step()
    return loss.detach()


def _check_one_step(model, inputs, loss_fn, budget, rtol=1e-4, **options):
    model = model.to(DEVICE)
    inputs = _to(inputs, DEVICE)
    eager = copy.deepcopy(model)
    opt_e = torch.optim.SGD(eager.parameters(), lr=LR, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if isinstance(inputs, dict):
        step = remat.compile(model, inputs, optimizer=opt, budget=budget, **options)
        call = lambda: step(**inputs)  # noqa: E731
    else:
        step = remat.compile(model, inputs, loss_fn, optimizer=opt, budget=budget, **options)
        call = lambda: step(*inputs)  # noqa: E731
    assert step.device == (None if DEVICE.type == "cpu" else DEVICE)
    for _ in range(2):  # the second step reads the momentum buffers the first one made
        got, want = call(), _eager_step(eager, opt_e, inputs, loss_fn)
        assert got.device == DEVICE
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)
    for (n, a), b in zip(model.named_parameters(), eager.parameters()):
        assert a.device == DEVICE, n
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol, msg=lambda m: f"{n}: {m}")
    rep = step.report()
    assert rep.measured_peak == rep.predicted_peak
    if budget is not None:
        assert rep.predicted_peak <= rep.budget
        assert rep.measured_allocator_peak is not None and rep.measured_allocator_peak > 0
    return step


@pytest.mark.parametrize("name, budget", [("mlp", None), ("gpt", None), ("gpt", 0.85), ("resnet", None),
                                          ("resnet", 0.85), ("unet", None), ("unet", 0.85)])
def test_zoo_model_steps_on_the_device(name, budget):
    kw = {"dropout": 0.0} if name == "gpt" else {}
    model, inputs, loss_fn = zoo.make(name, "tiny", **kw)
    _check_one_step(model.train(), inputs, loss_fn, budget, count_workspaces=False)


def test_a_budget_counting_the_devices_kernel_workspaces_holds_on_its_allocator():
    model, inputs, loss_fn = zoo.make("gpt", "small", dropout=0.0)
    step = _check_one_step(model.train(), inputs, loss_fn, "50%")
    rep = step.report()
    # The device allocator rounds blocks up (CUDA: 512 bytes), which the VM's count of IR values does not.
    assert rep.measured_allocator_peak <= rep.budget * 1.02, (rep.measured_allocator_peak, rep.budget)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_hugging_face_model_steps_on_the_device(name):
    pytest.importorskip("transformers")
    from hf_zoo import MODELS

    model, inputs = next(m for m in MODELS if m.name == name).build()
    _check_one_step(model, inputs, None, 0.7, count_workspaces=False)


def test_bf16_on_the_device_matches_eager_autocast():
    model, (x, y), loss_fn = zoo.make("gpt", "tiny", dropout=0.0)
    model = model.to(DEVICE)
    x, y = x.to(DEVICE), y.to(DEVICE)
    eager = copy.deepcopy(model)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = loss_fn(eager(x), y)
    loss.backward()
    step = remat.compile(model, (x, y), loss_fn, precision="bf16")
    got = step(x, y)
    assert abs(float(got) - float(loss)) < 2e-2 * abs(float(loss))
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.dtype == torch.float32 and p.grad.device == DEVICE
        rel = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12))
        assert rel < 2e-2, (n, rel)


def test_a_batch_on_another_device_is_refused():
    if DEVICE.type == "cpu":
        pytest.skip("needs a device other than the CPU")
    model, (x, y), loss_fn = zoo.make("mlp", "tiny")
    model = model.to(DEVICE)
    step = remat.compile(model, (x.to(DEVICE), y.to(DEVICE)), loss_fn,
                         optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(TypeError, match=f"is on cpu, but the step runs on {DEVICE}"):
        step(x, y)


def test_a_cpu_model_on_a_machine_with_a_device_trains_on_the_cpu():
    model, inputs, loss_fn = zoo.make("gpt", "tiny", dropout=0.0)
    eager = copy.deepcopy(model)
    opt_e = torch.optim.SGD(eager.parameters(), lr=LR)
    step = remat.compile(model, inputs, loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=LR), budget=0.7,
                         count_workspaces=False)
    assert step.device is None
    got, want = step(*inputs), _eager_step(eager, opt_e, inputs, loss_fn)
    torch.testing.assert_close(got, want)
    for a, b in zip(model.parameters(), eager.parameters()):
        assert a.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_adamw_with_a_schedule_on_the_device():
    model, inputs, loss_fn = zoo.make("gpt", "tiny", dropout=0.0)
    model, inputs = model.to(DEVICE), _to(inputs, DEVICE)
    eager = copy.deepcopy(model)

    def setup(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / 3)

    opt, sched = setup(model)
    opt_e, sched_e = setup(eager)
    step = remat.compile(model, inputs, loss_fn, optimizer=opt, budget=0.85, count_workspaces=False)
    for _ in range(3):
        step(*inputs)
        sched.step()
        opt_e.zero_grad(set_to_none=True)
        loss_fn(eager(inputs[0]), inputs[1]).backward()
        opt_e.step()
        sched_e.step()
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
