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
    """What a loss function reads that its capture made constants of the step: the values of its
    closure's cells and of the globals its code names (a loss weight, a label-smoothing factor, a
    tensor of class weights), and of the attributes and string keys its code names on the objects and
    dicts among them (``cfg.alpha``, ``weights["kl"]``), one level deep; for a loss module
    (``nn.CrossEntropyLoss(...)``) its own attributes (``label_smoothing``, ``ignore_index``). Values
    are compared as :func:`attribute_value` describes them (numbers by value, tensors by identity and
    version). Functions it calls are not followed: what they read is not watched."""

    def __init__(self, loss_fn) -> None:
        import types

        import torch

        self.sources: list[tuple[str, object]] = []  # (label, a function giving the value now)
        self.names: frozenset[str] = frozenset()      # attribute names and string keys the code uses
        self.module = None                            # a loss module: its own attributes
        fn = loss_fn
        if isinstance(fn, functools.partial):
            for k, v in enumerate(fn.args):
                self.sources.append((f"argument {k} of the partial", lambda v=v: v))
            for k, v in (fn.keywords or {}).items():
                self.sources.append((f"keyword {k} of the partial", lambda v=v: v))
            fn = fn.func
        if isinstance(fn, torch.nn.Module):
            self.module = fn
            return
        if isinstance(fn, types.MethodType):
            self.sources.append(("self", lambda o=fn.__self__: o))
            fn = fn.__func__
        if not isinstance(fn, types.FunctionType):
            return
        codes, names = [fn.__code__], set()
        while codes:  # the function's code and the code of lambdas and comprehensions within it
            code = codes.pop()
            names |= set(code.co_names) | {c for c in code.co_consts if isinstance(c, str)}
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        self.names = frozenset(names)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            self.sources.append((name, lambda c=cell: c.cell_contents))
        g = fn.__globals__
        for name in sorted(n for n in fn.__code__.co_names if n in g):
            self.sources.append((name, lambda n=name: g.get(n)))

    def now(self) -> tuple:
        """The values read, as ``(label, description)`` pairs."""
        import types

        import torch

        out = []
        if self.module is not None:
            internal = module_internals()
            d = self.module.__dict__
            out += [(f"loss_fn.{k}", a) for k in d if k not in internal and (a := attribute_value(d[k])) is not None]
        for label, read in self.sources:
            try:
                v = read()
            except ValueError:  # an empty cell
                continue
            a = attribute_value(v)
            if a is not None:
                out.append((label, a))
            elif isinstance(v, dict) and len(v) <= 256:
                out += [(f"{label}[{k!r}]", a) for k, x in v.items()
                        if isinstance(k, str) and k in self.names and (a := attribute_value(x)) is not None]
            elif (hasattr(v, "__dict__") and not isinstance(v, (types.ModuleType, type, types.FunctionType,
                                                                types.MethodType, torch.nn.Module))):
                out += [(f"{label}.{k}", a) for k in self.names if (a := _plain_attribute(v, k)) is not None]
        return tuple(sorted(out, key=lambda x: x[0]))


def _plain_attribute(v, name: str):
    """``v.name`` as :func:`attribute_value` describes it, read from the instance's or its class's
    ``__dict__`` (no property or ``__getattr__`` runs); None if it has none or it is not plain."""
    d = getattr(v, "__dict__", None)
    x = d.get(name, _MISSING) if isinstance(d, dict) else _MISSING
    if x is _MISSING:
        for cls in type(v).__mro__:
            x = cls.__dict__.get(name, _MISSING)
            if x is not _MISSING:
                break
    return None if x is _MISSING else attribute_value(x)
