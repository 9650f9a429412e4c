"""The thesis's API (Listings 3.2/3.3) on an nn.Sequential: profile, solve for several budgets,
and run the backward by each policy, measuring its peak.

    python examples/sequential_checkpointer.py
"""
from __future__ import annotations

import torch

import remat
from remat.plan.chain import SequentialCheckpointer


def main() -> None:
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    seq = torch.nn.Sequential(*layers)
    x, gy = torch.randn(512, 64), torch.randn(512, 64)

    chk = SequentialCheckpointer(seq)
    chk.profile_sequence(x, gy)
    full = chk.solve_optimal_policy(10**12)
    try:
        chk.solve_optimal_policy(1)
    except remat.BudgetTooSmall as e:
        minimum = e.minimum
    print(f"store-everything peak {full.peak:,} B; minimum feasible budget {minimum:,} B")
    for frac in (1.0, 0.75, 0.5):
        budget = max(minimum, int(full.peak * frac))
        for method in ("extended", "precise"):
            policy = chk.solve_optimal_policy(budget, method=method)
            seq.zero_grad(set_to_none=True)
            chk.backprop_sequence(policy, x, gy)
            print(f"budget {budget:>10,} B  {method:<8}  predicted {policy.peak:>10,} B  "
                  f"measured {chk.last_run.peak_bytes:>10,} B  predicted overhead {policy.overhead:+.1%}")


if __name__ == "__main__":
    main()
