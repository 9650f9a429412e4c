"""``remat.compile``: a vanilla PyTorch model, a loss and an optimizer in; a training step whose
measured peak memory stays within a byte budget out (RAF's 2–3 line change).

    step = remat.compile(model, (x, y), loss_fn, optimizer=torch.optim.AdamW(model.parameters()),
                         budget="1.5GiB")
    for x, y in loader:
        loss = step(x, y)
    print(step.report())
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..budget import parse_budget
from ..errors import BudgetTooSmall, format_bytes
from ..ir import Function, Module
from .optim import advance_steps, bind_state, init_state, steps_taken, updates_from_torch
from ..plan.costmodel import function_cost, static_costs
from .program import Layout, step_program, training_joint


@dataclass
class Report:
    """What a compiled step planned and measured. Bytes and seconds."""

    budget: int | None
    predicted_peak: int
    measured_peak: int | None
    unconstrained_peak: int
    overhead: float | None           # measured: last step time / profiled unconstrained fwd+bwd time - 1
    predicted_overhead: float         # from profiled costs: recompute time / unconstrained compute time
    solver: str
    solver_notes: list[str] = field(default_factory=list)
    plan_seconds: float = 0.0
    setup_seconds: float = 0.0
    step_seconds: float | None = None
    unconstrained_step_seconds: float | None = None
    instructions: int = 0
    recomputed_instructions: int = 0

    def __str__(self) -> str:
        def b(v):
            return "-" if v is None else f"{format_bytes(v)} ({v:,} B)"

        rows = [
            ("budget", b(self.budget)),
            ("predicted peak", b(self.predicted_peak)),
            ("measured peak (last step)", b(self.measured_peak)),
            ("unconstrained peak", b(self.unconstrained_peak)),
            ("peak / unconstrained", f"{self.predicted_peak / self.unconstrained_peak:.1%}"),
            ("solver", self.solver),
            ("recomputed instructions", f"{self.recomputed_instructions} of {self.instructions}"),
            ("predicted recompute overhead", f"{self.predicted_overhead:+.1%}"),
            ("measured step overhead", "-" if self.overhead is None else f"{self.overhead:+.1%}"),
            ("step time (last)", "-" if self.step_seconds is None else f"{self.step_seconds * 1e3:.1f} ms"),
            ("unconstrained fwd+bwd time (profiled)", "-" if self.unconstrained_step_seconds is None
             else f"{self.unconstrained_step_seconds * 1e3:.1f} ms"),
            ("plan time", f"{self.plan_seconds:.2f} s (setup {self.setup_seconds:.2f} s)"),
        ]
        w = max(len(k) for k, _ in rows)
        lines = ["remat training step", "-" * (w + 40)] + [f"{k:<{w}}  {v}" for k, v in rows]
        lines += [f"  note: {n}" for n in self.solver_notes]
        return "\n".join(lines)


def _median_instr_costs(vm, fn: Function, args: list, repeats: int) -> tuple[dict, float]:
    """Per-instruction median seconds of ``fn`` on the VM, and the fastest total."""
    per: list[list[float]] = [[] for _ in fn.entry.instrs]
    totals = []
    for _ in range(repeats):
        _, st = vm.run(fn.name, *args)
        totals.append(st.total_seconds)
        for idx, _op, sec in st.instr_times:
            if idx < len(per):
                per[idx].append(sec)
    # The step time is the fastest run: the first one pays one-time costs (kernel warm-up).
    return ({ins: statistics.median(ts) for ins, ts in zip(fn.entry.instrs, per) if ts}, min(totals))


class TrainStep:
    """A compiled training step. Call it with the inputs and targets; it runs forward, backward
    and the optimizer update on the model's own tensors and returns the loss."""

    def __init__(self, model, example_inputs: Sequence, loss_fn: Callable | None, optimizer=None, budget=None, *,
                 num_targets: int | None = None, solver: str = "auto", dialects: Sequence[str] | None = None,
                 seed: int = 0, keep_grads: bool | None = None, profile_repeats: int = 2,
                 cost_model: str = "static",
                 milp_time_limit: float = 10.0, progress: Callable[[str], None] | None = None):
        import torch

        from ..frontend.torch_import import import_module
        from ..runtime.vm import VM

        t_setup = time.perf_counter()
        # Reject bad options before the (seconds-long) capture.
        if budget is not None:
            parse_budget(budget, reference=1)  # fractions resolve later, against the unconstrained peak
        if cost_model not in ("static", "profiled"):
            raise ValueError(f"cost_model must be 'static' (deterministic estimates) or 'profiled' (measured), got {cost_model!r}")
        if solver not in ("auto", "greedy", "milp"):
            raise ValueError(f"unknown solver {solver!r}; valid: auto, greedy, milp")
        say = progress or (lambda msg: None)
        self.model, self.optimizer = model, optimizer
        self.dialects = tuple(dialects) if dialects else None
        self.keep_grads = (optimizer is None) if keep_grads is None else keep_grads
        example_inputs = tuple(example_inputs)
        self._example = example_inputs
        say("capturing the model")
        self.imported = imp = import_module(model, example_inputs, loss_fn, train=model.training, num_targets=num_targets)
        self._example_types = [(tuple(t.shape), t.dtype) for t in example_inputs]
        n_params = len(imp.param_names)
        named = dict(model.named_parameters())
        self._params = [named[n] for n in imp.param_names]
        named_b = dict(model.named_buffers())
        self._buffers_out = [named_b[n.split(":", 1)[-1]] for n in imp.output_names[1:]] if len(imp.output_names) > 1 else []
        self.layout = Layout(n_params, imp.state_count, imp.input_count, imp.has_seed, len(imp.output_names) - 1)
        say("generating the training graph")
        joint = training_joint(imp.function, n_params)
        self.updates = updates_from_torch(optimizer, self._params) if optimizer is not None else None
        self._state = init_state(optimizer, self._params, self.updates) if self.updates else []
        if self.updates:
            steps_taken(optimizer, self._params, self.updates)  # parameters stepped unequally: fail now
        state_types = [[self._ttype(t) for t in ts] for ts in self._state]
        self._state_types = state_types
        self._step = 0
        self._seed = seed

        # Profile the unconstrained joint on copies (the model is not touched).
        say("profiling")
        args = self._joint_args(example_inputs, copy=True)
        self.cost_model = cost_model
        vm = VM(Module([joint]), dialects=self.dialects)
        measured, self._profile_seconds = _median_instr_costs(vm, joint, args, profile_repeats)
        self.costs = measured if cost_model == "profiled" else static_costs(joint)
        unconstrained = step_program(joint, self.layout, self.updates, state_types, self.keep_grads)
        from ..plan.liveness import predict_peak

        self.unconstrained_peak = predict_peak(unconstrained)
        self.budget = None if budget is None else parse_budget(budget, reference=self.unconstrained_peak)
        t_plan = time.perf_counter()
        say("planning")
        self.solver, self.notes, self.program, self._joint_plan = self._plan(joint, unconstrained, solver, milp_time_limit)
        self.plan_seconds = time.perf_counter() - t_plan
        self.predicted_peak = predict_peak(self.program)
        self.predicted_overhead = self._predicted_overhead
        self._vm = VM(Module([self.program]), dialects=self.dialects)
        self.unconstrained_step_seconds = self._profile_seconds
        self.instructions = sum(1 for i in self.program.entry.instrs if i.op.name not in ("free", "return"))
        self.recomputed = self.instructions - sum(1 for i in unconstrained.entry.instrs if i.op.name not in ("free", "return"))
        self.setup_seconds = time.perf_counter() - t_setup
        self.last_stats = None
        self.last_seconds = None
        self.torch = torch

    # ------------------------------------------------------------------ planning
    def _plan(self, joint: Function, unconstrained: Function, solver: str, time_limit: float):
        from ..plan.liveness import predict_peak
        from ..plan.rematerialize import from_schedule, to_graph

        if self.budget is None or self.unconstrained_peak <= self.budget:
            why = ("no budget given" if self.budget is None else
                   f"the unconstrained step ({format_bytes(self.unconstrained_peak)}) fits the budget")
            self._predicted_overhead = 0.0
            return "none", [why + ": no recomputation"], unconstrained, None
        from ..plan.graph import BudgetTooSmall as GraphTooSmall
        from ..plan.greedy import solve_greedy
        from ..plan.milp import solve_milp, solve_with_fallback
        from ..plan.scheduling import memory_aware_order

        low = to_graph(joint, self.costs)
        extra_bytes = sum(t.nbytes for ts in self._state_types for t in ts) + (8 if self.updates else 0)
        order = memory_aware_order(low.graph)
        n_nodes = len(low.graph.compute_nodes)

        milp_runs = [0]

        def solve_graph(m: int):
            # The MILP (optimal, seconds) runs once, at the main probe; the other probes are greedy.
            use_milp = solver == "milp" or (solver == "auto" and n_nodes <= 150)
            if use_milp and milp_runs[0] == 0 and m == max(self.budget - extra_bytes, 1):
                milp_runs[0] += 1
                if solver == "milp":
                    return solve_milp(low.graph, m, time_limit=time_limit, order=order)
                return solve_with_fallback(low.graph, m, time_limit=time_limit, order=order)
            return solve_greedy(low.graph, m, order=order)

        def lower(plan):
            j2 = from_schedule(low, plan.schedule, check=False)
            prog = step_program(j2, self.layout, self.updates, self._state_types, self.keep_grads, check=False)
            return plan, prog, predict_peak(prog)

        # The chain DP over blocks cut at separators is the main planner; instruction-level
        # solvers run when there is no useful cut, or when the graph is small enough for the MILP.
        candidates, minimums = [], []
        chain = self._plan_blocks(joint)
        if chain is not None:
            kind, val = chain
            (candidates if kind == "ok" else minimums).append(val)
        if chain is None or chain[0] != "ok" or n_nodes <= 150:
            try:
                candidates.append(self._plan_graph(low, order, n_nodes, solve_graph, lower, joint,
                                                   need_minimum=chain is None or chain[0] != "ok"))
            except BudgetTooSmall as e:
                minimums.append(e.minimum)
            except _NoPlan:
                pass
        if not candidates:
            raise BudgetTooSmall(self.budget, min(minimums), "this training step")
        best = min(candidates, key=lambda c: c[4])
        solver_name, notes, prog, plan_obj, self._predicted_overhead = best
        for c in candidates:
            if c is not best:
                notes = notes + [f"also tried {c[0]}: predicted overhead {c[4]:+.1%}"]
        from ..ir import verify
        verify(Module([prog]))
        return solver_name, notes, prog, plan_obj

    def _plan_graph(self, low, order, n_nodes, solve_graph, lower, joint, need_minimum: bool = True,
                    max_overhead: float = 2.0):
        """Instruction-level rematerialisation (MILP / RAF greedy) of the joint."""
        from ..plan.greedy import greedy_min_budget
        from ..plan.graph import BudgetTooSmall as GraphTooSmall
        from ..plan.liveness import predict_peak

        # The graph model keeps every gradient to the end and leaves out the optimizer state; the
        # step program adds the state and consumes gradients early, so a plan peaking at
        # ``budget - state`` in the model fits. Heuristic plans are not monotone in the budget, so
        # a portfolio of model budgets around that point is solved and the cheapest plan whose
        # exact program peak fits is kept.
        extra = sum(t.nbytes for ts in self._state_types for t in ts) + (8 if self.updates else 0)
        hi = predict_peak(joint)
        start = self.budget - extra
        probes = sorted({int(start * f) for f in (0.88, 0.92, 0.96, 1.0)} |
                        {int(start + (hi - start) * f) for f in (0.1, 0.25, 0.5)})
        plans = []
        for m in probes:
            if m <= 0:
                continue
            try:
                plans.append(solve_graph(m))
            except GraphTooSmall:
                continue
        best = None
        for plan in sorted(plans, key=lambda p: p.cost):
            if (plan.overhead or 0.0) > max_overhead:
                break  # runaway recomputation: not worth lowering
            cand = lower(plan)
            if cand[2] <= self.budget:
                best = cand
                break
        if best is None:
            if not need_minimum:  # the chain DP found a plan; its minimum is not needed
                raise _NoPlan()
            m = greedy_min_budget(low.graph, order, rel_tol=0.02, max_steps=20 * len(low.graph) + 1000)
            cand = lower(solve_graph(m))
            if cand[2] > self.budget:
                raise BudgetTooSmall(self.budget, cand[2], "this training step")
            best = cand
        plan, prog, peak = best
        notes = [f"instruction-level plan over {n_nodes} nodes after memory-aware scheduling"] + list(plan.notes)
        return f"{plan.solver} ({plan.status})", notes, prog, plan, plan.overhead or 0.0

    def _plan_blocks(self, joint):
        """Chain of blocks cut at the forward's separators, planned by the chain DP (extended model).

        Two cuts are planned, coarse (only where the backward keeps the value anyway) and fine
        (every separator); the cheaper feasible plan wins. Returns None without a useful cut,
        ("min", bytes) when no plan fits, else ("ok", candidate)."""
        results = [r for r in (self._plan_cut(True), self._plan_cut(False)) if r is not None]
        if not results:
            return None
        ok = [r[1] for r in results if r[0] == "ok"]
        if ok:
            return ("ok", min(ok, key=lambda c: c[4]))
        return ("min", min(r[1] for r in results))

    def _plan_cut(self, coarse: bool):
        from ..chain.planner import ChainPlanner
        from ..chain.profile import chain_costs, profile_stages
        from ..plan.blocks import cut

        imp = self.imported
        t0 = time.perf_counter()
        blocks = cut(imp.function, imp.state_count, len(imp.param_names), backward_kept_only=coarse)
        if blocks is None:
            return None
        args = self._joint_args(self._example, copy=True)
        lead_args = [[args[i] for i in lead] for lead in blocks.binding.lead]
        x = args[blocks.binding.x]
        one = np.array(1.0, dtype=blocks.stages[-1].output_type.dtype.numpy)
        profiles = profile_stages(blocks.stages, lead_args, x, one, repeats=1, dialects=self.dialects,
                                  measure=self.cost_model == "profiled")
        if self.cost_model == "static":
            for prof, st in zip(profiles, blocks.stages):
                prof.fwd_time = function_cost(st.split.forward)
                prof.bwd_time = function_cost(st.split.backward)
        costs = chain_costs(profiles)

        def finish(fn):
            return step_program(_reorder_aux(fn, blocks.aux_order), self.layout, self.updates, self._state_types,
                                self.keep_grads, check=False)

        planner = ChainPlanner(blocks.stages, costs, name="train_joint", binding=blocks.binding, finish=finish,
                               what=f"this model cut into {len(blocks.stages)} blocks")
        try:
            pol = planner.solve(self.budget, "extended")
        except BudgetTooSmall as e:
            return ("min", e.minimum)
        overhead = pol.plan.cost / costs.no_recompute_cost() - 1.0
        notes = [f"cut at {'backward-kept' if coarse else 'all'} separators into a chain of {len(blocks.stages)} blocks in "
                 f"{time.perf_counter() - t0:.2f} s; chain DP (extended model: per block, keep output or whole tape)",
                 f"schedule: {len(pol.schedule)} steps, {pol.plan.n_recomputed(costs)} block recomputations"]
        pol.plan.base_cost = costs.no_recompute_cost()
        return ("ok", ("chain DP (extended)", notes, pol.function, pol.plan, overhead))

    # ------------------------------------------------------------------ arguments
    def _ttype(self, t):
        from ..runtime.vm import tensor_type_of

        return tensor_type_of(t.detach())

    def _joint_args(self, inputs: Sequence, copy: bool) -> list:
        state = [t.detach() for t in self.imported.param_tensors()]
        if copy:
            state = [t.clone() for t in state]
        args = state + [t.detach() if hasattr(t, "detach") else t for t in inputs]
        if self.imported.has_seed:
            args.append(np.array(self._seed + self._step, dtype=np.int64))
        return args

    def _step_args(self, inputs: Sequence, copy: bool, step: int) -> list:
        args = self._joint_args(inputs, copy)
        if self.updates:
            for ts in self._state:
                args += [t.detach().clone() if copy else t.detach() for t in ts]
            args.append(np.array(step, dtype=np.int64))
        return args

    def _check_inputs(self, inputs: Sequence) -> None:
        if len(inputs) != len(self._example_types):
            raise TypeError(f"the step takes {len(self._example_types)} tensor(s) (inputs then targets), got {len(inputs)}")
        for k, (t, (shape, dtype)) in enumerate(zip(inputs, self._example_types)):
            if not hasattr(t, "shape") or tuple(t.shape) != shape or getattr(t, "dtype", None) != dtype:
                got = f"{getattr(t, 'dtype', type(t).__name__)}{list(getattr(t, 'shape', []))}"
                raise TypeError(f"argument {k} of the training step: expected {dtype}{list(shape)} (as compiled), "
                                f"got {got}; compile again for other shapes")

    # ------------------------------------------------------------------ run
    def __call__(self, *inputs):
        """One training step on ``inputs`` (model inputs then targets); returns the loss (a 0-d tensor)."""
        torch = self.torch
        self._check_inputs(inputs)
        opt_step = self._step
        if self.updates:
            self._check_optimizer()
            # The optimizer's own step count and state (it may also have been stepped eagerly).
            opt_step = steps_taken(self.optimizer, self._params, self.updates)
            self._state = bind_state(self.optimizer, self._params, self.updates, self._state)
        args = self._step_args(inputs, copy=False, step=opt_step + 1)
        t0 = time.perf_counter()
        outs, stats = self._vm.run(self.program.name, *args, outputs="torch")
        self.last_seconds = time.perf_counter() - t0
        self.last_stats = stats
        self._step += 1
        loss = outs[0]
        with torch.no_grad():
            for buf, new in zip(self._buffers_out, outs[1:1 + self.layout.n_buffers_out]):
                buf.copy_(new)
            if self.keep_grads:
                for p, g in zip(self._params, outs[1 + self.layout.n_buffers_out:]):
                    p.grad = g.to(p.dtype).clone() if p.grad is None else p.grad.add_(g)
        if self.updates:
            advance_steps(self.optimizer, self._params, self.updates)
        return loss

    def _check_optimizer(self) -> None:
        lrs = {id(p): g["lr"] for g in self.optimizer.param_groups for p in g["params"]}
        for p, u in zip(self._params, self.updates):
            if lrs[id(p)] != u.attrs["lr"]:
                raise RuntimeError(f"the optimizer's learning rate changed from {u.attrs['lr']} to {lrs[id(p)]} after "
                                   "remat.compile; learning-rate schedules need a recompile (not supported yet)")

    # ------------------------------------------------------------------ report
    def report(self) -> Report:
        measured = self.last_stats.peak_bytes if self.last_stats is not None else None
        overhead = None
        if self.last_seconds is not None and self.unconstrained_step_seconds:
            overhead = self.last_stats.total_seconds / self.unconstrained_step_seconds - 1.0
        return Report(self.budget, self.predicted_peak, measured, self.unconstrained_peak, overhead,
                      self.predicted_overhead, self.solver, list(self.notes), self.plan_seconds, self.setup_seconds,
                      None if self.last_stats is None else self.last_stats.total_seconds,
                      self.unconstrained_step_seconds, self.instructions, self.recomputed)


class _NoPlan(Exception):
    """The instruction-level planner found no plan within the budget (and no minimum was asked for)."""


def _reorder_aux(fn: Function, aux_order: list[int]) -> Function:
    """Put the side outputs of a chain program (in stage order) back in the forward's output order."""
    if not aux_order or aux_order == sorted(aux_order):
        return fn
    out = fn.clone()
    ret = out.entry.instrs[-1]
    ops, types = list(ret.operands), list(out.result_types)
    for t, j in enumerate(aux_order):  # stage-order side output t is the forward's side output j
        ops[1 + j], types[1 + j] = ret.operands[1 + t], fn.result_types[1 + t]
    ret.operands = ops
    out.result_types = types
    return out


def compile(model, example_inputs: Sequence, loss_fn: Callable | None = None, optimizer=None, budget=None,
            **options: Any) -> TrainStep:
    """Compile a training step of ``model`` (a vanilla ``torch.nn.Module``) under ``budget``.

    ``example_inputs``: the model's inputs followed by the loss's targets (shapes are fixed by them).
    ``loss_fn(output, *targets)``: the loss (omit it if the model returns the loss).
    ``optimizer``: a ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` over ``model.parameters()``; its
    state tensors are updated in place. Without one, the step leaves gradients in ``.grad``.
    ``budget``: bytes, a size such as "1.5GiB", a percentage "40%" or a fraction in (0, 1] of
    the unconstrained peak; None plans no recomputation. Raises ``BudgetTooSmall`` with the
    minimum feasible budget; nothing of the model is modified by compiling.
    Options: ``cost_model`` ("static": deterministic estimates, the default; "profiled": measured
    per-instruction times), ``solver`` ("auto", "greedy", "milp"), ``dialects``, ``seed``, ``keep_grads``,
    ``num_targets``, ``milp_time_limit``, ``progress`` (a callable receiving stage names).
    """
    return TrainStep(model, example_inputs, loss_fn, optimizer, budget, **options)
