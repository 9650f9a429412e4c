"""``channels-last``: a convolutional network's image tensors stored NHWC, not NCHW.

PyTorch models compute in NCHW, but oneDNN's CPU convolutions, ATen's pooling and batch-norm
kernels are faster channels-last, and hold smaller workspaces (``bench/conv_layout.py``: one zoo
ResNet step's convolutions 0.86-0.88x, U-Net's 0.70-0.79x; largest workspace 2-3 MiB -> 0.6-1.1
MiB). Converting around each convolution costs more than it saves (1.06-1.17x), so the layout is
chosen for the whole graph (the layout assignment of XLA and TVM, done by hand in eager PyTorch with
``model.to(memory_format=torch.channels_last)``):

* every ``conv2d`` (and ``conv2d_input_grad``, a transposed convolution) of a rank-4 float input
  whose weight is at most twice as large as its input or output becomes its ``layout="NHWC"`` form; its
  input is transposed to NHWC where it is first needed so, but for the model's input, which the
  convolution reads in NCHW (``input_layout``: no transposed copy kept for the backward). Deep layers,
  where weights outweigh the feature maps, stay NCHW (no faster channels-last; larger workspaces);
* an NHWC value flows on through the ops that do not care or can be told: pooling and bilinear
  resizing (``layout``), batch norm (channel ``axis`` 3), element-wise ops (their broadcast operands
  reshaped: a [1, C, 1, 1] bias becomes [1, 1, 1, C], no copy), ``concat`` (axis remapped) and
  reductions whose result keeps NCHW's order (a global average pool to [N, C]). Pooling and resizing
  also run NHWC on an input that is NHWC data viewed as NCHW by transposes and reshapes (a
  sequence [N, H*W, C] read as an image, as Segformer's decoder does): its NHWC transpose is a
  reshape (``simplify``'s ``view_chain``), where eager PyTorch gets the same from the view's
  channels-last strides;
* any other op reads the value transposed back to NCHW (a ``reshape`` when only unit dimensions
  move), as does the function's result.

The pass runs on the forward before differentiation, so the backward is built in the same layout
(a ``transpose``'s cotangent is a transpose), and every budget plans the same program: gradients stay
bit-identical across budgets. Values equal the NCHW program's up to the kernels' summation order.

Weights: a parameter read only as the weight of NHWC convolutions is stored OHWI
(``weight_layout``): its bytes are those of the PyTorch weight in ``torch.channels_last`` memory
format, which oneDNN reads as it is, so neither the forward nor the backward copies it to that
format, and the weight gradient comes out OHWI without a copy back to OIHW (the zoo ResNet's step:
about 1 ms less). The caller passes such a parameter as the OHWI view of the channels-last weight
(``ohwi_params`` names them; ``remat.frontend.torch_import.ImportedModel.param_tensors`` does it).
Weights that the memory-lean convolution algorithms may take (a convolution over a concatenation,
a convolution -> batch norm -> ReLU -> max pool chain: ``remat.passes.concatconv``,
``remat.passes.convblock``) stay OIHW.
"""
from __future__ import annotations

import os
from dataclasses import replace

from ..ir import BlockArg, Builder, Function, Instruction, Module, Value
from ..ir.ops.nn import LAYOUT_OPERANDS as _LAYOUT_OPS, TO_NCHW, TO_NHWC, TO_OHWI
from ._rewrite import keeps_order, use_counts, view_root

OHWI_WEIGHTS = os.environ.get("REMAT_OHWI_WEIGHTS", "1") != "0"
"""Whether :func:`channels_last` stores the weights of NHWC convolutions OHWI by default
(``REMAT_OHWI_WEIGHTS=0``: no, they stay OIHW; ``bench/conv_layout.py``
compares the two)."""

_INV = TO_NCHW  # logical axis a sits at physical axis TO_NCHW[a] ((0, 3, 1, 2): C at 3, H at 1, W at 2)

_SEEDS = ("conv2d", "conv2d_input_grad")  # converted whatever their input's layout
_BATCH_NORM = {"batch_norm": (0,), "batch_norm_stats": (0,), "batch_norm_grad": (0, 1),  # activation operands
               "group_norm": (0,), "group_norm_grad": (0, 1)}
_AXIS_OPS = ("concat",)  # not softmax: over a short last axis (a segmentation head's classes) ATen is slow
_REDUCE_OPS = ("reduce_sum", "reduce_mean", "reduce_max")


def _seed(ins: Instruction) -> bool:
    """A convolution the pass makes NHWC whatever its input's layout: NCHW, of a rank-4 float input,
    activation-bound."""
    return (ins.op.name in _SEEDS and ins.attrs.get("layout") == "NCHW" and ins.operands[0].type.rank == 4
            and ins.operands[0].type.dtype.is_float and _activation_bound(ins))


def _activation_bound(ins: Instruction) -> bool:
    """A convolution whose weight has at most twice the elements of its input or output: channels-last
    pays there (ResNet/U-Net's early and middle layers: 0.7-0.9x the time). Deep layers with small maps
    and large weights stay NCHW: oneDNN is no faster channels-last there, and its channels-last
    weight gradient holds three weight-sized buffers where NCHW holds one (zoo ResNet small's last
    stage: 1.8 against 0.6 MiB, at the step's peak). Also with OHWI weights: taking them
    NHWC then dropped the stage's transposes (zoo ResNet small's step 0-4% faster, its unconstrained
    peak 1.3% lower), but raised the minimum budgets by the same weight-gradient workspaces (zoo
    ResNet small 8.02 -> 8.65 MiB, U-Net 8.53 -> 9.07 MiB)."""
    act = max(ins.operands[0].type.numel, ins.results[0].type.numel)
    return 2 * act >= ins.operands[1].type.numel


def _nhwc_view(v: Value) -> bool:
    """Whether ``v`` (NCHW) is computed by transposes and reshapes from a value that stores its elements
    in NHWC order, so that its NHWC transpose moves no data (``simplify``'s ``view_chain`` makes it a
    reshape): a sequence's ``[N, H*W, C]`` read as an image, ``transpose(1, 2).reshape(N, C, H, W)``."""
    return v.type.rank == 4 and view_root(v, [("transpose", TO_NHWC)]) is not None


class _Rewriter:
    def __init__(self, f: Function):
        self.f = f
        self.nhwc: dict[Value, Value] = {}   # value -> the same data stored NHWC
        self.plain: dict[Value, Value] = {}  # value computed NHWC only -> its NCHW version (made on demand)
        self.computed_nhwc: set[Value] = set()
        self.plain_results: dict[Value, Value] = {}  # old result -> the rewritten instruction's (same layout)
        self.b: Builder | None = None

    def _permute(self, v: Value, perm: tuple[int, ...]) -> Value:
        shape = v.type.shape
        if keeps_order(shape, [("transpose", perm)]):  # only unit dims move
            return self.b.op("reshape", v, shape=tuple(shape[p] for p in perm))
        return self.b.op("transpose", v, perm=perm)

    def to_nhwc(self, v: Value) -> Value:
        if v not in self.nhwc:
            self.nhwc[v] = self._permute(v, TO_NHWC)
        return self.nhwc[v]

    def to_plain(self, v: Value) -> Value:
        if v not in self.computed_nhwc:
            return v
        if v not in self.plain:
            self.plain[v] = self._permute(self.nhwc[v], TO_NCHW)
        return self.plain[v]

    def broadcast_operand(self, v: Value) -> Value:
        """An operand of an element-wise op whose rank-4 result is stored NHWC."""
        t = v.type
        if t.rank == 4:
            return self.to_nhwc(v)
        if t.numel == 1:
            return v  # a scalar broadcasts the same in any layout
        v4 = self.b.op("reshape", v, shape=(1,) * (4 - t.rank) + t.shape)
        return self.to_nhwc(v4)

    # ---- the rewrite of one instruction: the new instruction, or None to keep it (operands plain)
    def rewrite(self, ins: Instruction) -> Instruction | None:
        name = ins.op.name
        ops = [self.plain_results.get(v, v) for v in ins.operands]
        has = [v in self.nhwc for v in ops]

        def emit(operands, attrs, act_results):
            new = self.b.create(name, operands, attrs)
            for k, (old, r) in enumerate(zip(ins.results, new.results)):
                if k in act_results:
                    self.nhwc[old] = r
                    self.computed_nhwc.add(old)
                else:
                    self.plain_results[old] = r
            return new

        if name in _LAYOUT_OPS and ins.attrs.get("layout") == "NCHW":
            acts, outs, shape_attr = _LAYOUT_OPS[name]
            if not all(ops[a].type.rank == 4 for a in acts):
                return None
            if name in _SEEDS:
                if not _seed(ins):
                    return None
            elif not any(has[a] or _nhwc_view(ops[a]) for a in acts):
                return None
            attrs = {**ins.attrs, "layout": "NHWC"}
            if shape_attr is not None:
                attrs[shape_attr] = tuple(attrs[shape_attr][i] for i in TO_NHWC)
            if name == "conv2d" and isinstance(ops[0], BlockArg) and ops[0] not in self.nhwc:
                # The model's input: read as it is (ATen converts it on the fly), so that the step does
                # not keep a transposed copy of it until the weight gradient at the end of the backward.
                return emit([ops[0], ops[1]], {**attrs, "input_layout": "NCHW"}, outs)
            return emit([self.to_nhwc(v) if i in acts else v for i, v in enumerate(ops)], attrs, outs)
        if name in _BATCH_NORM and ins.attrs.get("axis") == 1:
            acts = _BATCH_NORM[name]
            if not (ops[acts[-1]].type.rank == 4 and any(has[a] for a in acts)):
                return None
            return emit([self.to_nhwc(v) if i in acts else v for i, v in enumerate(ops)], {**ins.attrs, "axis": 3},
                        (0,) if name != "batch_norm_stats" else ())
        if ins.op.has("elementwise") and len(ins.results) == 1 and ins.results[0].type.rank == 4 and any(has):
            return emit([self.broadcast_operand(v) for v in ops], dict(ins.attrs), (0,))
        if name in _AXIS_OPS and ops and ops[0].type.rank == 4 and any(has):
            return emit([self.to_nhwc(v) for v in ops], {**ins.attrs, "axis": _INV[ins.attrs["axis"]]}, (0,))
        if name in _REDUCE_OPS and has[0] and ops[0].type.rank == 4:
            axes = ins.attrs["axes"]
            attrs = {**ins.attrs, "axes": tuple(sorted(_INV[a] for a in axes))}
            if ins.attrs["keepdims"]:
                return emit([self.to_nhwc(ops[0])], attrs, (0,))
            left = [TO_NHWC[p] for p in range(4) if TO_NHWC[p] not in axes]
            if left == sorted(left):  # the result is the same in both layouts (e.g. [N, C])
                return emit([self.to_nhwc(ops[0])], attrs, ())
        return None

    def run(self) -> None:
        block = self.f.blocks[0]
        i = 0
        while i < len(block.instrs):
            ins = block.instrs[i]
            self.b = Builder(block, index=i, loc=ins.loc)
            if self.rewrite(ins) is not None:
                del block.instrs[self.b.index]  # ins, now after what replaced it
                i = self.b.index
                continue
            ins.operands = [self.to_plain(self.plain_results.get(v, v)) for v in ins.operands]
            i = self.b.index + 1


def _algorithm_convs(f: Function, uses: dict[Value, int]) -> set[Instruction]:
    """The convolutions a memory-lean algorithm may rewrite (their weights stay OIHW)."""
    from . import concatconv, convblock

    out = {ins for ins in f.instructions() if ins.op.name == "conv2d" and concatconv._match(ins, uses) is not None}
    for ins in f.instructions():
        if ins.op.name in ("max_pool2d", "max_pool2d_with_indices"):
            m = convblock._match(ins, uses)
            if m is not None:
                out.add(m[0])
    return out


def _weight_readers(f: Function) -> dict[Value, list[Instruction]]:
    """For each float rank-4 parameter of ``f`` that only ``conv2d`` s read, as their OIHW weight
    and nothing else, those convolutions, but for the ones a memory-lean algorithm may rewrite."""
    uses = use_counts(f)
    readers: dict[Value, list[Instruction]] = {p: [] for p in f.params if p.type.rank == 4 and p.type.dtype.is_float}
    for ins in f.instructions():
        for v in ins.operands:
            if v in readers:
                readers[v].append(ins)
    skip = _algorithm_convs(f, uses)
    return {p: users for p, users in readers.items()
            if users and all(ins.op.name == "conv2d" and ins not in skip and ins.operands[1] is p
                             and ins.operands[0] is not p and ins.attrs.get("weight_layout", "OIHW") == "OIHW"
                             for ins in users)}


def _weights_ohwi(f: Function) -> None:
    """Store OHWI every weight of :func:`_weight_readers` whose convolutions are all NHWC."""
    for p, users in _weight_readers(f).items():
        if all(ins.attrs.get("layout") == "NHWC" for ins in users):
            p.type = p.type.with_shape(tuple(p.type.shape[i] for i in TO_OHWI))
            for ins in users:
                ins.attrs = {**ins.attrs, "weight_layout": "OHWI"}


def ohwi_params(f: Function) -> tuple[int, ...]:
    """The indices of ``f``'s parameters stored OHWI: read only as convolution weights with
    ``weight_layout="OHWI"`` (the caller passes them as OHWI views of channels-last weights)."""
    index = {p: i for i, p in enumerate(f.params)}
    ohwi: dict[int, bool] = {}
    for ins in f.instructions():
        for k, v in enumerate(ins.operands):
            i = index.get(v)
            if i is not None:
                ohwi[i] = ohwi.get(i, True) and k == 1 and ins.attrs.get("weight_layout") == "OHWI"
    return tuple(sorted(i for i, yes in ohwi.items() if yes))


def _eligible(f: Function) -> bool:
    """A one-block function with a convolution the pass makes NHWC."""
    return not f.is_declaration and len(f.blocks) == 1 and any(_seed(ins) for ins in f.blocks[0].instrs)


def channels_last(module: Module, weights: bool | None = None) -> Module:
    """The ``channels-last`` pass: a copy of ``module`` whose functions with convolutions compute
    them, and what follows them, in NHWC (see the module's doc); ``module`` itself when none has one.
    Functions of several blocks are left as they are. ``weights``: also store the weights of NHWC
    convolutions OHWI (see the module's doc; None: :data:`OHWI_WEIGHTS`)."""
    if not any(_eligible(f) for f in module):
        return module
    weights = OHWI_WEIGHTS if weights is None else weights
    out = module.clone()
    for f in out:
        if _eligible(f):
            _Rewriter(f).run()
            if weights:
                _weights_ohwi(f)
    return out


__all__ = ["OHWI_WEIGHTS", "channels_last", "ohwi_params"]


def with_layout(imported, option: str):
    """An imported model (``remat.frontend.torch_import.ImportedModel``) with its forward in the
    layout ``option`` asks for: channels-last under "auto" (``ohwi`` naming its OHWI weights), as
    captured under "NCHW"; ``imported`` itself when nothing changes."""
    if option == "NCHW":
        return imported
    module = channels_last(imported.module)
    if module is imported.module:
        return imported
    function = module[imported.function.name]
    return replace(imported, module=module, function=function, ohwi=ohwi_params(function))
