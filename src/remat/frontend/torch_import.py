"""Import a vanilla PyTorch ``nn.Module`` (optionally with its loss) as a remat IR function.

The model is captured with ``torch.export.export``, decomposed to core ATen, and each ATen op is
translated by a rule of ``remat.frontend._aten``. The entry function's parameters are, in order:

1. the model's parameters, in ``model.named_parameters()`` order (tied weights appear once),
2. its buffers, in ``model.named_buffers()`` order (running statistics, masks …), then any
   tensor constants the trace lifted,
3. the user inputs (model inputs, then loss targets when a loss function is given),
4. an ``i64[]`` dropout seed, only if some dropout is active (each dropout uses ``fold_seed(seed, k)``).

Its results are the loss (or the model's outputs), then the new value of every buffer the forward
updates (batch-norm running statistics in training mode), in the order of ``output_names``.
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import os
import re
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .._gc import cyclic_gc_paused
from ..ir import Builder, DType, Function, Loc, Module, TensorType, Value, parse, print_module, verify
from ..passes import run
from . import capture_cache
from .reads import LossReads
from ._aten import LOWERINGS, SUPPORTED, Lowerer, LoweringError, decomposition_tables, to_dtype

__all__ = ["ImportedModel", "ModelOutputError", "Unsupported", "UnsupportedOpError", "import_module", "keyword_inputs",
           "keyword_options", "loss_module", "supported_ops"]

_SEED = TensorType(DType.i64, ())
# Passes that clean up the imported forward before anything differentiates it: explicit attention,
# written-out GELU and log_softmax -> nll_loss become single ops (their backward is then the native
# one), and what that leaves dead goes.
IMPORT_PASSES: list[str] = ["attention", "gelu", "cross-entropy", "dce"]
_TORCH_DIR = os.path.dirname(torch.__file__)
_CWD = os.getcwd() + os.sep  # source files under it are recorded relative to it
_SKIPPED = object()  # the value of a node not translated (unsupported, or computed from one)


class _MissingOutput(Exception):
    """A node reads an output of ``node`` that its translation does not compute."""

    def __init__(self, node: "torch.fx.Node"):
        super().__init__(str(node.target))
        self.node = node


@dataclass(frozen=True)
class Unsupported:
    """One untranslatable node: the ATen op, the submodule it came from, the user source line, and
    why (empty: remat has no translation for the op at all)."""

    op: str
    module_path: str
    source: str
    reason: str = ""


class UnsupportedOpError(NotImplementedError):
    """The model uses ATen ops (or ops' variants) that remat cannot translate: all of them at once.

    ``problems`` lists every untranslatable node (:class:`Unsupported`), in graph order; ``ops`` the
    distinct ops. ``op``, ``module_path`` and ``source`` are the first problem's. The message groups
    the problems by op with their counts and places (at most :attr:`MAX_OPS` ops and
    :attr:`MAX_PLACES` places per op are spelled out), then names the translated ops closest to the
    first by name (``SUPPORTED`` lists them all).
    """

    MAX_OPS = 20
    MAX_PLACES = 3

    def __init__(self, op: str = "", module_path: str = "", source: str = "", reason: str = "", *,
                 problems: Sequence[Unsupported] = ()):
        self.problems = list(problems) or [Unsupported(op, module_path, source, reason)]
        first = self.problems[0]
        self.op, self.module_path, self.source = first.op, first.module_path, first.source
        self.ops = list(dict.fromkeys(p.op for p in self.problems))
        super().__init__(self._message())

    def _message(self) -> str:
        import difflib

        near = difflib.get_close_matches(self.op.removeprefix("aten."), [s.removeprefix("aten.") for s in SUPPORTED],
                                         n=5, cutoff=0.5)
        supported = (f"remat translates {len(SUPPORTED)} ATen ops (remat.frontend.torch_import.SUPPORTED lists them)"
                     + (f"; those closest by name to {self.op.removeprefix('aten.')}: {', '.join(near)}" if near else ""))
        by_op: dict[str, list[Unsupported]] = {}
        for p in self.problems:
            by_op.setdefault(p.op, []).append(p)
        if len(self.problems) == 1:
            p = self.problems[0]
            lines = [f"unsupported PyTorch op {p.op} {_place(p.module_path)}{_why(p.reason)}",
                     f"  from: {p.source or '(source unknown)'}"]
        else:
            lines = [f"the model uses {len(by_op)} PyTorch op{'s' if len(by_op) > 1 else ''} that remat cannot "
                     f"translate, at {len(self.problems)} places:"]
            for op, ps in list(by_op.items())[: self.MAX_OPS]:
                reasons = list(dict.fromkeys(p.reason for p in ps))
                why = _why(reasons[0]) if len(reasons) == 1 else ": " + "; ".join(r or "no translation" for r in reasons[:3])
                lines.append(f"  {op}: {len(ps)} use{'s' if len(ps) > 1 else ''}{why}")
                for p in ps[: self.MAX_PLACES]:
                    lines.append(f"    {_place(p.module_path)}, from: {p.source or '(source unknown)'}")
                if len(ps) > self.MAX_PLACES:
                    more = len(ps) - self.MAX_PLACES
                    lines.append(f"    ... and {more} more place{'s' if more > 1 else ''}")
            if len(by_op) > self.MAX_OPS:
                rest = list(by_op)[self.MAX_OPS:]
                lines.append(f"  ... and {len(rest)} more ops: {', '.join(rest)}")
        return "\n".join(lines) + f"\n{supported}"


def _place(module_path: str) -> str:
    return f"in module '{module_path}'" if module_path else "at the top level of the model"


def _why(reason: str) -> str:
    return f": {reason}" if reason else " (remat has no translation for it)"


class CaptureError(RuntimeError):
    """PyTorch could not capture or decompose the model; ``stage`` says which step failed and
    ``failures`` what each attempt raised (the first lines of each error)."""

    def __init__(self, stage: str, failures: Sequence[str], eager_error: str | None = None, where: str | None = None):
        self.stage, self.failures, self.eager_error, self.where = stage, list(failures), eager_error, where
        shown = "\n".join("  " + "\n    ".join(f.strip().splitlines()[:3]) for f in failures)
        if eager_error is not None:
            hint = ("the model itself raises on these example inputs when run eagerly, so this is not a tracing "
                    f"problem: fix the model or its inputs\n  eager: {eager_error}\n  torch.export:")
        elif stage.startswith("capture"):
            at = f" at {where}" if where else ""
            hint = (f"the model's Python could not be traced{at}; make it traceable by torch.export (no "
                    "data-dependent control flow on tensor values); if that line computes the model's own "
                    "loss from its labels (a Hugging Face model given labels=), compile without them and "
                    "give a loss_fn applied to the logits instead, e.g. remat.compile(model, dict(input_ids=x, "
                    "target=y), loss_fn=torch.nn.functional.cross_entropy)")
        else:
            hint = "PyTorch's decompositions failed on the captured graph with every table remat tried"
        super().__init__(f"importing the model failed at {stage}: {hint}\n{shown}")


class ModelOutputError(TypeError):
    """The model's output does not hold what the step needs: a ``ModelOutput`` or dict without
    ``loss`` (no loss function given) or without ``logits`` (a loss function given)."""


class TranslationError(RuntimeError):
    """A translation rule produced a value whose type differs from PyTorch's: a bug in remat."""


def supported_ops() -> tuple[str, ...]:
    """The ATen overloads the importer translates, e.g. ``'aten.convolution.default'``."""
    return SUPPORTED


def ohwi_view(t: torch.Tensor) -> torch.Tensor:
    """The [O, kH, kW, I] view of the convolution weight ``t`` ([O, I, kH, kW]), contiguous: ``t``
    is first stored in ``torch.channels_last`` memory format unless it already is, in place (same
    object, values, shape and storage: its bytes are reordered within its own storage, so that
    references to the tensor and its storage stay the model's; what ``model.to(memory_format=
    torch.channels_last)`` does with a new storage). A function taking the weight OHWI
    (``weight_layout``) reads and updates these bytes."""
    if not t.is_contiguous(memory_format=torch.channels_last):
        if not t.is_contiguous():
            raise ValueError(f"a convolution weight of shape {tuple(t.shape)} with strides {t.stride()} is neither "
                             "contiguous nor channels-last: remat stores it channels-last in place; give the model "
                             "dense weights (e.g. .contiguous()) or compile with layout='NCHW'")
        with torch.no_grad():
            values = t.detach().clone()
            strides = torch.empty_like(values, memory_format=torch.channels_last).stride()
            t.set_(t.untyped_storage(), t.storage_offset(), t.shape, strides)
            t.copy_(values)
    return t.detach().permute(0, 2, 3, 1)


def ohwi_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous [O, kH, kW, I] copy of the convolution weight ``t``, which stays as it is."""
    return t.detach().permute(0, 2, 3, 1).clone(memory_format=torch.contiguous_format)


@dataclass
class ImportedModel:
    """A PyTorch model as a remat module. ``function`` takes
    ``(*param_tensors(), *inputs[, seed])`` and returns the values named by ``output_names``.

    The model's tensors come in the order ``param_names`` (the trainable parameters: those with
    ``requires_grad`` that some output depends on, which training differentiates and updates),
    ``frozen_names`` (the other parameters: frozen with ``requires_grad=False``, or computed
    with but never reaching an output, so that eager PyTorch leaves their ``.grad`` None and its
    optimizers skip them), ``buffer_names``, ``constant_names``."""

    module: Module
    function: Function
    param_names: list[str]
    buffer_names: list[str]
    input_count: int
    has_seed: bool
    output_names: list[str]
    constant_names: list[str] = field(default_factory=list)
    frozen_names: list[str] = field(default_factory=list)
    input_names: tuple[str, ...] | None = None  # keyword names of the inputs, in order (None: positional)
    _tensors: list[torch.Tensor] = field(default_factory=list, repr=False)
    _state: list[tuple[str, str]] = field(default_factory=list, repr=False)  # (kind, export name) per tensor
    from_cache: bool = False  # rebuilt from the capture cache (no torch.export ran)
    ohwi: tuple[int, ...] = ()  # parameters the function takes OHWI (remat.passes.layout.ohwi_params)

    @property
    def state_count(self) -> int:
        """Number of leading function parameters holding the model's own tensors."""
        return len(self.param_names) + len(self.frozen_names) + len(self.buffer_names) + len(self.constant_names)

    def __remat_function__(self) -> Function:
        """The entry function, so that ``remat.run(imported, *imported.arguments(...))`` works."""
        return self.function

    def param_tensors(self, copy: bool = False) -> list[torch.Tensor]:
        """The model's parameters, buffers and lifted constants, in function-parameter order
        (the live tensors of the model, detached; with ``copy``, copies of them). A weight the
        function takes OHWI (``ohwi``) is the OHWI view of the live weight, which is stored
        channels-last first if it is not (:func:`ohwi_view`; as ``model.to(memory_format=
        torch.channels_last)`` does); with ``copy``, a contiguous OHWI copy (the model untouched)."""
        if copy:
            ts = [t.detach().clone() for t in self._tensors]
            for i in self.ohwi:
                ts[i] = ohwi_copy(self._tensors[i])
            return ts
        ts = [t.detach() for t in self._tensors]
        for i in self.ohwi:
            ts[i] = ohwi_view(self._tensors[i])
        return ts

    def arguments(self, *inputs: torch.Tensor | np.ndarray, seed: int = 0) -> list[np.ndarray]:
        """All function arguments as NumPy arrays: the model's tensors, ``inputs``, and the seed if any."""
        if len(inputs) != self.input_count:
            raise TypeError(f"the imported function takes {self.input_count} input(s) after the model's tensors, "
                            f"got {len(inputs)}")
        args = [_to_numpy(t) for t in self.param_tensors()] + [_to_numpy(x) for x in inputs]
        if self.has_seed:
            args.append(np.array(seed, dtype=np.int64))
        return args


def _to_numpy(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class _WithLoss(torch.nn.Module):
    """``loss_fn(model(*inputs), *targets)`` as one module, so that export sees the whole step.

    Hugging Face conventions: with ``input_names`` the model's inputs are passed as keywords; a
    ``ModelOutput`` or dict output gives its ``loss`` (no ``loss_fn``) or its ``logits`` (to ``loss_fn``)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None, n_inputs: int,
                 input_names: Sequence[str] | None = None, options: Mapping[str, Any] | None = None,
                 autocast: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.n_inputs = n_inputs
        self.input_names = None if input_names is None else tuple(input_names)[:n_inputs]
        self.options = dict(options or {})  # keyword options (keyword_options), passed as they are
        self.autocast = autocast  # the forward and loss run under torch.autocast in this dtype (None: not)

    def forward(self, *args: torch.Tensor) -> Any:
        if self.autocast is None:
            return self._forward(*args)
        device = next(iter(self.model.parameters()), torch.empty(0)).device.type
        with torch.autocast(device, dtype=self.autocast):
            return self._forward(*args)

    def _forward(self, *args: torch.Tensor) -> Any:
        model_args = args[:self.n_inputs]
        if self.input_names is None:
            out = self.model(*model_args)
        else:
            out = self.model(**dict(zip(self.input_names, model_args)), **self.options)
        out = _loss_or_logits(out, want_loss=self.loss_fn is None)
        if self.loss_fn is None:
            return out
        try:
            return self.loss_fn(out, *args[self.n_inputs:])
        except TypeError as e:
            if not isinstance(out, Mapping):
                raise
            raise ModelOutputError(f"the model returned a {type(out).__name__} without 'logits' (fields: {_fields(out)}), so "
                                   f"the loss_fn was given the output itself, as eagerly, and raised {type(e).__name__}: "
                                   f"{e}. Read the field it needs in the loss_fn (diffusers: `out.sample`), or give "
                                   "no loss_fn and let the model compute its own 'loss' (e.g. labels=...)") from e


def _fields(out: Mapping) -> str:
    """The fields a model output holds (those not None), for messages."""
    return ", ".join(k for k, v in out.items() if v is not None) or "none"


def _loss_or_logits(out: Any, want_loss: bool) -> Any:
    """A ``ModelOutput``/dict's ``loss`` (the model computes its own loss) or ``logits`` (for a
    loss function; without ``logits``, the output itself, as eager code hands it to its loss:
    diffusers' ``out.sample``); any other output is returned as it is."""
    if not isinstance(out, Mapping):
        return out
    key = "loss" if want_loss else "logits"
    if out.get(key) is not None:
        return out[key]
    if not want_loss:
        return out
    raise ModelOutputError(f"the model returned a {type(out).__name__} without 'loss' (fields: {_fields(out)}) and no loss_fn was "
                           "given: pass the targets as keyword inputs the model takes (e.g. labels=...) so that "
                           "it computes its own loss, or give a loss_fn (applied to its 'logits')")


def keyword_inputs(example_inputs: Sequence | Mapping, loss_fn: Callable[..., Any] | None,
                   num_targets: int | None = None) -> tuple[tuple[str, ...] | None, tuple, int | None]:
    """``(names, tensors, num_targets)`` of positional or keyword example inputs.

    Positional inputs come back unchanged with ``names`` None. A mapping ``{name: tensor}`` gives
    the model's keyword inputs (such as ``input_ids=``, ``attention_mask=``, ``labels=``); with a
    ``loss_fn``, the entries named after its target parameters (``loss_fn(output, target)``:
    ``target=``) are its targets. The tensors are ordered model inputs first, then targets in the
    loss's parameter order; ``names`` follows the same order."""
    if not isinstance(example_inputs, Mapping):
        return None, tuple(example_inputs), num_targets
    bad = [k for k in example_inputs if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise TypeError(f"keyword example inputs need identifier names, got {bad!r}")
    options = keyword_options(example_inputs)
    example_inputs = {k: v for k, v in example_inputs.items() if k not in options}
    targets: list[str] = []
    if loss_fn is not None:
        try:
            params = _loss_parameters(loss_fn)
        except (TypeError, ValueError):
            raise TypeError("cannot read the loss function's signature to find its targets among the keyword "
                            "inputs; pass the inputs positionally with num_targets=") from None
        names = [p.name for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        targets = [n for n in names if n in example_inputs]
        if not targets:
            raise TypeError(f"keyword example inputs with a loss_fn: name its target(s) after the loss's parameters "
                            f"({', '.join(names) or 'it has none after the output'}), e.g. "
                            f"{{'input_ids': x, {names[0] if names else 'target'!r}: y}}; got keys "
                            f"{list(example_inputs)}. Or give no loss_fn and pass labels= for the model's own loss")
        if num_targets is not None and int(num_targets) != len(targets):
            raise TypeError(f"num_targets={num_targets} but the keyword inputs name {len(targets)} target(s) of the "
                            f"loss: {targets}")
    model_keys = [k for k in example_inputs if k not in targets]
    if not model_keys:
        raise TypeError("keyword example inputs name no input of the model")
    order = model_keys + targets
    return tuple(order), tuple(example_inputs[k] for k in order), (len(targets) if loss_fn is not None else None)


OPTION_TYPES = (bool, int, float, str, type(None))


def keyword_options(example_inputs: Sequence | Mapping) -> dict[str, Any]:
    """The entries of keyword example inputs that are options, not tensors (CLIP's ``return_loss=True``,
    ``use_cache=False``): Python scalars, strings or None, passed to the model as they are. They are
    part of what is compiled: the step is called with the same values or without them. Other
    non-tensor values raise TypeError."""
    if not isinstance(example_inputs, Mapping):
        return {}
    out = {}
    for k, v in example_inputs.items():
        if isinstance(v, (torch.Tensor, np.ndarray)):
            continue
        if not isinstance(v, OPTION_TYPES):
            raise TypeError(f"keyword example input {k}={v!r} is a {type(v).__name__}: keyword inputs are tensors (the "
                            f"step's arguments) or options passed to the model as they are (bool, int, float, str, "
                            f"None); bind anything else into the model")
        out[k] = v
    return out


_PREFIX = "model."


def _strip(name: str) -> str:
    return name[len(_PREFIX):] if name.startswith(_PREFIX) else name


def _loss_parameters(loss_fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The loss function's parameters; a loss module's (``nn.CrossEntropyLoss()``) are its ``forward``'s."""
    fn = loss_fn.forward if isinstance(loss_fn, torch.nn.Module) else loss_fn
    return list(inspect.signature(fn).parameters.values())


def _count_targets(loss_fn: Callable[..., Any]) -> int:
    try:
        params = _loss_parameters(loss_fn)
    except (TypeError, ValueError):
        raise TypeError("cannot read the loss function's signature; pass num_targets=") from None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise TypeError("the loss function takes *args; pass num_targets= to say how many inputs are targets")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if not positional:
        raise TypeError("the loss function must take the model output as its first argument: loss_fn(output, *targets)")
    return len(positional) - 1


def _where(node: torch.fx.Node) -> tuple[str, str]:
    """The submodule path and the innermost user source line (outside torch) that produced a node.

    Nodes made by a decomposition may carry no trace of their own; then the nearest node around
    them that has one (their inputs, then their users) names the place, marked "near"."""
    path, source = _where_own(node)
    if source:
        return path, source
    seen, frontier = {node}, [node]
    for _ in range(4):  # a few steps out along the graph's edges
        nxt = []
        for n in frontier:
            for m in list(n.all_input_nodes) + list(n.users):
                if m not in seen and m.op == "call_function":
                    seen.add(m)
                    nxt.append(m)
        for m in nxt:
            p, src = _where_own(m)
            if src:
                return path or p, f"near {src}"
        frontier = nxt
    return path, source


def _where_own(node: torch.fx.Node) -> tuple[str, str]:
    """The submodule path and the innermost user source line (outside torch, else the innermost
    frame) that produced a node, without looking at its neighbours."""
    path, frame, code = _origin(node)
    return path, (f"{frame}: {code}" if code else frame)


_FRAME = re.compile(r'File "(?P<file>[^"]*)", line (?P<line>\d+)')


def _origin(node: torch.fx.Node) -> tuple[str, str, str]:
    """(submodule path, innermost user frame 'File "...", line N, in f' outside torch, its code); the
    innermost frame of all when no user frame is outside torch."""
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        path = _strip(list(stack.values())[-1][0])
        path = "" if path == "model" else path
    trace = node.meta.get("stack_trace") or ""
    lines = trace.strip().splitlines()
    innermost = ("", "")
    for i in range(len(lines) - 1, -1, -1):  # frames: 'File "...", line N, in f' followed by the code
        s = lines[i].strip()
        if s.startswith("File "):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            innermost = innermost if innermost[0] else (s, code)
            if _TORCH_DIR not in s and __file__ not in s:
                return path, s, code
    return path, *innermost


def _loc(node: torch.fx.Node) -> Loc:
    """The IR location of a node: its submodule path and user source file (relative to the working
    directory when inside it) and line."""
    path, frame, _ = _origin(node)
    m = _FRAME.match(frame)
    if m is None:
        return Loc(path)
    file = m["file"]
    if file.startswith(_CWD):
        file = file[len(_CWD):]
    return Loc(path, file, int(m["line"]))


def distinct_tensors(tensors: Sequence) -> tuple:
    """``tensors`` with each tensor that is passed again (``labels=input_ids``) cloned at its later
    places. ``torch.export`` captures one tensor passed as two inputs as one input: the program would
    read the first input for both at every later call, whatever tensors the call passes."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            if id(t) in seen:
                t = t.clone()
            seen.add(id(t))
        out.append(t)
    return tuple(out)


def without_data(tensors: Sequence) -> bool:
    """Whether any of ``tensors`` holds no values: a tensor on the ``meta`` device or a fake tensor
    (``torch._subclasses.FakeTensor``), as a dry run plans with (``remat.compile(..., dry_run=True)``)."""
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(t, torch.Tensor) and (t.is_meta or is_fake(t)) for t in tensors)


def import_module(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                  loss_fn: Callable[..., torch.Tensor] | None = None, *, train: bool | None = True,
                  num_targets: int | None = None, name: str = "forward", cache: bool | None = None,
                  autocast: torch.dtype | None = None) -> ImportedModel:
    """Translate ``model`` (and ``loss_fn`` if given) into a remat module.

    ``example_inputs`` are the model's inputs followed, when ``loss_fn`` is given, by its targets:
    the function computes ``loss_fn(model(*inputs), *targets)``, the number of targets being
    ``num_targets`` or else the loss function's positional parameters after the output.
    A mapping passes the model's inputs as keywords (:func:`keyword_inputs`); a model returning a
    ``ModelOutput`` or dict contributes its ``loss`` (no ``loss_fn``) or its ``logits`` (to ``loss_fn``).
    ``train`` selects training-mode semantics (batch statistics and running-stat updates in batch
    norm, active dropout) or eval mode for every submodule; None: each submodule's own mode, as
    eager PyTorch runs it (a frozen, pretrained part in eval inside a model in training). Shapes are static: those of ``example_inputs``.
    Raises :class:`UnsupportedOpError` naming the op, the submodule and the source line when an op
    has no translation. ``cache``: reuse (and fill) the on-disk cache of captures
    (:mod:`remat.frontend.capture_cache`); None: as ``$REMAT_CAPTURE_CACHE`` says (default on).
    ``autocast``: capture the forward and the loss under ``torch.autocast`` in this dtype (mixed
    precision as torch.autocast's op lists decide it: the casts are instructions of the IR).
    """
    options = keyword_options(example_inputs)
    input_names, example_inputs, num_targets = keyword_inputs(example_inputs, loss_fn, num_targets)
    example_inputs = distinct_tensors(example_inputs)
    n_targets = 0
    if loss_fn is not None:
        n_targets = _count_targets(loss_fn) if num_targets is None else int(num_targets)
    n_inputs = len(example_inputs) - n_targets
    if n_inputs < 0:
        raise TypeError(f"the loss function takes {n_targets} target(s) but only {len(example_inputs)} example inputs were given")
    wrapper = _WithLoss(model, loss_fn, n_inputs, input_names, options, autocast)
    was_training = [m.training for m in model.modules()]
    if train is None:
        wrapper.training = model.training
    else:
        wrapper.train(train)
    key = None
    try:
        if capture_cache.enabled(cache):
            try:
                key = capture_cache.capture_key(wrapper, tuple(example_inputs), {
                    "train": train, "n_inputs": n_inputs, "n_targets": n_targets, "has_loss": loss_fn is not None,
                    "input_names": input_names, "name": name, "options": sorted(options.items()),
                    "autocast": str(autocast), "loss_reads": _loss_reads_key(loss_fn, model)})
            except capture_cache.Uncacheable:
                key = None
            entry = None if key is None else capture_cache.load(key)
            if entry is not None:
                try:
                    with cyclic_gc_paused():
                        imported = _from_entry(entry, wrapper)
                except Exception as e:  # noqa: BLE001  an entry remat cannot read back: captured again
                    capture_cache.discard(key, f"it cannot be read back ({type(e).__name__}: {e})")
                    imported = None
                if imported is not None:
                    why = stale_capture(imported, wrapper, tuple(example_inputs))
                    if why is None:
                        imported.input_names = input_names
                        return imported
                    capture_cache.discard(key, f"the cached capture no longer matches the model's eager output "
                                               f"({why}): captured again", keep_quiet=why == _UNCHECKED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            ep = _capture(wrapper, example_inputs)
    finally:
        for m, t in zip(model.modules(), was_training):
            m.training = t
    with cyclic_gc_paused():
        imported = _translate(ep, wrapper, n_inputs + n_targets, loss_fn is not None, name)
    imported.input_names = input_names
    if key is not None:
        capture_cache.store(key, _to_entry(imported, ep), capture_cache.trace_files(ep.graph_module.graph)
                            | capture_cache.class_files(wrapper))
    return imported


def _loss_reads_key(loss_fn, model: torch.nn.Module) -> list:
    """What the loss function reads (:class:`~remat.frontend.reads.LossReads`: a global loss weight,
    a config's field), for the capture's key: a capture made at one value is not another's. Tensors
    are left to the key's description of the function and to :func:`stale_capture`."""
    if loss_fn is None:
        return []
    return [[label, repr(d)] for label, d in LossReads(loss_fn, model).now() if d[0] != "tensor"]


def _to_entry(imported: ImportedModel, ep: "torch.export.ExportedProgram") -> capture_cache.Entry:
    """What the capture cache keeps of an import: the IR as text, the names, the lifted constants."""
    state = [[kind, target] for kind, target in imported._state]
    constants = {t: ep.constants[t] for kind, t in imported._state if kind == "constant"}
    fields = {"param_names": imported.param_names, "frozen_names": imported.frozen_names,
              "buffer_names": imported.buffer_names,
              "input_count": imported.input_count, "has_seed": imported.has_seed,
              "output_names": imported.output_names, "constant_names": imported.constant_names}
    return capture_cache.Entry(print_module(imported.module), imported.function.name, state, fields, constants)


def _from_entry(entry: capture_cache.Entry, wrapper: torch.nn.Module) -> ImportedModel | None:
    """An import rebuilt from a cache entry, its tensors those of ``wrapper`` (the live model); None
    if the entry names a tensor the model lacks (then the model is captured afresh)."""
    named = {"param": dict(wrapper.named_parameters()), "buffer": dict(wrapper.named_buffers()),
             "constant": entry.constants}
    if any(t not in named.get(k, {}) for k, t in entry.state):
        return None
    module = parse(entry.ir)
    return ImportedModel(module=module, function=module[entry.function], _tensors=[named[k][t] for k, t in entry.state],
                         _state=[(k, t) for k, t in entry.state], from_cache=True, **entry.fields)


def loss_module(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                loss_fn: Callable[..., torch.Tensor] | None = None, num_targets: int | None = None
                ) -> tuple[torch.nn.Module, tuple]:
    """The module :func:`import_module` captures, ``wrapper(*tensors) -> loss`` (eager PyTorch), and
    the example inputs as its positional tensors: to evaluate the same loss eagerly."""
    input_names, tensors, num_targets = keyword_inputs(example_inputs, loss_fn, num_targets)
    n_targets = 0
    if loss_fn is not None:
        n_targets = _count_targets(loss_fn) if num_targets is None else int(num_targets)
    return _WithLoss(model, loss_fn, len(tensors) - n_targets, input_names, keyword_options(example_inputs)), tensors


class _OutsideLeaves(TorchFunctionMode):
    """Records the real tensors a torch function reads that require a gradient and are leaves
    (``nn.Parameter`` s and the like) but are neither ``own`` (the model's parameters and the inputs,
    by id) nor, in an ``eager`` run, made during it (a tensor the forward marks ``requires_grad_()``,
    as an activation checkpointing hook does, is a leaf when it runs without grad), with the
    innermost place in the user's code that read each: the trace lifts such a tensor as a constant
    (its value copied), so it would get no gradient and never train."""

    def __init__(self, own: set[int], eager: bool = False) -> None:
        super().__init__()
        self.own, self.eager = own, eager
        self.made: set[int] = set()  # tensors an eager run made (a forward may mark one ``requires_grad_()``)
        self.found: dict[int, tuple[torch.Tensor, str | None]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):  # (torch.cat takes a list)
            if not isinstance(a, torch.Tensor) or isinstance(a, FakeTensor) or not (a.requires_grad and a.is_leaf):
                continue
            if a._is_view():  # a view made without grad (the eager check runs so) of a parameter is a leaf too
                a = a._base
            if id(a) not in self.own and id(a) not in self.made and id(a) not in self.found:
                import traceback

                frames = [(f.filename, f.lineno, f.line) for f in traceback.extract_stack()[:-1]]
                self.found[id(a)] = (a, _user_frame(frames))
        out = func(*args, **kwargs)
        if self.eager:  # (a trace's tensors are fake: skipped above)
            self.made.update(id(t) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    def refuse(self) -> None:
        """TypeError naming each such tensor (shape, dtype, where the model or the loss read it)."""
        if not self.found:
            return
        shown = "; ".join(f"a {'Parameter' if isinstance(t, torch.nn.Parameter) else 'tensor'} of shape "
                          f"{list(t.shape)} ({str(t.dtype).removeprefix('torch.')})"
                          + (f" read at {where}" if where else "") for t, where in list(self.found.values())[:3])
        more = f" and {len(self.found) - 3} more" if len(self.found) > 3 else ""
        raise TypeError(f"the forward or the loss reads {shown}{more}, which requires grad but is not a parameter "
                        "of the model: remat would capture it as a constant, and it would get no gradient and "
                        "never train. Make it a parameter of the model (e.g. `model.temperature = "
                        "nn.Parameter(...)`, read as `model.temperature` by the loss), or detach it "
                        "(`t.detach()`) if it is not meant to train")


@contextlib.contextmanager
def _quiet_export_failure():
    """What ``torch.export`` prints to stderr while it runs is passed on, but for what only restates its
    failure, which :class:`CaptureError` reports with the place in the model's code: the partial
    traced graph it prints on a failed trace, and torch's symbolic-shapes warnings on a data-dependent
    branch (each hundreds of lines; kept when ``TORCH_LOGS`` asks for that logger's details)."""
    import io
    import logging
    import sys

    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = log.level
    quiet_log = log.getEffectiveLevel() >= logging.WARNING
    if quiet_log:
        log.setLevel(logging.ERROR)
    err, buf = sys.stderr, io.StringIO()
    sys.stderr = buf
    try:
        yield
    except BaseException as e:
        partial = getattr(e, "partial_fx_graph", None)
        text = buf.getvalue()
        if partial:  # (printed once by each of export's wrappers)
            text = text.replace(f"{partial}\n", "")
        sys.stderr = err
        if text.strip():
            err.write(text)
        raise
    else:
        sys.stderr = err
        err.write(buf.getvalue())
    finally:
        sys.stderr = err
        if quiet_log:
            log.setLevel(level)


def _own_tensors(wrapper: torch.nn.Module, example_inputs: tuple) -> set[int]:
    """The ids of the model's parameters and of the inputs (an input that requires grad is the
    training step's to refuse, by its name)."""
    return {id(p) for p in wrapper.parameters()} | {id(t) for t in example_inputs}


def _capture(wrapper: torch.nn.Module, example_inputs: tuple) -> "torch.export.ExportedProgram":
    """``torch.export`` then ``run_decompositions``, trying each of :func:`decomposition_tables`
    in turn; a failure raises :class:`CaptureError` naming the stage (and every table tried). A
    tensor that trains but is not the model's (:class:`_OutsideLeaves`) is a TypeError."""
    outside = _OutsideLeaves(_own_tensors(wrapper, example_inputs))
    try:
        with outside, _quiet_export_failure():
            exported = torch.export.export(wrapper, example_inputs)
    except ModelOutputError:
        raise  # the user's call, not the capture: its message says what to change
    except Exception as e:
        raise CaptureError("capture (torch.export.export)", [f"{type(e).__name__}: {e}"],
                           _eager_error(wrapper, example_inputs), _model_frame(e.__traceback__)) from e
    outside.refuse()
    _keep_region_origins(exported)
    failures = []
    for name, table in decomposition_tables():
        try:
            return exported.run_decompositions(table)
        except Exception as e:  # noqa: BLE001  a decomposition of PyTorch's own failed: try the next table
            failures.append(f"with {name}: {type(e).__name__}: {e}")
    raise CaptureError("decomposition (ExportedProgram.run_decompositions)", failures)


_NOT_THE_MODEL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STDLIB = os.path.dirname(os.__file__)  # its site-packages (an install without a venv) hold models' code


def _model_frame(tb) -> str | None:
    """Where in the model's code (not PyTorch's, remat's or the standard library's) a traceback's
    innermost such frame is: ``file:line (source line)``; None if it has none."""
    import traceback

    return _user_frame([(frame.f_code.co_filename, lineno, None) for frame, lineno in traceback.walk_tb(tb)])


def _user_frame(frames: Sequence[tuple[str, int, str | None]]) -> str | None:
    """The innermost of ``frames`` (outermost first: file, line, source or None) in the user's code
    (not PyTorch's, remat's or the standard library's): ``file:line (source line)``; None if none is."""
    import linecache

    found = None
    for path, lineno, line in frames:
        stdlib = path.startswith(_STDLIB) and not any(d in path for d in ("site-packages", "dist-packages"))
        if not (path.startswith(_NOT_THE_MODEL) or stdlib or path.startswith("<")):
            found = (path, lineno, line)
    if found is None:
        return None
    line = (found[2] or linecache.getline(*found[:2])).strip()
    return f"{found[0]}:{found[1]}" + (f" ({line})" if line else "")


def _keep_region_origins(exported: "torch.export.ExportedProgram") -> None:
    """Keep the submodule path and source line of every op inside a region that ``torch.export``
    made a higher-order op (a ``torch.autocast`` block: ``precision="bf16"``; a ``torch.no_grad()``
    block). Its subgraph's nodes carry them, but ``run_decompositions`` traces the subgraph as one
    call, and every op it contains would come out attributed to the model's root (the report's
    recomputed layers, unsupported-op messages). Run through :class:`torch.fx.Interpreter`, each
    node becomes the current node while it is traced, whose metadata the decomposed ops copy."""
    for mod in exported.graph_module.modules():
        if isinstance(mod, torch.fx.GraphModule) and mod is not exported.graph_module:
            mod.forward = partial(_interpret, mod)


def _interpret(gm: torch.fx.GraphModule, *args):
    return torch.fx.Interpreter(gm).run(*args)


_UNCHECKED = "a random op eager PyTorch draws from its generator cannot be compared"
VALIDATE_RTOL = {torch.float16: 2e-2, torch.bfloat16: 2e-2}
"""Relative tolerance of :func:`stale_capture` by output dtype, or by the autocast dtype the outputs
were computed in (1e-4 for others)."""


def stale_capture(imported: ImportedModel, wrapper: torch.nn.Module, example_inputs: tuple) -> str | None:
    """Why a capture taken from the cache is not the model's program, or None when it is.

    A cache key cannot describe everything a forward reads (a dict or list global, a class
    attribute, an environment variable): the model is run once eagerly on the example inputs
    (without gradients; its buffers and the RNG state put back, as :func:`_eager_error` does) and
    the cached program once on the VM on the same tensors, and their outputs (the loss, or the
    model's outputs) must agree within a relative 1e-4 (2e-2 in 16-bit dtypes or under autocast). Dropout is
    compared with every element kept on both sides (eager's Bernoulli draws, dropout and CPU
    attention dropout replaced, the program's ``bernoulli`` run with p = 1): a change of what the
    forward computes shows, its random masks do not. A model drawing other random numbers (``rand``,
    ``randn``: the program's ``uniform``) cannot be compared this way: it gives :data:`_UNCHECKED`
    and is captured again (the cache does not help it).

    The eager forward also refuses what a capture refuses: a tensor that trains but is not the
    model's (:class:`_OutsideLeaves`).

    Cost: one eager forward and one VM forward without gradients. On one thread, the second
    compile of the zoo GPT small takes 0.06 s more (0.02 s each forward), of the GPT medium of
    ``bench/speed.py`` 2.2 s more (eager 1.5 s, VM 0.8 s; the cached compile otherwise ~0.1 s,
    a fresh capture a few seconds more). ``REMAT_CAPTURE_CHECK=0`` skips the check and trusts the
    key (:func:`remat.frontend.capture_cache.checked`)."""
    from ..runtime.vm import run

    if not capture_cache.checked() or without_data([*imported._tensors, *example_inputs]):
        return None  # meta or fake tensors hold no values to compare: the key is trusted (a dry run)
    fn = imported.function
    ops = {ins.op.name for ins in fn.instructions()}
    if "uniform" in ops:
        return _UNCHECKED
    random = "bernoulli" in ops
    if random:
        fn = fn.clone()
        for ins in fn.instructions():
            if ins.op.name == "bernoulli":
                ins.attrs["p"] = 1.0
        Module([fn])
    keep = _KeepAll()  # only where the program draws: the mode slows a large forward down
    outside = _OutsideLeaves(_own_tensors(wrapper, example_inputs), eager=True)  # what a capture refuses
    with outside:
        eager, error = _run_eagerly(wrapper, example_inputs, keep if random else contextlib.nullcontext())
    if error is not None:  # the capture afresh reports the model's own error
        return f"the eager forward raised {error}"
    outside.refuse()
    if keep.unforced:
        return _UNCHECKED
    want = [t for t in torch.utils._pytree.tree_leaves(eager) if isinstance(t, torch.Tensor)]
    n_user = sum(1 for n in imported.output_names if n == "loss" or n.startswith("output"))
    if len(want) != n_user:
        return f"{len(want)} eager outputs, {n_user} cached"
    device = next((t.device for t in imported._tensors if isinstance(t, torch.Tensor) and not t.is_cpu), None)
    got, _ = run(fn, *imported.arguments(*example_inputs), record="peak", outputs="torch", device=device)
    for i, (g, w) in enumerate(zip(got, want)):
        w, g = w.detach().cpu(), g.detach().cpu()
        if tuple(g.shape) != tuple(w.shape):
            return f"output {i}: shape {tuple(g.shape)} cached, {tuple(w.shape)} eager"
        if not w.dtype.is_floating_point:
            if not torch.equal(g.to(w.dtype), w):
                return f"output {i} differs"
            continue
        g, w = g.double(), w.double()
        # Under autocast an fp32 output (the loss) is computed in 16 bits: eager's kernels and the
        # program's round differently, as its 16-bit outputs do.
        low = getattr(wrapper, "autocast", None)
        rtol = VALIDATE_RTOL.get(want[i].dtype, VALIDATE_RTOL.get(low, 1e-4))
        scale = max(1.0, float(w.abs().nan_to_num(posinf=0, neginf=0).max())) if w.numel() else 1.0
        if not torch.allclose(g, w, rtol=rtol, atol=rtol * scale, equal_nan=True):
            diff = float((g - w).abs().nan_to_num(nan=float("inf")).max())
            return f"output {i} cached vs eager: max difference {diff:.3g}"
    return None


class _KeepAll(TorchDispatchMode):
    """Eager random ops with every element kept: Bernoulli draws are ones, dropout scales by
    1/(1-p), CPU attention's dropout likewise; any other random op is recorded in ``unforced``."""

    def __init__(self) -> None:
        super().__init__()
        self.unforced: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "bernoulli_":
            return args[0].fill_(1)
        if name == "bernoulli":
            return torch.ones_like(args[0])
        if name in ("native_dropout", "dropout"):
            x, p, train = (list(args) + [kwargs.get("p"), kwargs.get("train")])[:3]
            if train is False or not p:
                return (x, torch.ones_like(x, dtype=torch.bool)) if name == "native_dropout" else x
            y = torch.zeros_like(x) if p >= 1 else x * (1.0 / (1.0 - p))
            return (y, torch.full_like(x, p < 1, dtype=torch.bool)) if name == "native_dropout" else y
        if name == "_scaled_dot_product_flash_attention_for_cpu":
            a = list(args)
            p = a[3] if len(a) > 3 else kwargs.get("dropout_p", 0.0)
            if p and len(a) > 3:
                a[3] = 0.0
            elif p:
                kwargs = {**kwargs, "dropout_p": 0.0}
            out, lse = func(*a, **kwargs)
            return (out * (1.0 / (1.0 - p)) if p else out), lse
        self.unforced.add(str(func))
        return func(*args, **kwargs)


def _eager_error(wrapper: torch.nn.Module, example_inputs: tuple) -> str | None:
    """What the model raises when run eagerly on the example inputs (its first line), or None when it
    runs: tells a model that fails by itself from one that ``torch.export`` cannot trace. Run without
    gradients; its buffers (batch norm's running statistics) and the RNG state are put back, so the
    check leaves the model as it was."""
    return _run_eagerly(wrapper, example_inputs)[1]


def _run_eagerly(wrapper: torch.nn.Module, example_inputs: tuple, mode: Any = None) -> tuple[Any, str | None]:
    """``(output, None)`` of the model run eagerly on the example inputs (inside ``mode`` if given),
    or ``(None, its error's first line)``; without gradients, buffers and the RNG state put back."""
    buffers = [(b, b.detach().clone()) for b in wrapper.buffers()]
    rng = torch.get_rng_state()
    try:
        with torch.no_grad(), (mode or contextlib.nullcontext()):
            return wrapper(*example_inputs), None
    except Exception as e:  # noqa: BLE001  the model's own error, reported with the capture's
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _translate(ep: "torch.export.ExportedProgram", wrapper: torch.nn.Module, n_user: int, has_loss: bool,
               name: str) -> ImportedModel:
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    graph = ep.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]

    # The model's own tensors, with tied parameters folded onto their first name.
    canon: dict[str, str] = {}
    first: dict[int, str] = {}
    for fqn, p in wrapper.named_parameters(remove_duplicate=False):
        canon[fqn] = first.setdefault(id(p), fqn)
    named_params = dict(wrapper.named_parameters())
    named_buffers = dict(wrapper.named_buffers())
    param_order = list(named_params)
    buffer_order = list(named_buffers)

    kinds: dict[str, tuple[str, str]] = {}  # placeholder name -> (kind, canonical target)
    constants: list[str] = []
    for spec in sig.input_specs:
        if spec.kind == InputKind.PARAMETER:
            kinds[spec.arg.name] = ("param", canon.get(spec.target, spec.target))
        elif spec.kind == InputKind.BUFFER:
            kinds[spec.arg.name] = ("buffer", spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            kinds[spec.arg.name] = ("constant", spec.target)
            constants.append(spec.target)
        elif spec.kind == InputKind.USER_INPUT:
            kinds[spec.arg.name] = ("input", spec.arg.name)
        else:
            raise UnsupportedOpError(f"input of kind {spec.kind.name}", "", "",
                                     "only parameters, buffers, tensor constants and tensor inputs are supported")
    used_params = {t for k, t in kinds.values() if k == "param"}
    used_buffers = {t for k, t in kinds.values() if k == "buffer"}
    params = [p for p in param_order if p in used_params]
    buffers = [b for b in buffer_order if b in used_buffers]
    inputs = [n.name for n in placeholders if kinds[n.name][0] == "input"]
    if len(inputs) != n_user:
        raise UnsupportedOpError("non-tensor input", "", "", f"expected {n_user} tensor inputs, the trace has {len(inputs)}")

    def tensor_of(kind: str, target: str) -> torch.Tensor:
        if kind == "param":
            return named_params[target]
        if kind == "buffer":
            return named_buffers[target]
        return ep.constants[target]

    def ttype(t: torch.Tensor) -> TensorType:
        return TensorType(to_dtype(t.dtype), tuple(int(d) for d in t.shape))

    # Results: user outputs, then buffer mutations.
    out_node = next(n for n in graph.nodes if n.op == "output")
    out_args = list(out_node.args[0])
    user_outs, mutations = [], []
    for spec, a in zip(sig.output_specs, out_args):
        if spec.kind == OutputKind.USER_OUTPUT:
            user_outs.append(a)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            mutations.append((spec.target, a))
        else:
            raise UnsupportedOpError(f"output of kind {spec.kind.name}", "", "",
                                     "the model mutates one of its inputs; only buffer updates are supported")
    for u in user_outs:
        if not isinstance(u, torch.fx.Node):
            raise UnsupportedOpError("non-tensor output", "", "", f"the model returns {u!r}; return tensors only")

    # Trainable parameters first, then the others (frozen, or never reaching an output: eager
    # PyTorch gives them no gradient, and its optimizers leave them alone).
    reaching = {kinds[n.name][1] for n in _upstream(user_outs) if n.op == "placeholder" and kinds[n.name][0] == "param"}
    trainable = [p for p in params if named_params[p].requires_grad and p in reaching]
    frozen = [p for p in params if p not in set(trainable)]
    state = ([("param", p) for p in trainable + frozen] + [("buffer", b) for b in buffers]
             + [("constant", c) for c in constants])
    tensors = [tensor_of(k, t) for k, t in state]
    input_types = [ttype(n.meta["val"]) for n in placeholders if kinds[n.name][0] == "input"]

    f = Function(name, [ttype(t) for t in tensors] + input_types, [])
    b = Builder(f.entry)
    seed_holder: list[Value] = []

    def seed() -> Value:
        if not seed_holder:
            seed_holder.append(f.entry.add_arg(_SEED))
        return seed_holder[0]

    L = Lowerer(b, seed)
    env: dict[torch.fx.Node, Any] = {}
    slot = {f"{k}:{t}": i for i, (k, t) in enumerate(state)}
    in_iter = iter(f.params[len(state):])
    for n in placeholders:
        k, t = kinds[n.name]
        env[n] = next(in_iter) if k == "input" else f.params[slot[f"{k}:{t}"]]

    # Every untranslatable node is collected (one error lists them all); the nodes computed from
    # one are skipped silently (``_SKIPPED``): their failure is a consequence, not another problem.
    problems: list[Unsupported] = []

    def unsupported(node: torch.fx.Node, op: str, reason: str = "") -> None:
        path, src = _where(node)
        problems.append(Unsupported(op, path, src, reason))
        env[node] = _SKIPPED

    def skipped(a: Any) -> bool:
        if isinstance(a, torch.fx.Node):
            return env.get(a) is _SKIPPED
        if isinstance(a, (list, tuple)):
            return any(skipped(x) for x in a)
        if isinstance(a, dict):
            return any(skipped(x) for x in a.values())
        return False

    def lookup(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = env[a]
            if v is None:
                raise _MissingOutput(a)
            return v
        if isinstance(a, (list, tuple)):
            return type(a)(lookup(x) for x in a)
        return a

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            src, i = node.args
            if env[src] is _SKIPPED:
                env[node] = _SKIPPED
                continue
            v = env[src][i]
            if v is None:
                unsupported(node, f"{src.target} (output {i})",
                            "remat computes only the outputs of this op that training models use")
                continue
            env[node] = v
            continue
        target = str(node.target)
        rule = LOWERINGS.get(target.removeprefix("aten.") if target.startswith("aten.") else target)
        if rule is None:
            unsupported(node, target)
            continue
        if skipped(node.args) or skipped(node.kwargs):
            env[node] = _SKIPPED
            continue
        L.node = node
        b.loc = _loc(node)
        try:
            args = lookup(node.args)
            kwargs = {k: lookup(v) for k, v in node.kwargs.items() if k not in ("device", "layout", "pin_memory", "memory_format")}
            result = rule(L, *args, **kwargs)
        except LoweringError as e:
            unsupported(node, target, str(e))
            continue
        except _MissingOutput as e:
            unsupported(e.node, str(e.node.target), "this output of the op is not supported")
            env[node] = _SKIPPED
            continue
        _check(node, result)
        env[node] = result
    if problems:
        raise UnsupportedOpError(problems=problems)

    b.loc = None
    results = [env[u] for u in user_outs] + [env[a] for _, a in mutations]
    # The IR returns each value by type: results that alias a parameter unchanged are still returned.
    b.ret(*results)
    f.result_types = [v.type for v in results]
    module = Module([f])
    verify(module)
    module = run(module, IMPORT_PASSES).module
    f = module[name]
    out_names = (["loss"] if has_loss and len(user_outs) == 1 else
                 [f"output{i}" if len(user_outs) > 1 else "output" for i in range(len(user_outs))])
    out_names += [_strip(t) for t, _ in mutations]
    return ImportedModel(module=module, function=f, param_names=[_strip(p) for p in trainable],
                         frozen_names=[_strip(p) for p in frozen],
                         buffer_names=[_strip(x) for x in buffers], input_count=len(inputs),
                         has_seed=bool(seed_holder), output_names=out_names,
                         constant_names=[_strip(c) for c in constants], _tensors=tensors,
                         _state=state)


def _upstream(outs: list) -> set:
    """Every node of the graph that ``outs`` are computed from (themselves included)."""
    seen: set = set()
    stack = [u for u in outs if isinstance(u, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _check(node: torch.fx.Node, result: Any) -> None:
    """Each translated value must have exactly the dtype and shape PyTorch computed."""
    val = node.meta.get("val")
    pairs = list(zip(val, result)) if isinstance(val, (list, tuple)) else [(val, result)]
    for i, (m, v) in enumerate(pairs):
        if v is None or not isinstance(m, torch.Tensor):
            continue
        want = TensorType(to_dtype(m.dtype), tuple(int(d) for d in m.shape))
        if not isinstance(v, Value) or v.type != want:
            path, src = _where(node)
            got = v.type if isinstance(v, Value) else v
            raise TranslationError(f"translating {node.target} (result {i}) in '{path}' gave {got}, PyTorch has {want}\n"
                                   f"  from: {src}")
