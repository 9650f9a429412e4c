"""Data parallelism on 2 gloo ranks (torch.multiprocessing spawn): the same training as one process
on the concatenated batch, per-rank budgets, ZeRO's savings, sharded checkpoints."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat
from tests.distributed import _worker as w

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args) -> None:
    mp.spawn(fn, args=(_port(), *args), nprocs=w.WORLD, join=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every mode, without and with a budget (2 ranks each), and the one-process reference."""
    out = tmp_path_factory.mktemp("dp")
    _spawn(w.train_all, str(out))
    _spawn(w.resume_all, str(out))  # new processes, a new process group
    results = {(m, b): [torch.load(out / f"{m}-{b}-{r}.pt", weights_only=False) for r in range(w.WORLD)]
               for m in w.MODES for b in w.BUDGETS}
    return results, w.reference(), out


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2"])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(runs, mode):
    _, ref, out = runs
    for r in range(w.WORLD):
        res = torch.load(out / f"nonfinite-{mode}-{r}.pt", weights_only=False)
        assert res["skipped"] == 1
        assert (res["loss"] != res["loss"]) == (r == 1)  # only rank 1's own loss is NaN
        for p, q in zip(res["params"], ref):
            assert torch.allclose(p, q, rtol=0, atol=1e-10), (p - q).abs().max()


@pytest.mark.parametrize("budget", [None, "70%"])
@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2"])
def test_same_training_as_one_process(runs, mode, budget):
    results, ref, _ = runs
    for res in results[mode, budget]:
        for p, q in zip(res["params"], ref):
            assert torch.allclose(p, q, rtol=0, atol=1e-10), (p - q).abs().max()
        # Per rank: measured peak == predicted <= budget, at every step (the batch is a view into
        # the whole batch: the step's copy of it is what is counted and predicted).
        assert res["peaks"] == [res["predicted"]] * w.STEPS
        # The VM's bytes by kind (measured on the first step) == the simulator's; the split adds up to the peak.
        pred = res["predicted_by_kind"]
        assert res["by_kind"] == pred
        assert sum(pred.at_peak.values()) == res["predicted"]
        if budget is not None:
            assert res["predicted"] <= res["budget"]
            assert "recomputed instructions" in res["report"] and "per rank" in res["report"]
            # PyTorch's allocator (measured on the first step) within the bound the plan kept to the
            # budget: the collectives' own buffers (gloo's reduce_scatter copies its whole input) counted.
            predicted_allocator, measured_allocator = res["allocator"]
            assert measured_allocator <= predicted_allocator <= res["budget"]


@pytest.mark.parametrize("budget", [None, "70%"])
def test_ddp_rank0_plans_and_every_rank_runs_its_program(runs, budget):
    """Under DDP rank 0 plans and the others receive its program as IR text (so a time-limited
    solver cannot make ranks diverge); every rank runs the same program. (ZeRO's programs differ
    by rank -- each slices its own shards -- and are planned per rank.)"""
    results, _, _ = runs
    r0, r1 = results["ddp", budget]
    assert r0["program"] == r1["program"]
    assert "planned on rank 0 and received as IR text" in r1["notes"]
    assert not any("received as IR text" in n for n in r0["notes"])
    for mode in ("zero1", "zero2"):
        z0, z1 = results[mode, budget]
        assert z0["program"] != z1["program"] and not any("received as IR text" in n for n in z1["notes"])


def test_refusals_reach_every_rank(runs):
    _, _, out = runs
    got = [torch.load(out / f"refusals-{r}.pt", weights_only=False) for r in range(w.WORLD)]
    # Rank 0's BudgetTooSmall, raised on every rank with its minimum.
    assert got[0]["too small"][0] == got[1]["too small"][0] == "BudgetTooSmall"
    assert got[0]["too small"][1:] == got[1]["too small"][1:] and got[0]["too small"][2] > 0
    # Budgets that differ between ranks: a clear error on every rank, naming both.
    for g in got:
        assert g["differ"][0] == "ValueError" and "same budget" in g["differ"][1]
        assert "200000" in g["differ"][1] and "201000" in g["differ"][1]


@pytest.mark.parametrize("budget", [None, "70%"])
def test_zero_shards_state_and_gradients(runs, budget):
    """Measured by the VM on every rank: ZeRO-1 halves the optimizer state, ZeRO-2 the gradients too."""
    results, _, _ = runs
    for r in range(w.WORLD):
        ddp, z1, z2 = (results[m, budget][r]["by_kind"] for m in ("ddp", "zero1", "zero2"))
        full = results["ddp", budget][r]["state_bytes"]
        # The state is an argument of the step: live from start to end, so at the peak too.
        assert ddp.at_peak["optimizer state"] == ddp.peaks["optimizer state"] == full
        # Shards are ceil(numel / world): the padding is at most one element (8 bytes) per tensor.
        n_tensors = 2 * 14
        for z in (z1, z2):
            assert full / 2 <= z.at_peak["optimizer state"] == z.peaks["optimizer state"] <= full / 2 + 8 * n_tensors
        # Reduced gradients: all of them under ddp and zero1 (which also slices out its shards),
        # this rank's shards under zero2.
        g = {m: k.allocated["reduced gradients"] for m, k in (("ddp", ddp), ("zero1", z1), ("zero2", z2))}
        assert g["ddp"] == sum(p.numel() * 8 for p in w.model().parameters()) <= g["zero1"]
        assert g["ddp"] / 2 <= g["zero2"] <= g["ddp"] / 2 + 8 * 14
        # ... and held at a time: each bucket's half under zero2.
        assert z2.peaks["reduced gradients"] <= ddp.peaks["reduced gradients"] / 2 + 8 * 14


@pytest.mark.parametrize("mode", w.RESUMED)
def test_resume_from_sharded_checkpoint(runs, mode):
    """Stopped after step 3, resumed in a new process group: steps 4-5 give the uninterrupted result."""
    results, _, out = runs
    for r in range(w.WORLD):
        got = torch.load(out / f"resumed-{mode}-{r}.pt")
        for p, q in zip(got, results[mode, None][r]["params"]):
            assert torch.equal(p, q)
    sds = [torch.load(out / f"ckpt-{mode}-{r}.pt", weights_only=False) for r in range(w.WORLD)]
    assert [s["rank"] for s in sds] == [0, 1] and all(s["steps"] == 3 for s in sds)
    if mode != "ddp":
        from remat.distributed.checkpoint import reassemble

        full = reassemble(sds)
        assert full["6.weight"]["exp_avg"].shape == (15, 16)
        assert sds[0]["shards"]["6.weight"] == {"numel": 240, "size": 120, "offset": 0, "shape": [15, 16]}


def test_a_change_on_one_rank_is_refused_there_and_named_on_its_peers(tmp_path):
    _spawn(w.diverge, str(tmp_path))
    refused, peer = (torch.load(tmp_path / f"diverge-{r}.pt", weights_only=False) for r in (1, 0))
    assert refused[0] == "TypeError" and "model.eval() was called" in refused[1]
    assert peer[0] == "RuntimeError" and "rank 0 of 2: the collective" in peer[1] and "another rank" in peer[1]


def test_errors_outside_a_process_group_and_for_unknown_modes():
    m = w.model()
    x, y = torch.zeros(4, 7, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)
    opt = torch.optim.AdamW(m.parameters())
    with pytest.raises(ValueError, match="'ddp', 'zero1', 'zero2'"):
        remat.compile(m, (x, y), torch.nn.functional.mse_loss, optimizer=opt, data_parallel="zero3")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed.init_process_group"):
            remat.compile(m, (x, y), torch.nn.functional.mse_loss, optimizer=opt, data_parallel="ddp")
