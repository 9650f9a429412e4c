"""Compile a chain plan into one rematerialised IR program (explicit recompute and free).

Indexing follows the chain cost model (``remat.chain.costs``): stage ``s`` (1..N) computes
``f_s`` from ``f_{s-1}``; backward ``B(s)`` is stage ``s``'s backward, reading its tape and
``b_{s+1}`` (the gradient wrt ``f_s``) and producing ``b_s`` (the gradient wrt ``f_{s-1}``) and the
gradients of stage ``s``'s parameters. ``f_0`` is the chain input and ``b_{N+1}`` the upstream
gradient (function arguments, owned by the caller); ``B(0)`` is the thesis's empty backward.

The program is straight-line IR. A ``Free`` step becomes a ``free`` instruction for the values
that no other live slot holds, so the VM releases memory exactly where the plan says; every other
temporary is released at its last use. Its peak is therefore predicted exactly by
``remat.memory.liveness.predict_peak``, and the VM measures that same number.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Builder, Function, Module, TensorType, Value, verify
from ..memory.partition import Split, inline, split_joint
from .schedule import B, F, FT, Free, Step


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
    def tape_types(self) -> list[TensorType]:
        return self.split.forward.result_types[1:]


def joint_function(forward: Function, n_params: int, wrt: tuple[int, ...] | None = None) -> Function:
    """The joint ``(params..., x, gy) -> (y, grads wrt ``wrt``...)`` of a stage, by autodiff
    (default ``wrt``: every parameter, then the input), cleaned up by simplify/fold/cse/dce."""
    from ..autodiff import gradient_function
    from ..ir import GradientSpec
    from ..passes import run_pipeline

    m = Module([forward.clone("stage")])
    wrt = tuple(range(n_params + 1)) if wrt is None else wrt
    g = gradient_function(m, "joint", GradientSpec("stage", wrt, with_value=True), explicit_cotangents=True)
    return run_pipeline(Module([g]), ["simplify", "fold", "cse", "dce"]).module["joint"]


def make_stage(name: str, forward: Function, n_params: int, grad_params: tuple[int, ...] | None = None) -> ChainStage:
    """Differentiate a stage's forward and split the result into forward/backward parts."""
    if len(forward.params) != n_params + 1 or len(forward.result_types) != 1:
        raise ValueError(f"stage {name}: expected (params[{n_params}], x) -> y, got "
                         f"{len(forward.params)} parameters and {len(forward.result_types)} results")
    grad_params = tuple(range(n_params)) if grad_params is None else tuple(grad_params)
    joint = joint_function(forward, n_params, grad_params + (n_params,))
    split = split_joint(joint, n_primals=n_params + 1, n_outputs=1, direct=set(range(n_params)))
    return ChainStage(name, forward, n_params, split, grad_params)


def compile_schedule(stages: list[ChainStage], schedule: list[Step], name: str = "chain_step",
                     upstream_is_param: bool = True, return_output: bool = False) -> Module:
    """Build the program ``(params of every stage..., x[, gy]) -> ([y,] grad x, grad params...)``.

    With ``upstream_is_param=False`` the last stage must produce a scalar (a loss) and its
    upstream gradient is the constant 1. Gradients of parameters come in stage order.
    """
    n = len(stages)
    ptypes = [t for s in stages for t in s.param_types] + [stages[0].input_type]
    if upstream_is_param:
        ptypes.append(stages[-1].output_type)
    out_t = stages[-1].output_type
    grad_types = [t for s in stages for t in s.grad_types]
    rtypes = ([out_t] if return_output else []) + [stages[0].input_type] + grad_types
    fn = Function(name, ptypes, rtypes)
    b = Builder(fn.entry)
    params: list[list[Value]] = []
    k = 0
    for s in stages:
        params.append(fn.params[k:k + s.n_params])
        k += s.n_params
    x = fn.params[k]
    if upstream_is_param:
        gy = fn.params[k + 1]
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
    output: Value | None = None
    gx: Value | None = None
    keep: set[Value] = set()  # program outputs: never freed

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
            if isinstance(step, FT):
                res = inline(b, st.split.forward, list(params[i - 1]) + [xin])
                f_slot[i] = [res[0]] + res[1:]
                tape_of[i] = res[1:]
            else:
                (y,) = inline(b, st.split.forward_light, list(params[i - 1]) + [xin])
                f_slot[i] = [y]
                tape_of.pop(i, None)
            if i == n and return_output and output is None:
                output = f_slot[i][0]
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
            res = inline(b, sp.backward, bargs)
            ng = len(st.grad_params)
            grads[i] = res[:ng]
            b_slot[i] = [res[ng]]
            keep.update(grads[i])
            if i == 1:
                gx = b_slot[1][0]
                keep.add(gx)
        elif isinstance(step, Free):
            if step.kind == "f":
                release("f", step.i)
                tape_of.pop(step.i, None)
            else:
                release("b", step.i)
        else:
            raise TypeError(f"unknown step {step!r}")
    missing = [i for i in range(1, n + 1) if i not in grads]
    if missing:
        raise ValueError(f"the plan never runs the backward of stage(s) {missing}")
    if return_output and output is None:
        raise ValueError("the plan never computes the chain's output")
    outs = ([output] if return_output else []) + [gx] + [g for i in range(1, n + 1) for g in grads[i]]
    b.ret(*outs)
    m = Module([fn])
    verify(m)
    return m
