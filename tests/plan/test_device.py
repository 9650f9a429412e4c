"""Device models (``remat.plan.device``): the table, user specs, the roofline the cost model prices
on, and plans that differ between devices."""
from __future__ import annotations

import pytest
import torch

import remat
from remat import zoo
from remat.ir import parse
from remat.plan.costmodel import instruction_cost, priced_on, static_costs
from remat.plan.device import CPU, DEVICES, DeviceSpec, device_spec
from remat.plan.frontier import forget_plans

MATMUL = """func @f(%0: bf16[512,1024], %1: bf16[1024,1024]) -> (bf16[512,1024]) {
  %2 = matmul %0, %1 : bf16[512,1024]
  %3 = relu %2 : bf16[512,1024]
  return %3
}
"""


def test_the_table_and_user_specs():
    assert {"cpu", "h100-80gb", "a100-80gb", "a100-40gb", "rtx4090-24gb", "l4-24gb"} <= set(DEVICES)
    assert device_spec("H100-80GB") is DEVICES["h100-80gb"]
    with pytest.raises(ValueError, match="built-in devices: cpu, h100-80gb"):
        device_spec("tpu-v9")
    mine = device_spec(dict(name="mine", memory_bytes="12GiB", matmul_flops={"bf16": 1e14}, vector_flops=1e13,
                            bandwidth=5e11))
    assert mine.memory_bytes == 12 * 1024**3 and mine.granularity == 512
    with pytest.raises(ValueError, match="missing: bandwidth"):
        device_spec(dict(name="x", memory_bytes=1, matmul_flops={}, vector_flops=1.0))


def test_roofline_prices_matmuls_at_the_tensor_core_rate():
    fn = parse(MATMUL)["f"]
    mm, relu = fn.entry.instrs[0], fn.entry.instrs[1]
    h100 = DEVICES["h100-80gb"]
    with priced_on(h100):
        t_mm, t_relu = instruction_cost(mm), instruction_cost(relu)
    flops = 2 * 512 * 1024 * 1024
    traffic = (512 * 1024 * 2 + 1024 * 1024 * 2 + 512 * 1024 * 2)
    assert t_mm == pytest.approx(max(flops / 989e12, traffic / 3.35e12) + h100.launch_seconds)
    assert t_relu == pytest.approx(512 * 1024 * 2 * 2 / 3.35e12 + h100.launch_seconds)  # memory-bound
    with priced_on(CPU):  # the nominal CPU is the default model
        on_cpu = static_costs(fn)
    assert on_cpu == static_costs(fn)
    assert on_cpu[mm] / on_cpu[relu] > t_mm / t_relu  # matmuls cost relatively more on the CPU


def _dry(name, budget, **options):
    forget_plans()
    with torch.device("meta"):
        model, ex, loss = zoo.make(name, "tiny")
    try:
        return remat.compile(model, ex, loss, optimizer=torch.optim.AdamW(model.parameters()), budget=budget,
                             dry_run=True, solver="greedy", count_workspaces=False, **options)
    finally:
        forget_plans()


def test_plans_differ_between_devices():
    cpu, h100 = _dry("resnet", "50%"), _dry("resnet", "50%", device="h100-80gb")
    assert str(cpu.program) != str(h100.program) or cpu.predicted_peak != h100.predicted_peak
    assert h100.report().device == "h100-80gb" and cpu.report().device is None
    same = _dry("resnet", "50%", device="cpu")
    assert same.predicted_peak == cpu.predicted_peak and same.report().predicted_overhead == cpu.report().predicted_overhead


def test_a_device_without_budget_plans_for_its_memory():
    tiny = DeviceSpec("tiny", 150_000, {}, 1e12, 1e11, granularity=4096)
    step = _dry("resnet", None, device=tiny)
    r = step.report()
    assert r.budget == 150_000 and r.predicted_peak <= 150_000
    assert r.device_peak >= r.predicted_peak and r.device == "tiny"
