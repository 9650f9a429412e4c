"""Compile a chain plan into one rematerialised IR program (explicit recompute and free).

Indexing follows the chain cost model (``remat.plan.chain.costs``): stage ``s`` (1..N) computes
``f_s`` from ``f_{s-1}``; backward ``B(s)`` is stage ``s``'s backward, reading its tape and
``b_{s+1}`` (the gradient wrt ``f_s``) and producing ``b_s`` (the gradient wrt ``f_{s-1}``) and the
gradients of stage ``s``'s parameters. ``f_0`` is the chain input and ``b_{N+1}`` the upstream
gradient (function arguments, owned by the caller); ``B(0)`` is the thesis's empty backward.

The program is straight-line IR. A ``Free`` step becomes a ``free`` instruction for the values
that no other live slot holds, so the VM releases memory exactly where the plan says; every other
temporary is released at its last use. So are a stage's tape and upstream gradient once its
backward runs (``Split.donated``): the chain holds them in no slot after that, and the backward's
last read of each frees it, unless another slot still holds the value (a checkpoint). Its peak is therefore predicted exactly by
``remat.plan.simulator.predict_peak``, and the VM measures that same number.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import Builder, Function, Instruction, Module, TensorType, Value, verify
from ...ir.build import inline_body
from ...passes.dce import dce_in_place
from ..partition import Split, donating, split_joint
from .schedule import B, F, FT, ChainStep, Free


@dataclass
class ChainStage:
    """One stage of a chain: its forward ``(params..., x) -> y`` and the split of its joint.

    ``grad_params``: indices of the leading parameters that get gradients (the trainable ones;
    lifted constants do not).
    """

    name: str
    forward: Function
    n_params: int
    split: Split
    grad_params: tuple[int, ...]
    n_aux: int = 0  # side outputs after y (e.g. updated batch-norm statistics), kept from the first run

    @property
    def param_types(self) -> list[TensorType]:
        return self.forward.param_types[: self.n_params]

    @property
    def grad_types(self) -> list[TensorType]:
        return [self.forward.param_types[i] for i in self.grad_params]

    @property
    def input_type(self) -> TensorType:
        return self.forward.param_types[self.n_params]

    @property
    def output_type(self) -> TensorType:
        return self.forward.result_types[0]

    @property
    def aux_types(self) -> list[TensorType]:
        return self.forward.result_types[1:1 + self.n_aux]

    @property
    def tape_types(self) -> list[TensorType]:
        return self.split.forward.result_types[1 + self.n_aux:]


DONATE_TAPE = True
"""Whether a stage's backward releases its tape and upstream gradient at their last use
(``partition.Split.donated``)."""


def joint_function(forward: Function, n_params: int, wrt: tuple[int, ...] | None = None,
                   split_bn_grad: bool = False) -> Function:
    """The joint ``(params..., x, gy) -> (y, side outputs..., grads wrt ``wrt``...)`` of a stage
    ``(params..., x) -> (y, side outputs...)``, by autodiff of ``y`` alone (default ``wrt``: every
    parameter, then the input), training batch norms split (with ``split_bn_grad`` their backwards
    too), after the ``cleanup`` pipeline (which also merges the forward code the gradient and the
    side outputs share)."""
    from ...autodiff import joint
    from ...passes import CLEANUP, run
    from ...passes.batchnorm import split_batch_norms

    wrt = tuple(range(n_params + 1)) if wrt is None else wrt
    # Training batch norms split as in the whole step's joint (remat.step.prepare_joint): same kernels.
    return run(split_batch_norms(joint(forward, wrt, cotangents=True), split_bn_grad), CLEANUP).module["joint"].clone()


def make_stage(name: str, forward: Function, n_params: int, grad_params: tuple[int, ...] | None = None,
               diff_input: bool = True, split_bn_grad: bool = False) -> ChainStage:
    """Differentiate a stage ``(params..., x) -> (y, side outputs...)`` and split its joint into
    forward/backward parts. ``diff_input=False`` for an input without gradient (integer data);
    ``split_bn_grad``: batch-norm backwards split (:func:`joint_function`)."""
    if len(forward.params) != n_params + 1 or not forward.result_types:
        raise ValueError(f"stage {name}: expected (params[{n_params}], x) -> (y, ...), got "
                         f"{len(forward.params)} parameters and {len(forward.result_types)} results")
    grad_params = tuple(range(n_params)) if grad_params is None else tuple(grad_params)
    n_aux = len(forward.result_types) - 1
    joint = joint_function(forward, n_params, grad_params + ((n_params,) if diff_input else ()), split_bn_grad)
    split = split_joint(joint, n_primals=n_params + 1, n_outputs=1 + n_aux, direct=set(range(n_params)))
    return ChainStage(name, _split_batch_norms(forward), n_params, donating(split) if DONATE_TAPE else split,
                      grad_params, n_aux)


def _split_batch_norms(fn: Function) -> Function:
    """``fn`` with its training batch norms (and tiled conv-bn-pool chains) split as the joint's are: a
    schedule that re-runs a stage's forward without its tape computes the same bits as the tape's forward."""
    from ...passes.batchnorm import split_batch_norm
    from ...passes.convblock import split_conv_bn_relu_pool

    return split_conv_bn_relu_pool(split_batch_norm(Module([fn.clone()])))[fn.name]


@dataclass
class Binding:
    """How stages attach to the program's parameters and results (general, non-sequential layout).

    ``param_types``: the program's parameters; ``lead[s]``: for stage ``s`` (0-based), the program
    parameter bound to each of its leading parameters; ``x``: the program parameter holding the
    chain input; ``grad_of``: the program parameters whose gradients the program returns, in
    order (a parameter used by several stages, e.g. a tied weight, gets the sum of their
    gradients); ``aux_types``: the types of the stages' side outputs, returned after the output
    in stage order.
    """

    param_types: list[TensorType]
    lead: list[list[int]]
    x: int
    grad_of: list[int]


def sequential_binding(stages: list[ChainStage], upstream_is_param: bool) -> Binding:
    ptypes = [t for s in stages for t in s.param_types] + [stages[0].input_type]
    if upstream_is_param:
        ptypes.append(stages[-1].output_type)
    lead, grad_of, k = [], [], 0
    for s in stages:
        lead.append(list(range(k, k + s.n_params)))
        grad_of += [k + j for j in s.grad_params]
        k += s.n_params
    return Binding(ptypes, lead, k, grad_of)


def _structural_match(light: Function, full: Function) -> dict[Instruction, Instruction]:
    """Each instruction of ``light`` to the instruction of ``full`` computing the same thing (same
    op, attributes and matched operands; both slice one joint over the same parameters)."""
    vmap: dict[Value, Value] = dict(zip(light.params, full.params))
    by_key: dict[tuple, Instruction] = {}
    for ins in full.entry.instrs[:-1]:
        by_key.setdefault((ins.op.name, tuple(map(id, ins.operands)), repr(sorted(ins.attrs.items()))), ins)
    out: dict[Instruction, Instruction] = {}
    for ins in light.entry.instrs[:-1]:
        key = (ins.op.name, tuple(id(vmap.get(o)) for o in ins.operands), repr(sorted(ins.attrs.items())))
        match = by_key.get(key)
        if match is None:
            continue
        out[ins] = match
        for r, m in zip(ins.results, match.results):
            vmap[r] = m
    return out


def _inline_marked(b: Builder, f: Function, args: list[Value], first: dict[Instruction, Instruction],
                   match: dict[Instruction, Instruction] | None) -> list[Value]:
    """``inline_body``, with provenance: an instruction whose source (through ``match``, for a
    different slice of the same stage) already ran records the value it recomputes; the first
    run of each source instruction is recorded in ``first``."""
    n0 = len(b.block.instrs)
    res = inline_body(b, f, args)
    for src, new in zip(f.entry.instrs[:-1], b.block.instrs[n0:]):
        key = src if match is None else match.get(src)
        if key is None:
            continue
        done = first.get(key)
        if done is None:
            first[key] = new
        elif done.results:
            new.recomputes = done.results[0]
    return res


def _mark_recomputations(fn: Function) -> None:
    """Mark each instruction that computes again what an earlier one computed, the same op on the
    same operands with the same attributes, as recomputing it (``Instruction.recomputes``): a
    block-internal plan's backward recomputes its stage's forward from the values the stage kept,
    which the forward's provenance (:func:`_inline_marked`) does not see. The lowering reads it
    (a batch norm recomputed from its first run's statistics, ``remat.lower.bn_recompute``)."""
    seen: dict[tuple, Instruction] = {}
    same: dict[Value, Value] = {}  # a recomputed value -> the first run's
    for ins in fn.entry.instrs:
        if not ins.results or ins.op.has("effect") or ins.op.has("inplace"):
            continue
        key = (ins.op.name, tuple(id(same.get(o, o)) for o in ins.operands), repr(sorted(ins.attrs.items())))
        first = seen.setdefault(key, ins)
        if first is not ins:
            same.update(zip(ins.results, first.results))
            if ins.recomputes is None:  # the first run's (``first`` may itself recompute one)
                ins.recomputes = first.recomputes if first.recomputes is not None else first.results[0]
    for ins in fn.entry.instrs:  # every mark names a first run, none a recomputation
        r = ins.recomputes
        while r is not None and r.instr.recomputes is not None:
            r = r.instr.recomputes
        ins.recomputes = r


FREE_UNREAD_OUTPUTS = True
"""Free a stage's output its backward does not read before that backward (``ChainCosts.out_unread``).
On with ``remat.plan.inner.INNER_PLANS``; a switch for comparing plans with and without it."""


def _free_unread_output(b: Builder, f_slot: dict[int, list[Value]], i: int, schedule: list[ChainStep], pos: int,
                        needed: set[Value]) -> None:
    """Before ``B(i)`` at ``schedule[pos]``: free ``f_i``'s output when nothing reads it any more (not
    the backward, another slot, the caller or the program's results) and the schedule's next use of
    ``f_i`` is freeing it, so its bytes are not held through the backward (``ChainCosts.out_unread``)."""
    y = f_slot[i][0]
    if not FREE_UNREAD_OUTPUTS or y in needed or y in f_slot[i][1:]:
        return
    for step in schedule[pos + 1:]:
        if isinstance(step, Free) and step.kind == "f" and step.i == i:
            break
        if isinstance(step, (F, FT)) and step.i in (i, i + 1):
            return
    else:
        return
    b.free(y)
    f_slot[i] = [v for v in f_slot[i] if v is not y]


def compile_schedule(stages: list[ChainStage], schedule: list[ChainStep], name: str = "chain_step",
                     upstream_is_param: bool = True, return_output: bool = False,
                     binding: Binding | None = None, check: bool = True) -> Module:
    """Build the program executing ``schedule`` (verified unless ``check`` is false: a planner probing
    many schedules verifies only the one it keeps).

    Sequential layout (default): ``(params of every stage..., x[, gy]) -> ([y,] grad x, grad params...)``.
    With a ``binding``: ``(binding.param_types...) -> (y, side outputs..., grads of binding.grad_of...)``
    (then the last stage must return a scalar loss, whose upstream gradient is the constant 1, and
    no gradient wrt the chain input is returned).
    With ``upstream_is_param=False`` the last stage must produce a scalar (a loss) and its
    upstream gradient is the constant 1. Gradients of parameters come in stage order.
    """
    n = len(stages)
    general = binding is not None
    if general:
        upstream_is_param, return_output = False, True
    else:
        binding = sequential_binding(stages, upstream_is_param)
    ptypes = binding.param_types
    out_t = stages[-1].output_type
    aux_types = [t for s in stages for t in s.aux_types]
    grad_types = [ptypes[i] for i in binding.grad_of]
    if general:
        rtypes = [out_t] + aux_types + grad_types
    else:
        rtypes = ([out_t] if return_output else []) + [stages[0].input_type] + grad_types
    fn = Function(name, ptypes, rtypes)
    b = Builder(fn.entry)
    params: list[list[Value]] = [[fn.params[i] for i in lead] for lead in binding.lead]
    x = fn.params[binding.x]
    if upstream_is_param:
        gy = fn.params[len(ptypes) - 1]
    else:
        if out_t.rank != 0:
            raise ValueError(f"the last stage returns {out_t}; without an upstream gradient it must return a scalar loss")
        gy = b.op("constant", value=1.0, shape=(), dtype=out_t.dtype)
    args = set(fn.params)

    # Slots of the cost model and the IR values each holds.
    f_slot: dict[int, list[Value]] = {0: [x]}
    b_slot: dict[int, list[Value]] = {n + 1: [gy]}
    tape_of: dict[int, list[Value]] = {}
    grads: dict[int, list[Value]] = {}
    aux: dict[int, list[Value]] = {}
    output: Value | None = None
    gx: Value | None = None
    keep: set[Value] = set()  # program outputs: never freed
    first: dict[int, dict[Instruction, Instruction]] = {}  # per stage: first run of each forward instruction
    light_match: dict[int, dict[Instruction, Instruction]] = {}

    def held(exclude: tuple[str, int]) -> set[Value]:
        out: set[Value] = set()
        for (kind, slots) in (("f", f_slot), ("b", b_slot)):
            for i, vals in slots.items():
                if (kind, i) != exclude:
                    out.update(vals)
        return out

    def release(kind: str, i: int) -> None:
        slots = f_slot if kind == "f" else b_slot
        if i not in slots:
            raise ValueError(f"plan frees {kind}_{i}, which is not live")
        vals = slots.pop(i)
        others = held((kind, i))
        dead = []
        for v in dict.fromkeys(vals):
            if v not in others and v not in args and v not in keep:
                dead.append(v)
        if dead:
            b.free(*dead)

    for pos, step in enumerate(schedule):
        if isinstance(step, (F, FT)):
            i = step.i
            st = stages[i - 1]
            if i - 1 not in f_slot:
                raise ValueError(f"step {pos} {step}: f_{i - 1} is not live")
            xin = f_slot[i - 1][0]
            na = len(st.aux_types)
            ran = first.setdefault(i, {})
            if isinstance(step, FT):
                res = _inline_marked(b, st.split.forward, list(params[i - 1]) + [xin], ran, None)
                tape_of[i] = res[1 + na:]
            else:
                if i not in light_match:
                    light_match[i] = _structural_match(st.split.forward_light, st.split.forward)
                res = _inline_marked(b, st.split.forward_light, list(params[i - 1]) + [xin], ran, light_match[i])
                tape_of.pop(i, None)
            f_slot[i] = [res[0]] + tape_of.get(i, [])
            if na and i not in aux:  # side outputs: the first computation is kept
                aux[i] = res[1:1 + na]
                keep.update(aux[i])
            if i == n and return_output and output is None:
                output = res[0]
                keep.add(output)
        elif isinstance(step, B):
            i = step.i
            if i == 0:
                continue
            st = stages[i - 1]
            if i not in tape_of or i not in f_slot:
                raise ValueError(f"step {pos} {step}: stage {i}'s tape is not live (needs FT({i}) first)")
            if i + 1 not in b_slot:
                raise ValueError(f"step {pos} {step}: b_{i + 1} is not live")
            sp = st.split
            bargs = [params[i - 1][j] for j in sp.backward_primals] + tape_of[i] + [b_slot[i + 1][0]]
            _free_unread_output(b, f_slot, i, schedule, pos, set(bargs) | held(("f", i)) | args | keep)
            if sp.donated:  # the backward's own last use releases these, unless another slot holds them
                donated = {bargs[k] for k in sp.donated}
                f_slot[i] = [v for v in f_slot[i] if v not in donated]
                if b_slot[i + 1] and b_slot[i + 1][0] in donated:
                    del b_slot[i + 1]
            res = inline_body(b, sp.backward, bargs)
            ng = len(st.grad_params)
            grads[i] = res[:ng]
            keep.update(grads[i])
            b_slot[i] = res[ng:ng + 1]  # empty when the stage input has no gradient (integer data)
            if i == 1 and b_slot[1]:
                gx = b_slot[1][0]
                keep.add(gx)
        elif isinstance(step, Free):
            if step.kind == "f":
                release("f", step.i)
                tape_of.pop(step.i, None)
            elif step.i in b_slot:
                release("b", step.i)
        else:
            raise TypeError(f"unknown step {step!r}")
    missing = [i for i in range(1, n + 1) if i not in grads]
    if missing:
        raise ValueError(f"the plan never runs the backward of stage(s) {missing}")
    if return_output and output is None:
        raise ValueError("the plan never computes the chain's output")
    # Gradient of each returned parameter: the sum over the stages reading it, in the order the whole
    # step's differentiation sums a parameter's uses (the last first: reverse-mode meets it first), so
    # that a parameter read in several stages (a tied embedding and head) gets the same bits as in the
    # unconstrained step.
    contrib: dict[int, list[Value]] = {}
    for i in range(n, 0, -1):
        for j, g in zip(stages[i - 1].grad_params, grads[i]):
            contrib.setdefault(binding.lead[i - 1][j], []).append(g)
    gouts = []
    for p in binding.grad_of:
        if p not in contrib:
            raise ValueError(f"no stage produces the gradient of program parameter {p}")
        acc = contrib[p][0]
        for g in contrib[p][1:]:
            acc = b.op("add", acc, g)
        gouts.append(acc)
    if general:
        outs = [output] + [v for i in range(1, n + 1) for v in aux.get(i, [])] + gouts
    else:
        if gx is None:
            raise ValueError("the chain input has no gradient")
        outs = ([output] if return_output else []) + [gx] + gouts
    b.ret(*outs)
    # A recomputation computes the forward's instructions up to its tape; what nothing reads (a
    # stage output the next stage's backward does not need: a batch norm before a residual add
    # and ReLU) is neither computed nor held.
    dce_in_place(fn)
    _mark_recomputations(fn)
    m = Module([fn])
    if check:
        verify(m)
    return m
