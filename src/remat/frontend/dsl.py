"""The staged Python DSL: ``@remat.function`` traces a Python function with proxies into IR.

    @remat.function
    def mlp(x: remat.f32[8, 784], w: remat.f32[784, 10], b: remat.f32[1, 10]):
        return remat.ops.softmax(x @ w + b, axis=1)

    print(mlp.ir)                      # the verified module, as canonical text
    probs = mlp(x, w, b)               # compiled once per signature, run on the VM

Annotated parameters fix their type; unannotated ones take it from the call's arguments, one
specialization (trace) per signature. Calling a staged function inside another stages a ``call``;
``remat.cond`` stages a data-dependent branch. This module only produces IR: running goes
through :mod:`remat.runtime.vm`.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable, Sequence

import numpy as np

from ..ir import DType, Function, Instruction, Module, TensorType, verify
from . import _dsl_ops as ops
from ._dsl_ops import _flatten, cond
from ._dsl_trace import (Tensor, Trace, TracingError, as_tensor, check_live, current_trace, in_trace, is_scalar,
                         scalar_default_dtype, scalar_value, tracing, wrap)

__all__ = ["Staged", "Tensor", "TracingError", "cond", "function", "ops"]

_IDENT = re.compile(r"[^A-Za-z0-9_.$]")


def _ir_name(name: str) -> str:
    """A valid IR function name from a Python name (``<lambda>`` becomes ``lambda``)."""
    n = _IDENT.sub("", name) or "f"
    return n if re.match(r"[A-Za-z_]", n) else "f_" + n


# ---------------------------------------------------------------- specializations
class _Spec:
    """One staged function for one signature: its IR body and the specializations it calls.

    Traced specs keep their body outside any module and name callees by the spec they point to
    (``sites``); :attr:`module` assembles entry + callees into a module with unique names and
    verifies it. Specs wrapping an existing module use that module as is.
    """

    def __init__(self, name: str, function: Function, sites: list[tuple[Instruction, "_Spec"]] | None,
                 single: bool, module: Module | None = None):
        self.name = name
        self.function = function
        self._sites = sites
        self.single = single
        self._module = module
        self._vms: dict[Any, Any] = {}

    @property
    def param_types(self) -> tuple[TensorType, ...]:
        return tuple(self.function.param_types)

    @property
    def result_types(self) -> list[TensorType]:
        return list(self.function.result_types)

    @classmethod
    def from_module(cls, module: Module, name: str, single: bool | None = None) -> "_Spec":
        f = module[name]
        if f.is_declaration:
            raise TypeError(f"@{name} is a gradient declaration without a body; run the differentiation pass first")
        return cls(name, f, None, len(f.result_types) == 1 if single is None else single, module)

    def sites(self) -> list[tuple[Instruction, "_Spec"]]:
        """Each ``call`` instruction of the body with the spec it calls."""
        if self._sites is None:
            memo: dict[str, _Spec] = {self.name: self}
            self._sites = _module_sites(self._module, self, memo)
        return self._sites

    @property
    def module(self) -> Module:
        if self._module is None:
            self._module = _assemble(self)
        return self._module

    @property
    def entry(self) -> Function:
        return self.module[self.name]

    def vm(self, dialects: Sequence[str] | str | None) -> Any:
        """The VM prepared for this module and ``dialects`` (built once, then reused)."""
        key = tuple(dialects) if isinstance(dialects, (list, tuple)) else dialects
        if key not in self._vms:
            from ..passes.decompose import decompose_unclaimed
            from ..runtime.vm import VM

            # composites that none of the dialects has a kernel for run through their decompositions
            self._vms[key] = VM(decompose_unclaimed(self.module, dialects), dialects=dialects)
        return self._vms[key]


def _module_sites(module: Module, spec: _Spec, memo: dict[str, _Spec]) -> list[tuple[Instruction, _Spec]]:
    sites = []
    for ins in spec.function.instructions():
        if ins.op.name == "call":
            callee = ins.attrs["callee"]
            if callee not in memo:
                f = module[callee]
                if f.is_declaration:
                    raise TypeError(f"@{spec.name} calls @{callee}, a gradient declaration without a body; run the "
                                    f"differentiation pass before calling it from staged code")
                memo[callee] = _Spec(callee, f, None, len(f.result_types) == 1)
                memo[callee]._sites = _module_sites(module, memo[callee], memo)
            sites.append((ins, memo[callee]))
    return sites


def _assemble(entry: _Spec) -> Module:
    """Copy the entry spec and every spec it reaches into one module (entry first, unique names)."""
    order: list[_Spec] = []
    seen: set[int] = set()

    def visit(s: _Spec) -> None:
        if id(s) in seen:
            return
        seen.add(id(s))
        order.append(s)
        for _, c in s.sites():
            visit(c)

    visit(entry)
    names: dict[int, str] = {}
    used: set[str] = set()
    for s in order:
        n, k = s.name, 1
        while n in used:
            n, k = f"{s.name}_{k}", k + 1
        used.add(n)
        names[id(s)] = n
    m = Module()
    for s in order:
        g = s.function.clone(names[id(s)])
        target = {ins: c for ins, c in s.sites()}
        for old, new in zip(s.function.instructions(), g.instructions()):
            if old in target:
                new.attrs["callee"] = names[id(target[old])]
        m.add(g)
    verify(m)
    return m


# ---------------------------------------------------------------- arguments
def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _is_torch(v: Any) -> bool:
    return type(v).__module__.split(".")[0] == "torch" and hasattr(v, "detach")


def _default_array(v: Any) -> np.ndarray:
    """A list/tuple argument without an annotation: floats become f32, ints i64 (as Python scalars do)."""
    a = np.asarray(v)
    if a.dtype == np.float64:
        return a.astype(np.float32)
    return a


def _describe(v: Any) -> str:
    if isinstance(v, Tensor):
        return str(v.type)
    if isinstance(v, np.ndarray):
        try:
            return str(TensorType(DType.from_numpy(v.dtype), v.shape))
        except TypeError:
            return f"ndarray of dtype {v.dtype}"
    return f"{type(v).__name__} {v!r}"


def _signature_error(fname: str, pname: str, want: TensorType, got: str) -> TypeError:
    return TypeError(f"@{fname}: parameter '{pname}' expects {want}, got {got}")


def _convert(fname: str, pname: str, value: Any, want: TensorType | None) -> np.ndarray:
    """An argument as a NumPy array of its remat type, checked against the annotation ``want``."""
    if isinstance(value, Tensor):
        raise TracingError(f"@{fname}: parameter '{pname}' got a traced tensor outside staging; "
                           f"traced tensors only live while their function is being traced")
    if _is_torch(value):
        arr = _torch_to_numpy(value)
    elif isinstance(value, np.ndarray):
        arr = value
    elif is_scalar(value):
        if want is None:
            arr = np.asarray(value, dtype=scalar_default_dtype(value).numpy)
        else:
            if want.rank != 0:
                raise _signature_error(fname, pname, want, _describe(value))
            try:
                arr = np.asarray(scalar_value(value, want.dtype, f"@{fname}: parameter '{pname}'"), dtype=want.dtype.numpy)
            except TypeError:
                raise _signature_error(fname, pname, want, _describe(value)) from None
    elif isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value, dtype=want.dtype.numpy) if want is not None else _default_array(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"@{fname}: parameter '{pname}' got a list that is not a rectangular array: {e}") from None
    else:
        raise TypeError(f"@{fname}: parameter '{pname}' takes an array (NumPy, torch) or a Python scalar, "
                        f"got {type(value).__name__}")
    try:
        dt = DType.from_numpy(arr.dtype)
    except TypeError as e:
        raise TypeError(f"@{fname}: parameter '{pname}': {e}") from None
    got = TensorType(dt, arr.shape)
    if want is not None and got != want:
        raise _signature_error(fname, pname, want, str(got))
    return arr


# ---------------------------------------------------------------- the staged function
class Staged:
    """A staged function: its IR (per argument signature) and a callable that runs it on the VM.

    Made by ``@remat.function`` from Python, by :meth:`from_module` from existing IR, by
    :meth:`specialize` (one fixed signature) or by :meth:`derive` (an IR → IR transform applied
    to every specialization, e.g. differentiation).
    """

    def __init__(self, fn: Callable[..., Any] | None = None, *, name: str | None = None,
                 _spec: _Spec | None = None, _param_names: Sequence[str] | None = None,
                 _base: "Staged | None" = None, _transform: Callable[[Module, str], Any] | None = None):
        self._fn = fn
        self._fixed = _spec
        self._base = _base
        self._transform = _transform
        self._cache: dict[tuple[TensorType, ...], _Spec] = {}
        self._tracing: set[tuple[TensorType, ...]] = set()
        self._last: _Spec | None = _spec
        self.trace_count = 0          # how many times the Python function was traced
        self.last_stats: Any = None   # RunStats of the last call on the VM
        if fn is not None:
            functools.update_wrapper(self, fn, updated=())
            self._name = _ir_name(name or getattr(fn, "__name__", "f"))
            try:
                self._pysig = inspect.signature(fn, eval_str=True)
            except NameError as e:
                raise TypeError(f"@remat.function {getattr(fn, '__name__', fn)}: an annotation cannot be evaluated "
                                f"({e}); annotate tensors with types such as remat.f32[1, 784]") from None
            names, ann = [], []
            for p in self._pysig.parameters.values():
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    raise TypeError(f"@remat.function {fn.__name__}: *{p.name} / **{p.name} parameters are not "
                                    f"supported; list the tensor parameters explicitly")
                a = p.annotation
                if a is p.empty or a is Any or a is Tensor:  # the type comes from the call
                    ann.append(None)
                elif isinstance(a, TensorType):
                    ann.append(a)
                else:
                    raise TypeError(f"@remat.function {fn.__name__}: parameter '{p.name}' has annotation {a!r}; "
                                    f"annotate tensors with a type such as remat.f32[1, 784] (or leave it out to "
                                    f"take the type from the first call)")
                names.append(p.name)
            self.param_names: tuple[str, ...] = tuple(names)
            self._annotations: tuple[TensorType | None, ...] = tuple(ann)
        elif _spec is not None:
            self._name = _spec.name
            self._pysig = None
            names = list(_param_names or ())[:len(_spec.param_types)]
            # Extra parameters (a derived function's cotangent, say) are named as the printer names them.
            self.param_names = tuple(names + [f"%{i}" for i in range(len(names), len(_spec.param_types))])
            self._annotations = _spec.param_types
        elif _base is not None:
            self._name = name or _base._name
            self._pysig = _base._pysig
            self.param_names = _base.param_names
            self._annotations = _base._annotations
        else:
            raise TypeError("Staged needs a Python function, a module (Staged.from_module) or a base to derive from")

    # -- construction
    @classmethod
    def from_module(cls, module: Module, name: str, param_names: Sequence[str] | None = None) -> "Staged":
        """Wrap function ``@name`` of an existing (verified) module; its signature is fixed.
        Parameters are named ``%0, %1, …`` in errors unless ``param_names`` are given."""
        verify(module)
        spec = _Spec.from_module(module, name)
        if param_names is not None and len(param_names) != len(spec.param_types):
            raise TypeError(f"@{name} has {len(spec.param_types)} parameters, got {len(param_names)} names")
        return cls(_spec=spec, _param_names=param_names)

    def specialize(self, *args: Any, **kwargs: Any) -> "Staged":
        """A Staged fixed to one signature, given TensorTypes or example arguments."""
        spec = self._spec_for(self._signature(args, kwargs, for_types=True))
        return Staged(_spec=spec, _param_names=self.param_names)

    def derive(self, transform: Callable[[Module, str], tuple[Module, str]], name: str | None = None) -> "Staged":
        """A Staged whose IR is ``transform(module, entry_name) -> (module, new_entry_name)`` applied to
        this one's IR, per signature (lazily, cached). Autodiff builds gradients this way."""
        return Staged(_base=self, _transform=transform, name=name)

    # -- the IR
    @property
    def name(self) -> str:
        """The entry function's name in :attr:`module`."""
        return self._current().name

    @property
    def module(self) -> Module:
        """The verified module of the current specialization (the last one used)."""
        return self._current().module

    @property
    def ir(self) -> str:
        """The canonical text of :attr:`module`."""
        return str(self.module)

    def __remat_function__(self) -> Function:
        return self._current().entry

    @property
    def signatures(self) -> list[tuple[TensorType, ...]]:
        """The argument signatures compiled so far."""
        if self._fixed is not None:
            return [self._fixed.param_types]
        return list(self._cache)

    def _current(self) -> _Spec:
        if self._last is not None:
            return self._last
        missing = [n for n, a in zip(self.param_names, self._annotations) if a is None]
        if missing:
            raise TypeError(f"@{self._name} has unannotated parameters ({', '.join(repr(m) for m in missing)}) whose "
                            f"types come from the first call; call it once, or use .specialize(...) with types")
        return self._spec_for(tuple(self._annotations))  # type: ignore[arg-type]

    # -- specializations
    def _spec_for(self, types: tuple[TensorType, ...]) -> _Spec:
        if self._fixed is not None:
            spec = self._fixed
        elif types in self._cache:
            spec = self._cache[types]
        elif self._base is not None:
            base = self._base._spec_for(types)
            out = self._transform(base.module, base.name)
            if isinstance(out, Staged):
                spec = out._current()
            else:
                module, entry = out
                spec = _Spec.from_module(module, entry)
            self._cache[types] = spec
        else:
            spec = self._cache[types] = self._trace(types)
        self._last = spec
        return spec

    def _trace(self, types: tuple[TensorType, ...]) -> _Spec:
        if types in self._tracing:
            raise TracingError(f"@{self._name} calls itself while being staged; recursion cannot be staged "
                               f"(write the repetition as a Python loop, which unrolls)")
        self._tracing.add(types)
        try:
            tr = Trace(self._name, types)
            proxies = [wrap(tr, p) for p in tr.function.params]
            args, kwargs = [], {}
            for p, x in zip(self._pysig.parameters.values(), proxies):
                if p.kind == p.KEYWORD_ONLY:
                    kwargs[p.name] = x
                else:
                    args.append(x)
            with tracing(tr):
                out = self._fn(*args, **kwargs)
                items, single = _flatten(out, f"@{self._name}")
                vals = []
                for k, v in enumerate(items):
                    if isinstance(v, Tensor):
                        vals.append(check_live(tr, v, f"result {k} of @{self._name}"))
                    else:
                        vals.append(as_tensor(v, None, f"result {k} of @{self._name}").value)
                tr.function.result_types = [v.type for v in vals]
                tr.builder.ret(*vals)
            self.trace_count += 1
            spec = _Spec(self._name, tr.function, tr.call_sites, single)
            spec.module  # assemble and verify now, so staging errors surface at trace time
            return spec
        finally:
            self._tracing.discard(types)

    def _bind(self, args: tuple, kwargs: dict) -> list[Any]:
        """Arguments in parameter order; a wrong count raises TypeError naming the parameters.
        A derived function (e.g. a vector-Jacobian product) may take extra trailing arguments."""
        n = len(self.param_names)
        if self._base is not None:
            return self._base._bind(args[:n], kwargs) + list(args[n:])
        if self._pysig is None:
            if kwargs or len(args) != n:
                raise TypeError(f"@{self._name} takes {n} positional argument(s) ({', '.join(self.param_names)}), "
                                f"got {len(args)}" + (f" and keywords {sorted(kwargs)}" if kwargs else ""))
            return list(args)
        try:
            bound = self._pysig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"@{self._name} takes {n} argument(s) ({', '.join(self.param_names)}), "
                            f"got {len(args) + len(kwargs)}: {e}") from None
        bound.apply_defaults()
        return [bound.arguments[p] for p in self.param_names]

    def _names_and_annotations(self, k: int) -> tuple[list[str], list[TensorType | None]]:
        """Names and annotations of ``k`` arguments; extra ones (derived functions) are named %i."""
        n = len(self.param_names)
        return (list(self.param_names) + [f"%{i}" for i in range(n, k)],
                list(self._annotations) + [None] * (k - n))

    def _arg_types(self, values: list[Any], for_types: bool = False) -> tuple[TensorType, ...]:
        """The type of each argument (TensorTypes themselves when ``for_types``; traced tensors and
        scalars while staging; arrays otherwise), checked against the annotations."""
        names, anns = self._names_and_annotations(len(values))
        types = []
        for pname, v, want in zip(names, values, anns):
            if for_types and isinstance(v, TensorType):
                t = v
            elif isinstance(v, Tensor):
                t = v.type
            elif is_scalar(v) and in_trace():
                if want is not None:
                    _convert(self._name, pname, v, want)  # checks that the scalar fits
                t = want if want is not None else TensorType(scalar_default_dtype(v), ())
            elif in_trace():
                as_tensor(v, None, f"argument '{pname}' of the staged call to @{self._name}")  # raises
                raise AssertionError("unreachable")
            else:
                a = _convert(self._name, pname, v, want)
                t = TensorType(DType.from_numpy(a.dtype), a.shape)
            if want is not None and t != want:
                raise _signature_error(self._name, pname, want, str(t))
            types.append(t)
        return tuple(types)

    def _resolve(self, types: tuple[TensorType, ...]) -> _Spec:
        """The specialization for argument ``types`` (compiled on first use), checked against them."""
        n = len(self.param_names)
        spec = self._spec_for(types[:n])
        names, _ = self._names_and_annotations(len(types))
        if len(spec.param_types) != len(types):
            want = [f"%{i}: {t}" for i, t in enumerate(spec.param_types)]
            raise TypeError(f"@{spec.name} takes {len(spec.param_types)} argument(s) ({', '.join(want)}), "
                            f"got {len(types)}")
        for p, want, got in zip(names, spec.param_types, types):
            if want != got:
                raise _signature_error(self._name, p, want, str(got))
        return spec

    def _signature(self, args: tuple, kwargs: dict, for_types: bool = False) -> tuple[TensorType, ...]:
        types = self._arg_types(self._bind(args, kwargs), for_types)
        return types[:len(self.param_names)]

    # -- calling
    def __call__(self, *args: Any, **kwargs: Any):
        """Inside staged code: stage a ``call``. Otherwise: compile (once per signature) and run on
        the VM, returning one array for one result, else a tuple."""
        if in_trace():
            return self._stage_call(args, kwargs)
        outputs, _ = self.run(*args, **kwargs)
        return outputs

    def run(self, *args: Any, dialects: Sequence[str] | None = None, **kwargs: Any):
        """Run on the VM: returns ``(outputs, stats)``, outputs shaped as ``__call__`` returns them.
        ``dialects`` is the ordered list of backends to prefer (None: the VM's default)."""
        values = self._bind(args, kwargs)
        names, anns = self._names_and_annotations(len(values))
        arrays = [_convert(self._name, p, v, w) for p, v, w in zip(names, values, anns)]
        spec = self._resolve(tuple(TensorType(DType.from_numpy(a.dtype), a.shape) for a in arrays))
        outs, stats = spec.vm(dialects).run(spec.name, *arrays)
        self.last_stats = stats
        outs = tuple(outs)
        return (outs[0] if spec.single else outs), stats

    def _stage_call(self, args: tuple, kwargs: dict):
        tr = current_trace(f"calling @{self._name}")
        values = self._bind(args, kwargs)
        spec = self._resolve(self._arg_types(values))
        names, _ = self._names_and_annotations(len(values))
        vals = []
        for pname, v, t in zip(names, values, spec.param_types):
            if isinstance(v, Tensor):
                vals.append(check_live(tr, v, f"argument '{pname}' of the call to @{self._name}"))
            else:
                vals.append(ops.constant(v, t.shape, t.dtype).value)
        ins = tr.builder.create("call", vals, {"callee": spec.name}, result_types=spec.result_types)
        tr.call_sites.append((ins, spec))
        outs = [wrap(tr, r) for r in ins.results]
        return outs[0] if spec.single else tuple(outs)

    def __repr__(self) -> str:
        sig = ", ".join(f"{n}: {a if a is not None else '?'}" for n, a in zip(self.param_names, self._annotations))
        return f"<remat.Staged @{self._name}({sig})>"


def function(fn: Callable[..., Any] | None = None, *, name: str | None = None):
    """Decorator: stage ``fn`` into IR by tracing it with proxies (see the module docstring).
    ``@remat.function`` or ``@remat.function(name="mlp")``."""
    if fn is None:
        return lambda f: Staged(f, name=name)
    return Staged(fn, name=name)
