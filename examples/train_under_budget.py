"""Train a zoo model with remat.compile under a memory budget and compare with PyTorch eager.

    python examples/train_under_budget.py --model unet --budget 50%
"""
from __future__ import annotations

import argparse
import copy

import torch

import remat
from remat import zoo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="unet", choices=sorted(zoo.MODELS))
    ap.add_argument("--size", default="small", choices=zoo.SIZES)
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)

    model, example, loss_fn = zoo.make(args.model, args.size)
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=1e-3, momentum=0.9)
    try:
        step = remat.compile(model, example, loss_fn, optimizer=opt, budget=args.budget)
    except remat.BudgetTooSmall as e:
        print(f"{e}\n(try --budget {e.minimum})")
        return
    for i in range(args.steps):
        loss = step(*example)
        eager_opt.zero_grad()
        ref = loss_fn(eager(*example[:-1]), example[-1])
        ref.backward()
        eager_opt.step()
        print(f"step {i + 1}: remat loss {loss.item():.6f}   eager loss {ref.item():.6f}")
    print(step.report())


if __name__ == "__main__":
    main()
