"""The data-parallel demo: ``torchrun --nproc_per_node 2 -m remat.demo_ddp`` (``make demo-ddp``;
``remat train --nproc 2`` is the command-line equivalent, for any zoo model).

Each rank trains the demo GPT on its half of every batch with ZeRO-2 (or ``--mode``) under a
per-rank budget, and rank 0 prints the per-rank memory report and the loss.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from .distributed import MODES


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="torchrun --nproc_per_node 2 -m remat.demo_ddp")
    ap.add_argument("--mode", default="zero2", choices=MODES)
    ap.add_argument("--budget", default="60%", help="per-rank budget (default: 60%% of a rank's unconstrained peak)")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    import remat
    from .data import CharCorpus
    from .demo import DEMO, build_gpt
    from .zoo import lm_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    try:
        corpus = CharCorpus()
        model = build_gpt(corpus.vocab_size, DEMO, seed=0)
        gen = torch.Generator().manual_seed(1)
        half = DEMO.batch // world
        batches = [corpus.batch(DEMO.batch, DEMO.seq_len, gen) for _ in range(args.steps)]
        mine = [tuple(t[rank * half:(rank + 1) * half] for t in b) for b in batches]  # views: the step counts its copy
        step = remat.compile(model, mine[0], lm_loss, optimizer=torch.optim.AdamW(model.parameters(), lr=6e-3),
                             budget=args.budget, data_parallel=args.mode)
        losses = []
        for k, b in enumerate(mine):
            loss = step(*b)
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses.append(float(avg) / world)
            assert step.last_stats.peak_bytes == step.predicted_peak <= step.budget
        if rank == 0:
            print(step.report())
            print(f"{world} ranks, {args.mode}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps; "
                  f"every rank's measured peak == predicted <= budget at every step")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
