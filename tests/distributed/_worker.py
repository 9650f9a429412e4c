"""The code each gloo rank runs for tests/distributed (spawned by torch.multiprocessing)."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import remat
from remat.distributed.memory import predicted
from remat.ir.printer import print_function

WORLD, PER_RANK, STEPS = 2, 64, 5
MODES, BUDGETS, RESUMED = ("ddp", "zero1", "zero2"), (None, "70%"), ("ddp", "zero1", "zero2")


def model() -> torch.nn.Module:
    """Deep and narrow (activations dominate, so a budget below the unconstrained peak is feasible);
    a 15-wide layer gives parameters whose sizes do not divide by the world size (padded shards)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(7, 16)]
    for i in range(5):
        layers += [torch.nn.GELU(), torch.nn.Linear(16, 15 if i == 2 else 16) if i != 3 else torch.nn.Linear(15, 16)]
    layers += [torch.nn.GELU(), torch.nn.Linear(16, 3)]
    return torch.nn.Sequential(*layers).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(WORLD * PER_RANK, 7, generator=g, dtype=torch.float64),
             torch.randn(WORLD * PER_RANK, 3, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def reference() -> list[torch.Tensor]:
    """One process on the concatenated batches, eager PyTorch AdamW."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's rows: a view into the whole batch (the VM counts the step's copy of it, as predicted)."""
    return t[rank * PER_RANK:(rank + 1) * PER_RANK]


def compile_step(mode: str, budget, m: torch.nn.Module, on_nonfinite=None):
    x, y = batches()[0]
    return remat.compile(m, (_shard(x, 0), _shard(y, 0)), torch.nn.functional.mse_loss,
                         optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2), budget=budget, data_parallel=mode,
                         bucket_bytes=1500, dialects=("torch", "numpy"),  # no numba: no kernel compilation
                         on_nonfinite=on_nonfinite)


def _init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def _run(rank: int, mode: str, budget, out: str) -> None:
    """5 steps; saves params, peaks and the bytes by kind (measured, predicted) for the test to compare."""
    m = model()
    step = compile_step(mode, budget, m)
    peaks = []
    for x, y in batches():
        step(_shard(x, rank), _shard(y, rank))
        peaks.append(step.last_stats.peak_bytes)
    n_state = sum(len(ts) for ts in step.binding.state_types)
    first = step.binding.layout.n_args
    torch.save({"params": [p.detach().clone() for p in m.parameters()], "peaks": peaks,
                "predicted": step.predicted_peak, "budget": step.budget, "by_kind": step.kind_stats,
                "predicted_by_kind": predicted(step.program, step.binding.layout.n_params, range(first, first + n_state)),
                "state_bytes": sum(t.untyped_storage().nbytes() for ts in step.binding.state for t in ts),
                "arg_bytes": step.last_stats.argument_bytes, "report": str(step.report()),
                "allocator": (step.report().predicted_allocator_peak, step.report().measured_allocator_peak),
                "program": print_function(step.program), "notes": list(step.compilation.notes)},
               f"{out}/{mode}-{budget}-{rank}.pt")


def _nonfinite(rank: int, mode: str, out: str) -> None:
    """The 5 batches with a bad one after the second, NaN in rank 1's shard only: every rank skips it
    (the guard's flag is agreed by all ranks), so training ends as the reference's."""
    m = model()
    step = compile_step(mode, None, m, on_nonfinite="skip")
    data = batches()
    bad_x = data[0][0].clone()
    bad_x[PER_RANK + 3, 2] = float("nan")
    for i, (x, y) in enumerate(data):
        step(_shard(x, rank), _shard(y, rank))
        if i == 1:
            loss = step(_shard(bad_x, rank), _shard(data[0][1], rank))
    torch.save({"params": [p.detach().clone() for p in m.parameters()], "skipped": step.report().skipped_steps,
                "loss": float(loss)}, f"{out}/nonfinite-{mode}-{rank}.pt")


def _first_half(rank: int, mode: str, out: str) -> None:
    """3 steps, then this rank's checkpoint."""
    step = compile_step(mode, None, model())
    for x, y in batches()[:3]:
        step(_shard(x, rank), _shard(y, rank))
    torch.save(step.state_dict(), f"{out}/ckpt-{mode}-{rank}.pt")


def _refusals(rank: int, out: str) -> None:
    """Rank 0's refusal reaches every rank; budgets that differ between ranks are refused on all."""
    got = {}
    for name, budget in (("too small", "1%"), ("differ", 200_000 + 1000 * rank)):
        try:
            compile_step("ddp", budget, model())
            got[name] = None
        except Exception as e:
            got[name] = (type(e).__name__, str(e), getattr(e, "minimum", None))
    torch.save(got, f"{out}/refusals-{rank}.pt")


def _leave() -> None:
    """End a rank whose work is done and whose group is destroyed without C++ static destructors, as
    ``remat train --nproc`` ranks do (remat/cli.py): now and then a thread is still joinable at static
    destruction and the rank aborts ("terminate called without an active exception", SIGABRT), which
    fails every test of the module (2 of 8 full test runs on this 2-core machine)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train_all(rank: int, port: int, out: str) -> None:
    """Every mode with and without a budget, and the first half of the resumed runs (one process group)."""
    _init(rank, port)
    try:
        for mode in MODES:
            for budget in BUDGETS:
                _run(rank, mode, budget, out)
            if mode in RESUMED:
                _first_half(rank, mode, out)
            _nonfinite(rank, mode, out)
        _refusals(rank, out)
    finally:
        dist.destroy_process_group()
    _leave()


def resume_all(rank: int, port: int, out: str) -> None:
    """In a new process group: a fresh (differently initialised) model, the checkpoint, steps 4-5."""
    _init(rank, port)
    try:
        for mode in RESUMED:
            m = model()
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1.0)  # a different start: everything must come from the checkpoint
            step = compile_step(mode, None, m)
            step.load_state_dict(torch.load(f"{out}/ckpt-{mode}-{rank}.pt"))
            for x, y in batches()[3:]:
                step(_shard(x, rank), _shard(y, rank))
            torch.save([p.detach().clone() for p in m.parameters()], f"{out}/resumed-{mode}-{rank}.pt")
    finally:
        dist.destroy_process_group()
    _leave()


def diverge(rank: int, port: int, out: str) -> None:
    """Rank 1 alone puts the model in eval mode after a step: its step refuses (a data-parallel step
    runs as compiled) and the rank leaves; rank 0's next collective fails saying a rank left."""
    _init(rank, port)
    m = model()
    step = compile_step("zero2", None, m)
    x, y = batches()[0]
    step(_shard(x, rank), _shard(y, rank))
    if rank == 1:
        m.eval()
    try:
        step(_shard(x, rank), _shard(y, rank))
        got = None
    except Exception as e:  # noqa: BLE001  what each rank is told
        got = (type(e).__name__, str(e))
    torch.save(got, f"{out}/diverge-{rank}.pt")
    _leave()  # rank 1 leaves without tearing the group down in step with rank 0, as a failing rank does
