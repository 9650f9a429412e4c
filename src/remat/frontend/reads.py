"""What a capture reads as constants of the program it makes, as values that compare: a module's
plain attributes (a dropout's ``p``, a flag), and what a loss function reads (its closure, the
globals its code names, their attributes). A compiled step compares them at each call
(``remat.train.against``); the capture cache keys a capture on the loss function's."""
from __future__ import annotations

import functools

_MISSING = object()


@functools.lru_cache(maxsize=1)
def module_internals() -> frozenset[str]:
    """The attributes every ``nn.Module`` has (its parameter, buffer, module and hook dicts, ``training``):
    not the model's own; they are read by name elsewhere."""
    import torch

    return frozenset(vars(torch.nn.Module())) | {"training", "_compiled_call_impl"}


def attribute_value(v):
    """An attribute as the step was compiled against it: a number, flag, string, dtype or device by
    value, a tuple or list of those likewise, a tensor by identity and version (an in-place change is
    a change); None for anything else (a function, a config, a container), which is not watched:
    libraries rebind such objects without changing what the forward computes (PEFT's adapter switch
    rebinds a model's plan dicts), and a step compiled again for each would be compiled for nothing."""
    import torch

    if v is None or isinstance(v, (bool, int, str)):
        return (type(v).__name__, v)
    if isinstance(v, float):
        return ("float", repr(v))  # repr: a NaN equals itself
    if isinstance(v, (torch.dtype, torch.device, torch.Size)):
        return (type(v).__name__, str(v))
    if isinstance(v, (tuple, list)) and len(v) <= 64:
        items = tuple(attribute_value(x) for x in v)
        if all(i is not None and i[0] != "tensor" for i in items):
            return (type(v).__name__, items)
    if isinstance(v, torch.Tensor):
        return ("tensor", id(v), v._version)
    return None


def shown_value(v) -> str:
    """A value as :func:`attribute_value` describes it, in words for a message."""
    kind, value = v
    return value if kind in ("float", "dtype", "device", "Size") else repr(value) if kind != "tuple" else "a tuple"


class LossReads:
    """What a loss function reads that its capture made constants of the step, found from its code:
    the values of its closure's cells and of the globals its code names (a loss weight, a tensor of
    class weights), then, on the objects, dicts and Python modules among them, the attributes its
    code names (``cfg.alpha``, ``cfg.loss.alpha``, ``config_module.smoothing``; properties and
    ``__slots__`` fields too, :data:`MAX_DEPTH` levels deep) and every entry of a dict
    (``weights[key]``); a loss module's (``nn.CrossEntropyLoss(...)``, also one the function calls)
    own attributes and buffers (``label_smoothing``, ``weight``). The functions it calls that are the
    user's (not a library's: :func:`_followed`) are followed the same way, as are a callable object's
    ``__call__``, a bound method's object and a ``functools.partial``'s arguments. Values are compared
    as :func:`attribute_value` describes them (numbers by value, tensors by identity and version).

    What is not found this way is not watched: a value reached through a library's code, or by a
    name the code builds at run time (``getattr(cfg, name)``)."""

    MAX_DEPTH = 3

    def __init__(self, loss_fn, model=None) -> None:
        self.sources: list[tuple[str, object]] = []  # (label, a function giving the value now)
        names: set[str] = set()                        # attribute names and string keys the code uses
        # The model's modules are the model's watch's (and their buffers arguments of the step, read
        # live); so is a loss module given as loss_fn (captured with the model): its buffers by identity.
        self.skip = {id(m) for m in model.modules()} if model is not None else set()
        self.root = loss_fn
        self._follow(loss_fn, "loss_fn", names, set(), 0)
        self.names = frozenset(names)

    def _follow(self, fn, label: str, names: set[str], seen: set[int], depth: int) -> None:
        import types

        import torch

        if id(fn) in seen or depth > self.MAX_DEPTH:
            return
        seen.add(id(fn))
        if isinstance(fn, functools.partial):
            for k, v in enumerate(fn.args):
                self.sources.append((f"{label} argument {k}", lambda v=v: v))
            for k, v in (fn.keywords or {}).items():
                self.sources.append((f"{label} keyword {k}", lambda v=v: v))
            self._follow(fn.func, label, names, seen, depth)
            return
        if isinstance(fn, torch.nn.Module):
            if id(fn) not in self.skip:
                self.sources.append((label, lambda m=fn: m))
            return
        if isinstance(fn, types.MethodType):
            self.sources.append((f"{label}.__self__" if label != "loss_fn" else "self", lambda o=fn.__self__: o))
            fn = fn.__func__
        elif not isinstance(fn, types.FunctionType) and callable(fn) and not isinstance(fn, type):
            call = getattr(type(fn), "__call__", None)
            if isinstance(call, types.FunctionType) and _followed(call):  # a callable object of the user's
                self.sources.append((label, lambda o=fn: o))
                fn = call
        if not isinstance(fn, types.FunctionType) or not _followed(fn):
            return
        codes, co_names = [fn.__code__], set()
        while codes:  # the function's code and the code of lambdas and comprehensions within it
            code = codes.pop()
            co_names |= set(code.co_names)
            names |= set(code.co_names) | {c for c in code.co_consts if isinstance(c, str)}
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            self.sources.append((name, lambda c=cell: c.cell_contents))
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self._follow(value, name, names, seen, depth + 1)
        g = fn.__globals__
        for name in sorted(n for n in co_names if n in g):
            self.sources.append((name, lambda n=name: g.get(n)))
            self._follow(g[name], name, names, seen, depth + 1)

    def now(self) -> tuple:
        """The values read, as ``(label, description)`` pairs."""
        out: list = []
        for label, read in self.sources:
            try:
                v = read()
            except ValueError:  # an empty cell
                continue
            self._describe(label, v, out, 0)
        return tuple(sorted(dict(out).items(), key=lambda x: x[0]))

    def _describe(self, label: str, v, out: list, depth: int) -> None:
        import types

        import torch

        a = attribute_value(v)
        if a is not None:
            out.append((label, a))
            return
        if depth >= self.MAX_DEPTH or isinstance(v, (type, types.FunctionType, types.MethodType,
                                                     types.BuiltinFunctionType, functools.partial)):
            return
        if isinstance(v, torch.nn.Module):  # a loss module: its own attributes and buffers
            if id(v) in self.skip:
                return
            internal = module_internals()
            d = v.__dict__
            out += [(f"{label}.{k}", a) for k in d if k not in internal and (a := attribute_value(d[k])) is not None]
            live = v is self.root  # captured with the model: its buffers are arguments, read as they are
            out += [(f"{label}.{k}", ("tensor", id(b)) if live else attribute_value(b)) for k, b in v._buffers.items()]
            return
        if isinstance(v, dict):
            if len(v) <= 256:
                for k, x in v.items():
                    if isinstance(k, (str, int)):
                        self._describe(f"{label}[{k!r}]", x, out, depth + 1)
            return
        for k in self.names:
            x = _attribute(v, k)
            if x is not _MISSING:
                self._describe(f"{label}.{k}", x, out, depth + 1)


def _followed(fn) -> bool:
    """Whether a function is the user's, whose reads are followed: not a library's (torch, NumPy,
    the standard library or anything installed in site-packages), whose code is not what the loss
    computes with but how."""
    path = getattr(getattr(fn, "__code__", None), "co_filename", "")
    return bool(path) and not path.startswith("<frozen") and not any(
        path.startswith(d) for d in _library_dirs())


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    import os
    import sysconfig

    import numpy
    import torch

    dirs = {os.path.dirname(torch.__file__), os.path.dirname(numpy.__file__), sysconfig.get_paths()["stdlib"],
            os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # remat's own
    for key in ("purelib", "platlib"):
        dirs.add(sysconfig.get_paths()[key])
    return tuple(sorted(dirs))


def _attribute(v, name: str):
    """``v.name`` where the code could read it: the instance's ``__dict__``, a ``__slots__`` field, a
    class attribute, or a property (run, as the code runs it); :data:`_MISSING` if there is none
    (no ``__getattr__`` runs, and methods and other descriptors are left alone)."""
    d = getattr(v, "__dict__", None)
    if isinstance(d, dict) and name in d:
        return d[name]
    for cls in type(v).__mro__:
        x = cls.__dict__.get(name, _MISSING)
        if x is _MISSING:
            continue
        if isinstance(x, property) or type(x).__name__ == "member_descriptor":  # a property, a __slots__ field
            try:
                return getattr(v, name)
            except Exception:  # noqa: BLE001  a property that fails: not a value the step can be compiled against
                return _MISSING
        return _MISSING if hasattr(x, "__get__") else x
    return _MISSING
