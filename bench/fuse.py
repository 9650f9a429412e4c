"""Fusion on real programs: the final program of ``remat.compile`` before and after the ``fuse`` pass.

For each model: outputs bit-identical (torch.equal), predicted peak (fused) <= predicted (original)
== VM-measured, groups fused, instructions before/after, median step time of both on the VM
(alternating rounds), and kernel preparation seconds (cold in a fresh cache, warm in a second
process: run the script twice; the first line says whether anything was compiled).

    PYTHONPATH=src python bench/fuse.py [--models mlp,resnet,gpt,unet,gpt-medium] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import remat
from remat import zoo
from remat.backends import numba_kernels as nk
from remat.ir import Module
from remat.plan.simulator import predict_peak
from remat.lower.fuse import FuseStats, fuse
from remat.runtime.vm import VM


def measure(name: str, rounds: int) -> dict:
    size = "medium" if name == "gpt-medium" else "small"
    model, ex, loss_fn = zoo.make(name.split("-")[0], size)
    opt = None if size == "medium" else torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    step = remat.compile(model, ex, loss_fn, optimizer=opt)
    prog = step.program
    st = FuseStats()
    t0 = time.perf_counter()
    fused = fuse(prog, stats=st)
    fuse_s = time.perf_counter() - t0
    before = nk.compile_count()
    prep_s = nk.prepare(Module([fused]))
    compiled = nk.compile_count() - before
    vm_a, vm_b = VM(Module([prog.clone()])), VM(Module([fused]))
    p_a, p_b = predict_peak(prog), predict_peak(fused)
    ta, tb, ma, mb = [], [], [], []
    members = set(st.member_positions)
    for r in range(rounds + 1):
        oa, sa = vm_a.run(prog.name, *step.binding.step_args(ex, copy=True, step=1), outputs="torch")
        ob, sb = vm_b.run(fused.name, *step.binding.step_args(ex, copy=True, step=1), outputs="torch")
        assert all(torch.equal(x, y) for x, y in zip(oa, ob)), f"{name}: fused outputs differ"
        assert sa.peak_bytes == p_a and sb.peak_bytes == p_b, (name, sa.peak_bytes, p_a, sb.peak_bytes, p_b)
        if r:  # round 0 warms up
            ta.append(sa.total_seconds)
            tb.append(sb.total_seconds)
            ma.append(sum(s for i, _, s in sa.instr_times if i in members))
            mb.append(sum(s for _, n, s in sb.instr_times if n == "fused"))
    assert p_b <= p_a
    return {"model": name, "groups": st.groups, "fused_instructions": st.fused_instructions,
            "instructions_before": st.instructions_before, "instructions_after": st.instructions_after,
            "dropped_for_peak": st.dropped_for_peak, "peak_before": p_a, "peak_after": p_b,
            "step_ms_before": statistics.median(ta) * 1e3, "step_ms_after": statistics.median(tb) * 1e3,
            "ratio": statistics.median(tb) / statistics.median(ta), "members_ms_before": statistics.median(ma) * 1e3, "fused_ms_after": statistics.median(mb) * 1e3,
            "fuse_pass_s": fuse_s, "prepare_s": prep_s, "kernels_compiled": compiled}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,resnet,gpt,unet,gpt-medium")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    for name in a.models.split(","):
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in measure(name, a.rounds).items()}),
              flush=True)


if __name__ == "__main__":
    main()
