"""The thesis's PyTorch API (Listing 3.2/3.3), executed for real on remat's IR and VM.

    chk = remat.plan.chain.SequentialCheckpointer(sequence)           # nn.Sequential or list of modules
    chk.profile_sequence(dummy_input, dummy_upstream_grad)
    policy = chk.solve_optimal_policy(memory_budget)              # bytes
    downstream_grad = chk.backprop_sequence(policy, x, upstream_grad)

The budget bounds the whole backprop run as the VM measures it: parameters, the input, the
upstream gradient, every activation, recomputation and gradient. ``policy.peak`` is the exact
predicted peak of the compiled program; ``chk.last_run`` holds the measured peak and time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .costs import ChainCosts
from .executor import ChainStage, make_stage
from ..record import Plan
from .planner import ChainPlanner
from .profile import StageProfile, chain_costs, profile_stages
from ...budget import parse_budget


@dataclass
class RunRecord:
    """What the last ``backprop_sequence`` measured."""

    peak_bytes: int
    seconds: float
    predicted_peak: int
    stats: object = field(repr=False, default=None)


class SequentialCheckpointer:
    """Profile a sequence of modules, solve for the optimal checkpointing policy under a byte
    budget, and run the backward pass according to it."""

    def __init__(self, sequence, dialects: Sequence[str] | None = None):
        import torch

        mods = list(sequence.children()) if isinstance(sequence, torch.nn.Sequential) else list(sequence)
        if not mods:
            raise ValueError("SequentialCheckpointer needs at least one module")
        for k, m in enumerate(mods):
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"element {k} of the sequence is {type(m).__name__}, not a torch.nn.Module")
        self.modules = mods
        self.dialects = tuple(dialects) if dialects else None
        self.stages: list[ChainStage] | None = None
        self.profiles: list[StageProfile] | None = None
        self.last_run: RunRecord | None = None
        self._params: list[list] = []
        self._planners: dict = {}

    # ------------------------------------------------------------------ capture + profile
    def _capture(self, dummy_input) -> None:
        """Import every module (identical layers share one import: the IR does not depend on
        parameter values) and derive its forward/backward stage."""
        import torch

        from ...frontend.torch_import import import_module

        stages, params, live = [], [], []
        cache: dict = {}
        x = dummy_input
        for k, m in enumerate(self.modules):
            named = dict(m.named_parameters())
            key = (type(m), repr(m), m.training, tuple(x.shape), x.dtype,
                   tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in named.items()),
                   tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))
            if key in cache:
                imp, stage = cache[key]
            else:
                imp = import_module(m, (x,), train=None)
                if len(imp.output_names) > 1 or imp.has_seed:
                    what = ", ".join(imp.output_names[1:]) or "dropout"
                    raise ValueError(f"module {k} ({type(m).__name__}) updates buffers or draws random numbers "
                                     f"({what}); SequentialCheckpointer supports layers whose forward is a pure "
                                     "function of parameters and input (buffers that are only read are fine) — use "
                                     "remat.compile for models with training-mode batch norm or dropout")
                stage = make_stage(f"stage_{type(m).__name__}", imp.function, imp.state_count,
                                   tuple(range(len(imp.param_names))))
                if not imp.constant_names:
                    cache[key] = (imp, stage)
            stages.append(stage)
            # Constants are only lifted from the imported module itself (never shared via the cache).
            buffers = dict(m.named_buffers())
            params.append(list(imp.param_tensors()) if imp.constant_names
                          else [named[n].detach() for n in imp.param_names + imp.frozen_names] +
                          [buffers[n].detach() for n in imp.buffer_names])
            live.append([named[n] for n in imp.param_names])
            with torch.no_grad():
                x = m(x)
        self.stages, self._params, self._params_live = stages, params, live

    def profile_sequence(self, dummy_input, dummy_upstream_grad, repeats: int = 5) -> list[StageProfile]:
        """Import every module, derive its forward/backward, and measure per-stage costs."""
        self._capture(dummy_input)
        self._shapes = (tuple(dummy_input.shape), tuple(dummy_upstream_grad.shape))
        self.profiles = profile_stages(self.stages, self._detached_params(), dummy_input.detach(),
                                       dummy_upstream_grad.detach(), repeats=repeats, dialects=self.dialects)
        self._planners.clear()
        return self.profiles

    def _detached_params(self) -> list[list]:
        return [[p.detach() for p in ps] for ps in self._params]

    def baseline_bytes(self) -> int:
        """Bytes outside the chain model: parameters, their gradients, input and upstream gradient."""
        st = self.stages
        params = sum(t.nbytes for s in st for t in s.param_types)
        grads = sum(t.nbytes for s in st for t in s.grad_types)
        return params + grads + st[0].input_type.nbytes + st[-1].output_type.nbytes

    # ------------------------------------------------------------------ solve
    def costs(self, profile_comp: bool = True, profile_mem: bool = True, compute_costs: dict | None = None,
              memory_costs: dict | None = None) -> ChainCosts:
        if self.profiles is None:
            raise RuntimeError("call profile_sequence(dummy_input, dummy_upstream_grad) first")
        comp = "given" if compute_costs else ("profiled" if profile_comp else "uniform")
        mem = "given" if memory_costs else ("profiled" if profile_mem else "uniform")
        return chain_costs(self.profiles, comp, mem, compute_costs, memory_costs)

    def solve_optimal_policy(self, memory_budget, method: str = "extended", profile_comp: bool = True,
                             profile_mem: bool = True, compute_costs: dict | None = None,
                             memory_costs: dict | None = None, bucket=None) -> Plan:
        """Solve for the least-compute policy whose compiled program peaks within ``memory_budget``
        bytes (profiles are reused across budgets). ``method``: "extended" (default), "precise"
        (the thesis DP), or the baselines "uniform", "sqrt", "none". ``bucket``: bytes per memory
        unit (default: about 4,000 units over the no-recompute peak; "exact" removes bucketing).
        Listing 3.3's switches pick uniform or given costs. Raises ``BudgetTooSmall`` carrying
        the minimum feasible budget (the exact peak of the most frugal plan)."""
        budget = parse_budget(memory_budget)
        costs = self.costs(profile_comp, profile_mem, compute_costs, memory_costs)
        key = (profile_comp, profile_mem, repr(compute_costs), repr(memory_costs))
        if key not in self._planners:
            self._planners[key] = ChainPlanner(self.stages, costs, name="backprop_sequence",
                                               what=f"this {len(self.stages)}-stage sequence")
        return self._planners[key].solve(budget, method, bucket, baseline=self.baseline_bytes())

    # ------------------------------------------------------------------ execute
    def backprop_sequence(self, policy: Plan, x, upstream_grad):
        """Run forward and backward by the policy; accumulate parameter ``.grad``s like autograd
        and return the gradient wrt ``x``."""
        import torch

        from ...runtime.vm import run

        if self.stages is None:
            raise RuntimeError("call profile_sequence(dummy_input, dummy_upstream_grad) first")
        if tuple(x.shape) != self._shapes[0] or tuple(upstream_grad.shape) != self._shapes[1]:
            raise ValueError(f"backprop_sequence was profiled for input {list(self._shapes[0])} and upstream "
                             f"gradient {list(self._shapes[1])}, got {list(x.shape)} and {list(upstream_grad.shape)}")
        fn = policy.program
        flat = [p for ps in self._detached_params() for p in ps]
        t0 = time.perf_counter()
        outs, stats = run(fn, *flat, x.detach(), upstream_grad.detach(), dialects=self.dialects)
        dt = time.perf_counter() - t0
        self.last_run = RunRecord(stats.peak_bytes, dt, policy.peak, stats)
        gx, grads = outs[0], outs[1:]
        trainable = [ps[j] for ps, st in zip(self._params_live, self.stages) for j in st.grad_params]
        with torch.no_grad():
            for p, g in zip(trainable, grads):
                g = torch.as_tensor(np.asarray(g)).to(p.dtype)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad += g
        return torch.as_tensor(np.asarray(gx))
