"""The memory-lean variants of a compiled step that the ``plan`` stage may choose
(:mod:`remat.plan.algorithms`): its forward with some ops rewritten to memory-lean algorithms before
differentiation, each variant's planning problem built on first use."""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Callable

from ..errors import format_bytes
from ..plan.algorithms import Variant
from ..plan.costmodel import static_costs
from ..plan.simulator import predict_peak
from ..plan.problem import StepProblem
from ..step.program import prepare_joint, training_forward, training_graph

if TYPE_CHECKING:
    from .compilation import Compilation


SLICED_ATTENTION_MIN_WORKSPACE = 1 / 20
"""The exact variant, attention over slices of the batch, is planned (beside the reference, at every
budget that binds) when the attention kernels' largest workspace is at least this fraction of the
step's unconstrained peak: then the slices can lower the floor and the recomputation near it (Hugging
Face ViT in bf16: its backward's 5.4 MiB, 7% of its peak; at half its peak +79% of predicted
recomputation becomes +35%, ``bench/sliced_attention.py``). Below it the slices save
little memory, and planning the step twice costs setup time. A criterion of the step alone, not of
the budget, so the plans stay monotone in the budget."""


def lean_variants(c: "Compilation") -> Callable[[StepProblem], list[Variant]]:
    """Given a problem ``p`` (its budget and workspaces), the step with each language-model head's
    cross-entropy chunked (``linear_cross_entropy``), each attention with dropout memory-efficient
    (``dropout_attention``) and each low-precision one fused (``attention``), each convolution over a channel concatenation split per input
    (``split-concat-conv``), each convolution -> batch norm -> ReLU -> max pool chain tiled over the
    batch (``tile-conv-bn-pool``) and each training batch norm's backward split
    (``split-batch-norm-grad``); first, an exact variant: each short low-precision attention over
    slices of the batch (``chunk_attention``, also in the lean variants). The variants are built
    once, on the first call (capture reused, each differentiated again on first use), then given
    ``p``'s budget and workspaces. With a tiled
    chain, two variants: tiles of at least ``MIN_TILE_BYTES`` (faster), then tiles of 1/``TILES``
    of the batch (leaner)."""
    built: list[list[Variant]] = []

    def given(p: StepProblem) -> list[Variant]:
        if not built:
            built.append(_build(c, p))
        out = []
        for v in built[0]:
            def given_p(v=v) -> StepProblem:  # the variant's problem with p's budget and workspaces
                if p.workspace_fn is None:
                    return replace(v.problem, budget=p.budget)
                return replace(v.problem, budget=p.budget, workspaces=p.workspace_fn(v.problem.joint),
                               workspace_fn=p.workspace_fn)

            out.append(Variant(v.sites, given_p, v.exact))
        return out

    return given


def _build(c: "Compilation", reference: StepProblem) -> list[Variant]:
    """The variants, their problems made from the ``reference`` problem's (budget and workspaces
    are set by the caller)."""
    from ..backends.torch_kernels import FLASH_MIN_LOWP_QUERIES
    from ..passes.attention import chunk_attention, recognise_dropout_attention, slices
    from ..passes.concatconv import split_concat_conv
    from ..passes.convblock import MIN_TILE_BYTES, tile_conv_bn_pool
    from ..passes.crossentropy import fuse_cross_entropy

    n_params = len(c.imported.param_names)
    profiled = c.options.cost_model == "profiled"

    def problem(forward, split_bn_grad: bool = False) -> StepProblem:  # differentiated on first use only
        fwd = training_forward(forward)
        joint = prepare_joint(training_graph(fwd, n_params), c.dialects, split_bn_grad=split_bn_grad)
        unconstrained = c.step_program(joint, check=True)
        # costed as the reference is: a variant's candidates are compared with the reference's
        return replace(reference, forward=fwd, joint=joint, unconstrained=unconstrained,
                       costs=c.measured_costs(joint) if profiled else static_costs(joint),
                       workspaces=None, split_bn_grad=split_bn_grad)

    # Exact: attention over slices of the batch (the same values, a slice's workspace), where the
    # kernels' workspaces weigh in the step's memory.
    chunked, chunk_sites = chunk_attention(c.imported.function, FLASH_MIN_LOWP_QUERIES)
    ws = reference.workspaces or {}
    held = max((ws.get(i, 0) for i in reference.joint.instructions()
                if i.op.name in ("attention", "attention_grad") and slices(i, FLASH_MIN_LOWP_QUERIES) > 1), default=0)
    exact = []
    if chunk_sites and held >= SLICED_ATTENTION_MIN_WORKSPACE * predict_peak(reference.unconstrained):
        a = chunk_sites[0]
        exact.append(Variant([f"attention over slices of the batch at {len(chunk_sites)} low-precision attention(s) "
                              f"(scores {list(a.shape)} in {a.chunks} slices, where the kernels hold the scores of the "
                              f"whole batch as their workspace)"], partial(problem, chunked), exact=True))
    base, sites = fuse_cross_entropy(chunked)
    base, att_sites = recognise_dropout_attention(base)
    base = chunk_attention(base, FLASH_MIN_LOWP_QUERIES)[0]  # the attentions it made too
    base, cat_sites = split_concat_conv(base)
    tilings = []  # (forward, its tiled chains), faster tiles first
    for min_tile in (MIN_TILE_BYTES, 0):
        forward, stem_sites = tile_conv_bn_pool(base, n_params, min_tile_bytes=min_tile)
        if not tilings or [s.tile for s in stem_sites] != [s.tile for s in tilings[0][1]]:
            tilings.append((forward, stem_sites))
    bns = sum(1 for ins in tilings[0][0].instructions() if ins.op.name == "batch_norm" and ins.attrs["training"]
              and all(v.type.dtype == ins.operands[0].type.dtype for v in ins.operands))  # mixed ones stay whole
    if not sites and not att_sites and not cat_sites and not tilings[0][1] and not bns:
        return exact
    lines = [f"linear_cross_entropy at {s.where} ({s.rows} rows x {s.vocab} classes in chunks of {s.chunk}; "
             + (f"the reference holds 3 x {format_bytes(s.logits_bytes)} of logits, log-probabilities "
                f"and their gradient)" if s.held == 3 else
                f"the reference holds the {format_bytes(s.logits_bytes)} logits, then their gradient over them)")
             for s in sites]
    dropped = [a for a in att_sites if a.p > 0]
    if dropped:
        a = dropped[0]
        lines.append(f"dropout_attention at {len(dropped)} attention(s) (scores {list(a.shape)}, dropout "
                     f"p={a.p:g}; one [T, S] matrix at a time, where the explicit form holds "
                     f"{format_bytes(a.scores_bytes)} tensors of scores, probabilities and their gradients)")
    fused = [a for a in att_sites if a.p == 0]
    if fused:
        a = fused[0]
        lines.append(f"attention at {len(fused)} low-precision attention(s) (scores {list(a.shape)}; the fused "
                     f"kernels, one block of scores at a time, where the explicit form, as eager autocast runs "
                     f"it, holds {format_bytes(a.scores_bytes)} tensors of scores, probabilities and their "
                     f"gradients; values differ by rounding)")
    if cat_sites:
        lines.append(f"conv2d over concat at {len(cat_sites)} convolution(s) ({', '.join(s.where for s in cat_sites)}) "
                     f"as one convolution per concatenated input, summed (never the concatenated "
                     f"activations, {format_bytes(sum(s.concat_bytes for s in cat_sites))} in all, or one "
                     f"gradient for them; values differ by summation order)")
    bn_line = ([f"batch_norm_grad at {bns} batch norm(s) as a reduction and an element-wise grad_x "
                f"(ATen's backward allocates an input-sized buffer it does not use; grad_x may "
                f"differ in the last bit)"] if bns else [])
    variants = exact
    for forward, stem_sites in tilings:
        stems = [f"conv_bn_relu_pool at {s.where} (convolution, batch norm, ReLU and max pool over "
                 f"{s.batch} samples, {s.tile} at a time in two passes; the reference holds "
                 f"{format_bytes(s.activation_bytes)} full-resolution activations and their gradients; "
                 f"the convolution runs 3x; statistics and gradients differ by summation order)" for s in stem_sites]
        variants.append(Variant(lines + stems + bn_line, partial(problem, forward, bns > 0)))
    return variants
