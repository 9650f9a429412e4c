"""Block-internal plans: variants of a chain stage whose backward recomputes part of its tape.

The chain DP (:mod:`.chain`) decides per stage between keeping its output only or its whole tape
(the values its backward reads). Inside one stage that is all or nothing, so a stage whose tape
and backward are large sets a floor under the chain's minimum that an instruction-level plan does
not have (issue 16: resnet18, chain 0.717 of the unconstrained peak, greedy 0.680). A *variant*
keeps only the stage input (and, optionally, some tape values); its backward recomputes the rest
of the tape from them, in an order and with evictions planned by the greedy on that backward
alone, so its transient peak is lower. Variants are ordinary :class:`~.chain.executor.ChainStage`
objects with another :class:`~.partition.Split`: the executor, the profiler and the chain model
handle them unchanged, and recomputation clones the same instructions, so gradients stay
bit-identical.

The block MILP (:func:`milp_recipes`) plans the same recomputing backward with the Checkmate MILP
(:mod:`.milp`), once per distinct block: its sequences join the greedy's as further stage options,
and the chain DP across blocks chooses among them (Rockmate's split of the problem).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from ..ir import Builder, Function, Instruction, Value
from ..ir.analysis import ancestors
from ..ir.build import clone_into, inline_body, slice_function
from .chain.executor import ChainStage
from .partition import Split, released
from .milp import WINDOW_HIGHS_OPTIONS, WINDOW_STAGES, WindowPass

if TYPE_CHECKING:
    from .chain.profile import StageProfile

WorkspaceFn = Callable[[Function], Mapping[Instruction, int]]

INNER_PLANS = True
"""Whether the portfolio tries block-internal plans (``portfolio.plan_inner``): only when no plan
fits or the best recomputes more than ``registry.NEAR_FLOOR_OVERHEAD``, since they cost a few
times the chain DP (a switch for comparing plans with and without them)."""


@dataclass(frozen=True)
class Recipe:
    """How to build a variant of a stage, reusable on any stage that is the same block up to
    renaming (``blocks.Blocks.kinds``): the positions (in the stage's tape) of the tape values kept
    besides the input, and the greedy's compute sequence over the backward's graph (None: no
    evictions, the memory-aware order only)."""

    keep: tuple[int, ...]
    sequence: tuple[int, ...] | None


RECIPE_SCORES = ("raf_belady", "raf_belady_outputs_last")
"""The greedy's eviction scores (``greedy.SCORES``) a block's backward is planned with, each giving
its own recipes: with gradient outputs evicted like any value or only last, neither always leaner
(zoo ResNet small at batch 16: the step's floor 5.6% lower with the second alone; zoo U-Net small
at batch 4: 13.7% higher)."""


DONATE = True
"""Whether a block-internal plan's backward releases its stage input, tape and upstream gradient
at their last use (:func:`_donated`); a switch for comparing plans with and without it."""


def _donated(g: Function, n_params_read: int) -> tuple[int, ...]:
    """The arguments a recomputing backward ``(params read..., x, kept tape..., gy)`` releases at
    their last use: all but the parameters. The chain is done with a stage's tape and its output's
    gradient once the stage's backward runs; freeing the input activation as soon as the
    recomputation has read it (rather than holding it to the end) is what lets a U-Net's skip span
    be planned within its children's memory (``greedy``: inputs released after their last use)."""
    return released(n_params_read, len(g.params)) if DONATE else ()


def _recomputing_backward(stage: ChainStage, keep: Sequence[int]) -> tuple[Function, Function, list[int]] | None:
    """The forward ``(params..., x) -> (y, side outputs..., x, kept tape...)`` and the backward
    ``(params read..., x, kept tape..., gy) -> grads`` that recomputes the other tape values, with
    the backward's parameter indices; None when a value to recompute depends on an effect."""
    sp = stage.split
    fwd, bwd = sp.forward, sp.backward
    ret = fwd.entry.instrs[-1]
    n_out = 1 + stage.n_aux
    outputs, tape = list(ret.operands[:n_out]), list(ret.operands[n_out:])
    x = fwd.params[stage.n_params]
    params = fwd.params[:stage.n_params]
    kept = [tape[i] for i in keep if tape[i] is not x]
    holds = [x] + kept
    missing = [t for t in tape if t not in set(holds)]
    recompute = ancestors(missing, stop=set(holds) | set(params))
    if any(ins.op.has("effect") or ins.op.has("inplace") for ins in recompute):
        return None
    # Parameters the new backward reads: those the old one read directly, and the recomputation's.
    read = set(sp.backward_primals) | {i for i, p in enumerate(params) for ins in recompute if p in ins.operands}
    bp = sorted(read)
    new_fwd = slice_function(f"{fwd.name}_in", list(fwd.params), fwd.entry.instrs[:-1], outputs + holds)
    g = Function(f"{bwd.name}_in", [params[i].type for i in bp] + [v.type for v in holds] + [bwd.params[-1].type],
                 list(bwd.result_types))
    vmap: dict[Value, Value] = {params[i]: a for i, a in zip(bp, g.params)}
    vmap.update(zip(holds, g.params[len(bp):len(bp) + len(holds)]))
    b = Builder(g.entry)
    for ins in fwd.entry.instrs[:-1]:
        if ins in recompute:
            clone_into(b, ins, vmap)
    args = [vmap[params[i]] for i in sp.backward_primals] + [vmap[t] for t in tape] + [g.params[-1]]
    b.ret(*inline_body(b, bwd, args))
    return new_fwd, g, bp


def build_variant(stage: ChainStage, recipe: Recipe, workspace_fn: WorkspaceFn | None = None) -> ChainStage | None:
    """The variant of ``stage`` that ``recipe`` describes, or None when it cannot be built."""
    from .graph import eager_frees
    from .rematerialize import from_schedule, to_graph

    parts = _recomputing_backward(stage, recipe.keep)
    if parts is None:
        return None
    fwd, g, bp = parts
    donated = _donated(g, len(bp))
    low = to_graph(g, workspaces=None if workspace_fn is None else workspace_fn(g), donated=donated)
    seq = recipe.sequence
    if seq is None:
        from .scheduling import memory_aware_order

        seq = tuple(memory_aware_order(low.graph))
    back = from_schedule(low, eager_frees(low.graph, seq), check=False)
    split = Split(fwd, stage.split.forward_light, back, stage.split.n_outputs, bp,
                  len(fwd.result_types) - 1 - stage.n_aux, donated)
    return replace(stage, split=split)


def recipes(stage: ChainStage, costs: Callable[[Function], dict[Instruction, float]],
            workspace_fn: WorkspaceFn | None = None, levels: Sequence[float] = (0.0, 0.5)) -> list[Recipe]:
    """A few recipes for ``stage``: keep only the input, its backward in memory-aware order and
    planned by the greedy at ``levels`` (0: the greedy's minimum, 1: the no-eviction peak)
    between those two peaks, with each of :data:`RECIPE_SCORES`. ``costs``: seconds per
    instruction of a function (the greedy's recomputation prices). The greedy plans the backward
    twice, its donated arguments released after their last use and held to the end: neither is
    always the leaner (zoo U-Net's block spanning the top-level skip: 59.7 against 83.7 MiB at
    batch 64 with them released; zoo ResNet at batch 64: a step floor 0.3% higher with those
    recipes alone), and either sequence runs with them released (:func:`build_variant`), peaking
    no higher."""
    from .graph import eager_frees, evaluate
    from .greedy import greedy_compute_sequence, greedy_min_budget
    from .rematerialize import to_graph
    from .scheduling import memory_aware_order

    parts = _recomputing_backward(stage, ())
    if parts is None:
        return []
    _, g, bp = parts
    donated = _donated(g, len(bp))
    prices, ws = costs(g), None if workspace_fn is None else workspace_fn(g)
    out: list[Recipe] = []
    for given in ([donated, ()] if donated else [()]):
        low = to_graph(g, prices, workspaces=ws, donated=given)
        order = memory_aware_order(low.graph)
        if not out:
            out.append(Recipe((), tuple(order)))
        hi = evaluate(low.graph, eager_frees(low.graph, order))[1]
        for score in RECIPE_SCORES:
            lo = greedy_min_budget(low.graph, order, score=score, rel_tol=0.01, max_steps=20 * len(low.graph) + 1000)
            for f in sorted(set(levels)):
                m = int(lo + (hi - lo) * f)
                if m >= hi:
                    continue
                seq = greedy_compute_sequence(low.graph, m, order, score=score, max_steps=20 * len(low.graph) + 1000)
                if seq is not None and Recipe((), tuple(seq)) not in out:
                    out.append(Recipe((), tuple(seq)))
    return out


SELECTIVE_GAP = 4.0
"""The selective recipe (:func:`selective_recipe`) cuts the block's tape values, sorted by
recomputation seconds per byte, at a fall of at least this factor: the outputs of convolutions and
matrix products and a norm's statistics (hundreds to thousands of FLOPs a byte) above, those of
element-wise ops (a few) below."""

SELECTIVE_DEAR = frozenset({"gelu", "silu", "tanh", "sigmoid", "exp", "log", "softmax", "log_softmax", "erf",
                            "softplus", "pow", "sqrt", "rsqrt"})
"""Ops a selective recipe does not recompute, nor random ones (dropout masks): the static cost model
prices these transcendental element-wise ops at memory speed, and they run several times slower
(zoo GPT small at 50%: a selective plan priced 0.03% cheaper ran 2% slower, recomputing GELUs).
Convolutions and matrix products may be recomputed: the model prices them above their time."""

SELECTIVE_SHARE = 0.25
"""Most of the block's forward seconds the values a selective recipe recomputes may cost: beyond it
the recipe is one more way of recomputing the block, which the other recipes cover."""


def selective_recipe(stage: ChainStage, costs: Callable[[Function], dict[Instruction, float]]) -> Recipe | None:
    """The recipe that keeps, besides the input, the tape values dear to recompute per byte, its
    backward recomputing the others from them (no evictions): selective checkpointing, which keeps a
    block's convolution or matrix-product outputs and recomputes its ReLUs and batch norms, for part
    of the tape at a small part of the forward's time. A value's price per byte is its
    instruction's static seconds over the bytes of that instruction's results in the tape; sorted by
    it, the values are cut at the last fall of at least :data:`SELECTIVE_GAP` below which they cost at
    most :data:`SELECTIVE_SHARE` of the forward to recompute from those above it and the input, none
    of them transcendental or random (:data:`SELECTIVE_DEAR`; views cost nothing: a tape that holds a
    value and its views then counts its bytes once). None when there is no such cut."""
    fwd = stage.split.forward
    ret = fwd.entry.instrs[-1]
    tape = list(ret.operands[1 + stage.n_aux:])
    x = fwd.params[stage.n_params]
    prices = costs(fwd)
    where: dict[Instruction, list[int]] = {}
    for k, t in enumerate(tape):
        if t is not x and isinstance(t.owner, Instruction):
            where.setdefault(t.owner, []).append(k)
    dens = sorted(((prices.get(ins, 0.0), sum(tape[k].type.nbytes for k in ks), ks) for ins, ks in where.items()),
                  key=lambda d: -d[0] / max(d[1], 1))
    limit = SELECTIVE_SHARE * sum(prices.values())
    params = set(fwd.params[:stage.n_params])
    for j in range(len(dens) - 1, 0, -1):
        (a, na, _), (b, nb, _) = dens[j - 1], dens[j]
        if a <= 0 or a / max(na, 1) < SELECTIVE_GAP * b / max(nb, 1):
            continue
        keep = sorted(k for _, _, ks in dens[:j] for k in ks)
        held = {x} | {tape[k] for k in keep}
        redo = ancestors([tape[k] for _, _, ks in dens[j:] for k in ks], stop=held | params)
        if sum(prices.get(ins, 0.0) for ins in redo) <= limit and all(_cheap(ins) for ins in redo):
            return Recipe(tuple(keep), None)
    return None


def _cheap(ins: Instruction) -> bool:
    """Whether a selective recipe may recompute ``ins`` (not :data:`SELECTIVE_DEAR`, not random)."""
    return ins.op.name not in SELECTIVE_DEAR and not ins.op.has("random")


BLOCK_MILP = True
"""Whether block-internal plans also take the block MILP's recipes (:func:`milp_recipes`) under the
solver options of :data:`BLOCK_MILP_SOLVERS`; a switch for comparing plans with and without them."""

BLOCK_MILP_SOLVERS: tuple[str, ...] = ("milp",)
"""The ``solver`` options under which the block MILP plans block backwards: ``"milp"`` only. Under
``"auto"`` it changed no plan of the twelve Hugging Face models of ``tests/models`` at 50% in fp32
and one floor in bf16 (T5: 866,748 -> 863,420 B), nor zoo ResNet, GPT or U-Net small at 50%, once the
compiled chain computes nothing that nothing reads (``chain.executor.compile_schedule``), while it
added 1-3 s to each of those compiles (greedy recipes that recomputed what nothing read were what
it used to beat: zoo GPT tiny at 0.76 of its peak, +60.8% against +32.1%, now +28.7% both)."""

BLOCK_MILP_MAX_NODES = 256
"""Largest recomputing backward (compute nodes) whose greedy recipes the block MILP improves
(:func:`milp_recipes`); the blocks of the zoo's models have up to about a hundred (zoo U-Net tiny's
skip-spanning block: 103)."""

BLOCK_MILP_EXACT_NODES = 16
"""Largest recomputing backward (compute nodes) the block MILP solves whole, to its optimum within
:data:`BLOCK_MILP_NODE_LIMIT`; above it only windows of it (the neighbourhood of the greedy's
sequence, :func:`.milp.improve_in_windows`). Measured: HiGHS (through SciPy, which takes no starting
solution) finds no feasible schedule of a 22-node block of zoo GPT tiny within 200 branch-and-bound
nodes (8 s), so a whole-block solve would cost seconds per block for nothing; on a 16-node block of
zoo GPT tiny it proves the optimum in 0.1 s at one greedy recipe's peak and stops at its node limit
after 3-5 s at a tighter one (gap 7%), with a plan recomputing less than the greedy's."""

BLOCK_MILP_NODE_LIMIT = 50
"""Branch-and-bound nodes one whole-block MILP may explore: its deterministic work limit (HiGHS runs
single-threaded, so the same block gives the same recipes under any machine load). The windows keep
:data:`.milp.WINDOW_NODE_LIMIT`."""

BLOCK_WINDOW_PASSES: tuple[WindowPass, ...] = (WindowPass(WINDOW_STAGES, 300),)
"""The window passes of the block MILP (``passes`` of :func:`.milp.improve_in_windows`): small
windows only, solved to optimality in milliseconds. A second pass of wider ones (800 variables, as
the whole-graph neighbourhood search) found no cheaper block plan of zoo ResNet tiny near its floor
and took zoo ResNet small's plan at 50% from 3.0 to 10.5 s."""

BLOCK_MILP_SAFETY_SECONDS = 20.0
"""Wall seconds after which one block MILP stops, as a guard only: a solve or window search it stops
is discarded whole (its answer would depend on the machine's load)."""


def milp_recipes(stage: ChainStage, costs: Callable[[Function], dict[Instruction, float]],
                 workspace_fn: WorkspaceFn | None = None, greedy: Sequence[Recipe] = ()) -> list[Recipe]:
    """Recipes for ``stage`` whose recompute sequence the Checkmate MILP (:mod:`.milp`) chooses on its
    recomputing backward (input kept only; donated arguments released after their last use, as
    :func:`build_variant` runs them), one per recipe of ``greedy`` that recomputes: within that
    recipe's peak, the least recomputation the MILP finds, solving the whole backward when it has
    at most :data:`BLOCK_MILP_EXACT_NODES` compute nodes (node-limited), else window by window on
    the neighbourhood of the greedy's sequence (:func:`.milp.improve_in_windows`). A MILP sequence
    is kept only when it recomputes strictly less than the greedy's at no higher peak, so no MILP
    recipe is costlier than the greedy one it improves. Deterministic: work bounded by node counts;
    what the wall-clock guard stops is discarded. Empty when the backward has more than
    :data:`BLOCK_MILP_MAX_NODES` compute nodes."""
    from .graph import BudgetTooSmall, eager_frees, evaluate, make_plan, schedule_computes
    from .milp import NoSolutionFound, improve_in_windows, solve_milp
    from .rematerialize import to_graph
    from .scheduling import memory_aware_order

    parts = _recomputing_backward(stage, ())
    if parts is None:
        return []
    _, g, bp = parts
    donated = _donated(g, len(bp))
    low = to_graph(g, costs(g), workspaces=None if workspace_fn is None else workspace_fn(g), donated=donated)
    graph = low.graph
    n = len(graph.compute_nodes)
    if not 0 < n <= BLOCK_MILP_MAX_NODES:
        return []
    order = memory_aware_order(graph)
    base = evaluate(graph, eager_frees(graph, order))[0]
    starts: dict[int, tuple[float, tuple[int, ...]]] = {}  # per peak, the cheapest greedy sequence within it
    for r in greedy:
        if r.keep != () or r.sequence is None:
            continue
        cost, peak = evaluate(graph, eager_frees(graph, r.sequence))
        if cost > base * (1 + 1e-9) and (peak not in starts or cost < starts[peak][0]):
            starts[peak] = (cost, r.sequence)  # it recomputes: something to improve
    out: list[Recipe] = []
    for peak in sorted(starts):
        cost, seq = starts[peak]
        found = None
        if n <= BLOCK_MILP_EXACT_NODES:
            try:
                found = solve_milp(graph, peak, order=order, time_limit=BLOCK_MILP_SAFETY_SECONDS,
                                   node_limit=BLOCK_MILP_NODE_LIMIT, highs=WINDOW_HIGHS_OPTIONS)
            except (BudgetTooSmall, NoSolutionFound):
                found = None
        else:
            start = make_plan(graph, list(seq), solver="greedy", status="heuristic", seconds=0.0)
            search = improve_in_windows(graph, start, peak, time_limit=BLOCK_MILP_SAFETY_SECONDS,
                                        passes=BLOCK_WINDOW_PASSES)
            if "time_limit" not in search.statuses:
                found = search.plan
        if found is None or found.peak > peak or found.cost >= cost * (1 - 1e-9):
            continue
        rec = Recipe((), tuple(schedule_computes(found.schedule)))
        if rec not in out and rec not in greedy:
            out.append(rec)
    return out


@dataclass
class StageOption:
    """One way to run a stage: the stage (itself or a variant), its profile, and what it is."""

    stage: ChainStage
    profile: "StageProfile"
    what: str  # "" for the stage as differentiated, else how its backward recomputes
    exact: bool = False  # its recompute sequence is the block MILP's (:func:`milp_recipes`)
    selective: bool = False  # it keeps some of its tape values (:func:`selective_recipe`)


def need(q: "StageProfile") -> int:
    """Bytes a stage's own forward and backward need beyond what else is live, in the chain model:
    its output and tape with the forward's or the backward's transient bytes, whichever is larger."""
    held = q.out_bytes + q.tape_bytes
    return max(held + q.fwd_overhead, held + max(q.input_grad_bytes + q.bwd_overhead - q.out_unread, 0))


def stage_options(stages: Sequence[ChainStage], profiles: Sequence["StageProfile"], kinds: Sequence[int],
                  costs: Callable[[Function], dict[Instruction, float]],
                  workspace_fn: WorkspaceFn | None = None, milp: bool = False,
                  cache: dict | None = None, shared: dict | None = None,
                  selective_only: bool = False) -> list[list[StageOption]]:
    """Per stage, its options: the stage as it is first, then its variants that need fewer bytes
    (:func:`need`). Recipes are found once per kind of block and applied to every stage of it.
    A variant's backward time is the stage's scaled by the ratio of their static costs. With
    ``milp``, the block MILP's recipes (:func:`milp_recipes`) are options too, each one that no
    option before it matches in both bytes and backward time (Rockmate's split: MILP plans inside
    blocks, the chain DP across them). ``cache``: recipes by block text, shared across calls (the
    cuts of one step hold many of the same blocks); ``shared``: recipes by block text from other
    steps planned with the same costs and workspaces, read when ``cache`` lacks them and kept in both.
    ``selective_only``: the selective recipes alone (:func:`selective_recipe`; no greedy or MILP ones)."""
    from .chain.profile import _profile
    from .costmodel import function_cost

    by_kind: dict[int, tuple[list[Recipe], list[Recipe]]] = {}
    out: list[list[StageOption]] = []
    for st, prof, kind in zip(stages, profiles, kinds):
        if kind not in by_kind:
            key = (milp, selective_only, str(st.split.forward.clone("block")), str(st.split.backward.clone("block")))
            hit = None if cache is None else cache.get(key)
            if hit is None and shared is not None:
                hit = shared.get(key)
            if hit is None:
                found = [] if selective_only else recipes(st, costs, workspace_fn)
                sel = selective_recipe(st, costs)
                found += [sel] if sel is not None else []
                hit = (found, milp_recipes(st, costs, workspace_fn, found) if milp else [])
            if cache is not None:
                cache[key] = hit
            if shared is not None:
                shared[key] = hit
            by_kind[kind] = hit
        opts = [StageOption(st, prof, "")]
        base = function_cost(st.split.backward)
        greedy, exact = by_kind[kind]
        for r in greedy + exact:
            v = build_variant(st, r, workspace_fn)
            if v is None:
                continue
            scale = function_cost(v.split.backward) / base if base > 0 else 1.0
            q = _profile(v, prof.fwd_time, prof.bwd_time * scale, workspace_fn)
            n = len(v.split.backward.entry.instrs)
            if r.keep:  # a selective recipe: an option unless another holds as little, as lean and as fast
                if not any(o.profile.tape_bytes <= q.tape_bytes and need(o.profile) <= need(q)
                           and o.profile.bwd_time <= q.bwd_time for o in opts):
                    opts.append(StageOption(v, q, f"keeps its input and {len(r.keep)} of its tape values, its "
                                                  f"backward recomputes the rest ({n} instructions)", selective=True))
            elif r in exact:
                if need(q) < need(prof) and not any(need(o.profile) <= need(q) and o.profile.bwd_time <= q.bwd_time
                                                    for o in opts):
                    opts.append(StageOption(v, q, f"keeps its input, its backward recomputes the rest as the block "
                                                  f"MILP planned it ({n} instructions)", True))
            elif need(q) < min(need(o.profile) for o in opts):
                opts.append(StageOption(v, q, f"keeps its input, its backward recomputes the rest ({n} instructions)"))
        out.append(opts)
    return out


def option_levels(options: Sequence[Sequence[StageOption]], fractions: Sequence[float] = (0.0, 0.25, 0.5, 0.75)) -> list[list[int]]:
    """The option index of each stage at a few levels, without duplicates, each beyond the stages
    as they are (all zeros, left out): the stages needing more than the least bytes any stage can be
    brought to switch to their cheapest option within it (a floor as low as the leanest level's, with less
    recomputation), and every stage at its leanest option."""
    leanest = [min(range(len(o)), key=lambda k: (need(o[k].profile), o[k].profile.bwd_time, k)) for o in options]
    floor = max(need(o[k].profile) for o, k in zip(options, leanest))
    top = max(need(o[0].profile) for o in options)

    def capped(cap: int) -> list[int]:
        return [min((k for k in range(len(o)) if need(o[k].profile) <= cap),
                    key=lambda k: (o[k].profile.bwd_time, k), default=lean) for o, lean in zip(options, leanest)]

    out: list[list[int]] = []
    for level in [capped(int(floor + (top - floor) * f)) for f in fractions] + [leanest]:
        if any(level) and level not in out:
            out.append(level)
    return out


def selective_levels(options: Sequence[Sequence[StageOption]], levels: Sequence[Sequence[int]]) -> list[list[int]]:
    """Levels with selective options: every stage that has one at its fastest selective option (the
    one holding the least tape among equally fast ones; holding less tape than the stage as it is,
    and needing no more bytes), alone and in place of the stages as they are in each of ``levels``;
    without duplicates, none of ``levels``."""
    pick = []
    for o in options:
        sel = [k for k, c in enumerate(o) if c.selective and need(c.profile) <= need(o[0].profile)
               and c.profile.tape_bytes < o[0].profile.tape_bytes]
        pick.append(min(sel, key=lambda k: (o[k].profile.bwd_time, o[k].profile.tape_bytes, k)) if sel else 0)
    if not any(pick):
        return []
    out: list[list[int]] = []
    for level in [[0] * len(options)] + [list(lv) for lv in levels]:
        merged = [k or s for k, s in zip(level, pick)]
        if merged not in out and merged not in levels:
            out.append(merged)
    return out
