"""Training-graph generation (RAF §3.1): forward + loss + backward + optimizer update, as IR.

``training_graph`` differentiates an imported model's loss wrt its parameters with remat's own
autodiff (:func:`remat.autodiff.joint`), keeping the other forward outputs (updated batch-norm
statistics), and ``cleanup`` makes it one straight-line function; ``step_program``
adds the in-place optimizer updates, each placed right after its gradient is complete and its
parameter's last read, so a gradient is consumed as soon as it exists, and after every first check
of an index value (``last_new_index_check``), so a step failing on bad indices changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..autodiff import joint
from ..ir import Builder, DType, Function, GradientSpec, Instruction, Module, TensorType, Value, verify
from ..ir.build import clone_into, move_into
from ..pipeline import run_pipeline
from ..ir.ops.optim import SKIP
from .optim import (ParamUpdate, UpdateArgs, clip_by_global_norm, clip_coefficient, emit_update, nonfinite_flag,
                    scaled_by, squared_sum, update_param_types)


@dataclass
class Layout:
    """Where things are among the joint function's parameters and results."""

    n_params: int      # trainable parameters (first)
    n_state: int       # parameters + buffers + lifted constants
    n_inputs: int      # user inputs and targets
    has_seed: bool
    n_buffers_out: int  # updated buffers returned after the loss

    @property
    def n_args(self) -> int:
        return self.n_state + self.n_inputs + int(self.has_seed)

    @property
    def first_grad(self) -> int:
        """Index of the first gradient among the joint's results (after the loss and the buffers)."""
        return 1 + self.n_buffers_out


def backup_types(param_types, state_types) -> list[TensorType]:
    """The flat backup buffers of ``step_program(atomic=True)``: per parameter, its own, then one per
    optimizer state tensor."""
    out = []
    for p, ts in zip(param_types, state_types):
        out += [TensorType(t.dtype, (t.numel,)) for t in (p, *ts)]
    return out


def training_forward(forward: Function) -> Function:
    """``forward`` as every training program differentiates it (the "pre-differentiation" pipeline,
    :data:`remat.passes.PRE_DIFFERENTIATION`): the
    whole step's :func:`training_graph`, and the blocks the chain planner differentiates one by one
    (``StepProblem.forward``). Both must start from this same function, or a budget the chain planner
    wins computes other bits than the unconstrained step (the key and value gradients of a
    grouped-query attention whose head repeats were folded in one and not in the other)."""
    return run_pipeline(Module([forward.clone("forward")]), "pre-differentiation").module["forward"]


def training_graph(forward: Function, n_params: int) -> Module:
    """The training graph as a module: ``train_joint(args...) -> (loss, other outputs..., grad params...)``
    calling ``forward`` (from :func:`training_forward`) and the gradient of its loss wrt its first
    ``n_params`` arguments (differentiated, not yet cleaned up)."""
    loss_t = forward.result_types[0]
    if loss_t.rank != 0 or not loss_t.dtype.is_float:
        raise ValueError(f"the loss must be a floating-point scalar, got {loss_t}")
    return joint(forward, range(n_params), name="train_joint")


def cleanup(m: Module) -> Function:
    """``train_joint`` of a training graph after the ``cleanup`` pipeline: one straight-line function."""
    out = run_pipeline(m, "cleanup").module["train_joint"].clone()
    verify(Module([out]))
    return out


def prepare_joint(graph: Module, dialects=None, split_bn_grad: bool = False) -> Function:
    """The training graph as the planners see it: training batch norms split (``split-batch-norm``),
    the composites no dialect of ``dialects`` claims expanded (``decompose_unclaimed``), then
    :func:`cleanup`. Every path that differentiates a whole step goes through here (the chain
    planner's blocks split batch norms the same way), so a plan made on any of them runs the
    unconstrained step's kernels: gradients stay bit-identical across budgets.
    ``split_bn_grad``: their backwards split too (``split-batch-norm-grad``, a memory-lean
    algorithm the planner chooses only where the reference does not fit)."""
    from ..passes.batchnorm import split_batch_norms
    from ..passes.decompose import decompose_unclaimed

    return cleanup(decompose_unclaimed(split_batch_norms(graph, split_bn_grad), dialects))


def update_points(joint: Function, layout: Layout, after_loss: bool = False) -> list[int]:
    """For each parameter, the body position after which its update can go: once its gradient is
    defined, its last read (directly or through a view of it) is done and every index bound has been
    checked (a step is atomic: no update before the last check of a new index; -1: before the first
    instruction). ``after_loss``: and once the loss is defined (the non-finite guard of the loss)."""
    body = joint.entry.instrs[:-1]
    ret = joint.entry.instrs[-1]
    grads = ret.operands[layout.first_grad:]
    pos_of: dict[object, int] = {}
    last_read = {p: -1 for p in joint.params[: layout.n_params]}
    param_of: dict[Value, Value] = {p: p for p in last_read}  # a parameter, or a view of one (reshape, ...)
    for i, ins in enumerate(body):
        for r in ins.results:
            pos_of[r] = i
        for o in ins.operands:
            if o in param_of:
                last_read[param_of[o]] = i
        for k, src in ins.op.aliases.items():  # a view reads its parameter wherever the view is read
            if ins.operands[src] in param_of:
                param_of[ins.results[k]] = param_of[ins.operands[src]]
    barrier = last_new_index_check(body)
    if after_loss:
        barrier = max(barrier, pos_of.get(ret.operands[0], -1))
    return [max(pos_of.get(grads[k], -1), last_read[joint.params[k]], barrier) for k in range(layout.n_params)]


def last_new_index_check(body: list[Instruction]) -> int:
    """Position of the last instruction that checks an index value no earlier instruction checked
    against the same bounds (``OpDef.index_bounds``), or -1. Out-of-range indices (class targets,
    token ids) raise there; an update placed after it never runs on a step that fails that way.
    A backward's re-check of the forward's indices (scatter_add after gather, nll_loss_grad after
    nll_loss, a recomputed gather) is not new, so updates still follow their gradients closely."""
    seen: set[tuple] = set()
    memo: dict[Value, object] = {}
    ids: dict[tuple, int] = {}  # structural key -> a small number (hash-consing: keys stay shallow)

    def structural(v: Value) -> object:
        """The same key for a recomputed value as for the original (an index recomputed from
        the same inputs, e.g. positions from ``iota``, is checked already)."""
        if v not in memo:
            ins = getattr(v, "instr", None)
            if ins is None:
                memo[v] = v
            else:
                key = (ins.op.name, repr(sorted(ins.attrs.items())), v.index, tuple(structural(o) for o in ins.operands))
                memo[v] = ids.setdefault(key, len(ids))
        return memo[v]

    last = -1
    for i, ins in enumerate(body):
        rule = ins.op.index_bounds
        if rule is None:
            continue
        bounds = rule([v.type for v in ins.operands], ins.attrs)
        key = (structural(ins.operands[bounds.operand]), bounds.size, bounds.ignore)
        if key not in seen:
            seen.add(key)
            last = i
    return last


def step_program(joint: Function, layout: Layout, updates: list[ParamUpdate] | None,
                 state_types: list[list[TensorType]], keep_grads: bool, name: str = "train_step",
                 check: bool = True, max_grad_norm: float | None = None, guard: str | None = None,
                 loss_scaled: bool = False, atomic: bool = False, norm_pass: bool = False,
                 take_joint: bool = False) -> Function:
    """The whole training step: ``(joint args..., optimizer state..., step, hyper...) -> (loss,
    buffers...[, grads...][, skipped])`` (``hyper``: each param group's hyperparameters, ``step.optim``).

    ``joint`` is a straight-line joint (possibly rematerialised, with frees). Updates are in place
    (the results alias the parameter and state buffers). With ``max_grad_norm`` the gradients are
    clipped by their global norm first (:func:`~.optim.clip_by_global_norm`), so every update
    follows the last gradient: all of them are kept until the norm is known.

    ``guard`` (the non-finite guard, ``remat.compile(on_nonfinite=...)``): every update takes one
    ``skip`` flag, the program's last result, true when the loss ("loss") or the loss or any
    gradient ("all") has a NaN or infinite element (:func:`~.optim.nonfinite_flag`). "loss" costs
    nothing: the loss is known before the first gradient, so each update still follows its own
    gradient (``update_points``; one that needs no gradient waits for the loss). With "all", as with
    clipping, every update follows the last gradient, all of them kept until the flag is known. A
    skipped step changes no parameter and no optimizer state, as ``torch.amp.GradScaler`` skips one.

    ``loss_scaled`` (fp16, :mod:`remat.passes.loss_scale`): the joint's last input is the loss scale
    ``S`` and its loss is scaled; each gradient is divided by ``S`` before the guard's check, the
    clipping and the update (``GradScaler.unscale_``), and the loss is returned divided by ``S``.

    ``atomic``: after the update arguments, one flat backup buffer per parameter and per optimizer
    state tensor (:func:`backup_types`); right before each update the parameter and its state are
    copied into theirs (``assign``), so that a step failing midway can be rolled back
    (``remat.compile(atomic=True)``). The backups are arguments: the plan counts their bytes.

    ``norm_pass`` (with ``max_grad_norm``): the gradients are not kept; the joint runs twice in the
    program, on the same arguments (the same dropout seed: the same masks, the same gradients). The
    first pass, the norm pass, turns each gradient into its sum of squares as soon as it exists
    (the gradient then dies) and updates nothing; its buffers' new values are dropped. The clip
    coefficient and the guard's flag follow from those sums (the guard checks the loss and the
    sums: a gradient with a NaN or infinite element has a non-finite sum). The second pass is the
    fused step, each update right after its gradient, scaled by the coefficient; its loss and
    buffers are the step's. Nothing of the first pass outlives it but scalars, so the program's
    peak is the larger of the two passes' peaks. The coefficient and the flag are computed by the
    same instructions from the same values as with the gradients kept, so both give the same bits.

    ``take_joint``: the joint's instructions are moved into the program (:func:`~remat.ir.build.move_into`),
    not copied, leaving ``joint`` unusable: for a joint built only to become this program (a
    planner's candidate), the same program built faster.
    """
    guard = guard if updates else None
    ptypes = list(joint.param_types)
    flat_state = [t for ts in state_types for t in ts] if updates else []
    ptypes += flat_state + (update_param_types(updates) if updates else [])
    atomic = bool(updates) and atomic
    if atomic:
        ptypes += backup_types(joint.param_types[:layout.n_params], state_types)
    n_out = layout.first_grad
    grad_types = list(joint.result_types[n_out:])
    rtypes = list(joint.result_types[:n_out]) + (grad_types if keep_grads else []) + ([SKIP] if guard else [])
    fn = Function(name, ptypes, rtypes)
    b = Builder(fn.entry)
    vmap: dict[Value, Value] = dict(zip(joint.params, fn.params))
    body = joint.entry.instrs[:-1]
    ret = joint.entry.instrs[-1]
    grads = ret.operands[n_out:]
    at: dict[int, list[int]] = {}
    clip = updates and max_grad_norm is not None
    two_pass = bool(clip) and norm_pass and not keep_grads
    if updates:
        late = keep_grads or (not two_pass and (clip or guard == "all"))
        where = ([len(body) - 1] * layout.n_params if late  # the guard: no update before the loss
                 else update_points(joint, layout, after_loss=guard == "loss" and not two_pass))
        for k, w in enumerate(where):
            at.setdefault(w, []).append(k)
        state_vals, off = [], len(joint.params)
        for ts in state_types:
            state_vals.append(fn.params[off:off + len(ts)])
            off += len(ts)
        n_update = len(update_param_types(updates))
        uargs = UpdateArgs.of(fn.params[off:off + n_update], updates)
        backups, off = [], off + n_update
        if atomic:
            for ts in state_types:
                backups.append(fn.params[off:off + 1 + len(ts)])
                off += 1 + len(ts)

    inverse: dict[DType, Value] = {}

    def loss_scale() -> Value:  # fp16: the joint's last input (remat.passes.loss_scale)
        return vmap[joint.params[layout.n_state + layout.n_inputs - 1]]

    def unscaled(g: Value) -> Value:
        dt = g.type.dtype
        if not inverse:
            inverse[DType.f32] = b.op("div", b.op("constant", value=1.0, shape=(), dtype=DType.f32), loss_scale())
        if dt not in inverse:
            inverse[dt] = b.op("cast", inverse[DType.f32], dtype=dt)
        return b.op("mul", g, inverse[dt])

    coef: Value | None = None  # two passes: the clip coefficient, from the norm pass
    casts: dict[DType, Value] = {}

    def emit(ks: list[int]) -> None:
        gs = [vmap[grads[k]] for k in ks]
        if loss_scaled:
            gs = [unscaled(g) for g in gs]
        if guard and ks and uargs.skip is None:  # "all": ks are all of them, after the last gradient
            uargs.skip = nonfinite_flag(b, vmap[ret.operands[0]], gs if guard == "all" else [])
        if coef is not None:
            gs = scaled_by(b, gs, coef, casts)
        elif clip and ks:
            gs = clip_by_global_norm(b, gs, max_grad_norm)
        for k, g in zip(ks, gs):
            if atomic:  # the values before the update, for a roll-back
                for dst, src in zip(backups[k], [vmap[joint.params[k]], *state_vals[k]]):
                    b.op("assign", dst, b.op("reshape", src, shape=(src.type.numel,)))
            emit_update(b, updates[k], vmap[joint.params[k]], g, list(state_vals[k]), uargs)

    if two_pass:
        coef, uargs.skip = _norm_pass(b, joint, layout, fn, max_grad_norm, guard, unscaled if loss_scaled else None)
    emit(at.get(-1, []))
    place = move_into if take_joint else clone_into
    for i, ins in enumerate(body):
        place(b, ins, vmap)
        emit(at.get(i, []))
    outs = [vmap[v] for v in ret.operands[:n_out]] + ([vmap[g] for g in grads] if keep_grads else [])
    if loss_scaled:  # the loss as the model computed it (dividing by a power of two is exact)
        scale = loss_scale()
        dt = outs[0].type.dtype
        outs[0] = b.op("div", outs[0], scale if dt == DType.f32 else b.op("cast", scale, dtype=dt))
    if guard:
        outs.append(uargs.skip)
    b.ret(*outs)
    if check:
        verify(Module([fn]))
    return fn


def _norm_pass(b: Builder, joint: Function, layout: Layout, fn: Function, max_grad_norm: float,
               guard: str | None, unscaled=None) -> tuple[Value, Value | None]:
    """The norm pass of ``step_program(norm_pass=True)`` emitted at ``b``: the joint's body on
    ``fn``'s arguments, each gradient's sum of squares (:func:`~.optim.squared_sum`; ``unscaled``:
    fp16, the gradient divided by the loss scale first) taken right after the gradient is defined.
    Returns the clip coefficient (the sums added in parameter order, as
    :func:`~.optim.clip_by_global_norm` adds them) and, with a ``guard``, the updates' skip flag."""
    body, ret = joint.entry.instrs[:-1], joint.entry.instrs[-1]
    grads = ret.operands[layout.first_grad:]
    pos_of = {r: i for i, ins in enumerate(body) for r in ins.results}
    due: dict[int, list[int]] = {}
    for k, g in enumerate(grads):
        due.setdefault(pos_of.get(g, -1), []).append(k)
    vmap: dict[Value, Value] = dict(zip(joint.params, fn.params))
    squares: list[Value | None] = [None] * len(grads)

    def square(ks: list[int]) -> None:
        for k in ks:
            g = vmap[grads[k]]
            squares[k] = squared_sum(b, unscaled(g) if unscaled is not None else g)

    square(due.get(-1, []))
    for i, ins in enumerate(body):
        clone_into(b, ins, vmap)
        square(due.get(i, []))
    skip = None
    if guard:
        skip = nonfinite_flag(b, vmap[ret.operands[0]], squares if guard == "all" else [])
    return clip_coefficient(b, squares, max_grad_norm), skip
