"""What a compiled step was compiled against that a user can change between calls.

A step captures the model as it was: the training mode of each of its modules, which tensors are
its parameters and buffers, which parameters train, their dtypes, and the precision it computes in.
:class:`Against` records that, and :class:`Watch` reads it again at each call cheaply (the modules
and parameter slots found at compile, re-walked only when the module tree changed), so that each call
can tell whether the model has changed since (``model.eval()`` or ``model.encoder.eval()``, a
replaced, added, frozen or unfrozen parameter, a replaced buffer or submodule, ``model.double()``, a
forward hook registered or removed, a dropout's ``p`` or another plain attribute the forward reads,
a value the loss function reads (:class:`LossReads`), a caller's ``torch.autocast``) and follow the
change with a step compiled for it, instead of running stale.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..frontend.reads import LossReads, attribute_value, module_internals, shown_value

_AUTOCAST_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Against:
    """Each module's training mode, each parameter slot's tensor (identity, ``requires_grad``,
    dtype, shape: ``p.data`` may be rebound to another) and each buffer slot's tensor (identity), in
    ``model.named_modules()`` order, the hooks, each module's own attributes of plain values and
    tensors (a dropout's ``p``, a flag, a scale the forward reads: the capture read them as
    constants), what the loss function reads and the precision the step computes in."""

    training: tuple[bool, ...]
    params: tuple[tuple[int, bool, object, tuple[int, ...]], ...]  # (id, requires_grad, dtype, shape)
    precision: str
    buffers: tuple[int, ...] = ()
    hooks: int = 0  # backward hooks on the modules and parameters (refused: :func:`refuse_backward_hooks`)
    forward_hooks: tuple[int, ...] = ()  # the handles of the forward (pre-)hooks, the modules' then the global ones
    attributes: tuple = ()  # per module, its own attributes as (name, value): see :func:`attribute_value`
    loss_reads: tuple = ()  # what the loss function reads that its capture made constants (:class:`LossReads`)
    slot_names: tuple[str, ...] = field(default=(), compare=False)  # the parameters' names, for messages

    def changes(self, now: "Against", watch: "Watch") -> list[str]:
        """What differs in ``now``, in words (modules and parameters by name)."""
        out = []
        if now.training != self.training:
            names = watch.module_names
            if len(now.training) == len(self.training):
                flipped = [names[i] for i, (a, b) in enumerate(zip(self.training, now.training)) if a != b]
                if flipped == [""] or len(flipped) == len(names):
                    out.append(f"model.{'train' if now.training[0] else 'eval'}() was called")
                else:
                    shown = ", ".join(flipped[:3]) + (f" and {len(flipped) - 3} more" if len(flipped) > 3 else "")
                    out.append(f"the training mode of {shown} changed")
            else:
                out.append(f"the model has {len(now.training)} modules, was {len(self.training)}")
        was = {i: (rg, dt, sh) for i, rg, dt, sh in self.params}
        for name, (i, rg, dt, sh) in zip(watch.slot_names, now.params):
            if i not in was:
                out.append(f"parameter {name} was {'replaced' if name in self.slot_names else 'added'}")
            elif was[i][0] != rg:
                out.append(f"parameter {name} is {'trainable' if rg else 'frozen'} now")
            elif was[i][1] != dt:
                out.append(f"parameter {name} is {dt} now, was {was[i][1]}")
            elif was[i][2] != sh:
                out.append(f"parameter {name} has shape {list(sh)} now, was {list(was[i][2])}")
        if now.hooks != self.hooks:
            out.append("a backward hook was registered or removed")
        if now.forward_hooks != self.forward_hooks:
            out.append("a forward hook was registered or removed")
        if now.attributes != self.attributes:
            out += _attribute_changes(self.attributes, now.attributes, watch.module_names)
        if now.buffers != self.buffers:
            was_b = set(self.buffers)
            out += [f"buffer {name} was replaced" for name, i in zip(watch.buffer_names, now.buffers) if i not in was_b]
        if len(now.params) != len(self.params) and not out:
            out.append(f"the model has {len(now.params)} parameters, was {len(self.params)}")
        if now.params != self.params:  # the same tensors in other slots: tied (or untied, rearranged)
            was_tied = _ties(self.slot_names, self.params)
            out += [f"parameter {name} is now tied to {to}" for name, to in _ties(watch.slot_names, now.params)
                    if (name, to) not in was_tied]
            out = out or ["the model's parameters were rearranged"]
        if now.precision != self.precision:
            out.append(f"it is called in {now.precision} (torch.autocast), was compiled for {self.precision}")
        if now.loss_reads != self.loss_reads:
            out += _loss_read_changes(self.loss_reads, now.loss_reads)
        return out


def _attribute_changes(was: tuple, now: tuple, names: list[str]) -> list[str]:
    out = []
    if len(was) != len(now):
        return ["a module's attributes changed"]
    for name, a, b in zip(names, was, now):
        if a == b:
            continue
        old, new = dict(a), dict(b)
        for k in sorted(set(old) | set(new)):
            if old.get(k) != new.get(k):
                path = f"{name}.{k}" if name else k
                shown = (f" ({shown_value(old[k])} -> {shown_value(new[k])})" if k in old and k in new
                         and old[k][0] != "tensor" else "")
                what = "added" if k not in old else "removed" if k not in new else "changed"
                out.append(f"attribute {path} was {what}{shown}")
    return out[:8] + ([f"and {len(out) - 8} more attribute changes"] if len(out) > 8 else [])


def _ties(names, params) -> list[tuple[str, str]]:
    """(slot, the first slot holding the same parameter) for each slot that shares its parameter."""
    first: dict[int, str] = {}
    out = []
    for name, (i, *_) in zip(names, params):
        if i in first:
            out.append((name, first[i]))
        first.setdefault(i, name)
    return out


def _loss_read_changes(was: tuple, now: tuple) -> list[str]:
    old, new = dict(was), dict(now)
    out = []
    for k in sorted(set(old) | set(new)):
        if old.get(k) != new.get(k):
            shown = (f" ({shown_value(old[k])} -> {shown_value(new[k])})"
                     if k in old and k in new and old[k][0] != "tensor" else "")
            out.append(f"the loss function's {k} changed{shown}")
    out = out[:8] + ([f"and {len(out) - 8} more changes the loss function reads"] if len(out) > 8 else [])
    if not out:
        return []
    return [out[0] + " (it is a constant of the compiled step: one that changes every step is better a buffer of "
                     "the model, updated in place and read by the loss as model.<name>)"] + out[1:]


class Watch:
    """The model's module tree as last walked: its modules, the edges between them and the parameter
    slots (module, name). :meth:`now` reads modes and parameters through them (a few attribute reads
    per module: cheap enough for every call) and walks the tree again only when a submodule was
    replaced, added or removed, or a parameter or buffer slot added, removed, emptied or filled
    (``module.bias = nn.Parameter(...)`` on a layer built without one)."""

    def __init__(self, model, where: str = "cpu", loss_fn=None):
        self.model = model
        self.where = where  # the device type whose torch.autocast the caller may run the step under
        self.loss_reads = LossReads(loss_fn, model) if loss_fn is not None else None
        self._walk()

    def _walk(self) -> None:
        named = list(self.model.named_modules())
        self.modules = [m for _, m in named]
        self.module_names = [n for n, _ in named]
        self.edges = [(m, k, c) for m in self.modules for k, c in m._modules.items()]
        self.counts = [(len(m._modules), len(m._parameters), len(m._buffers)) for m in self.modules]
        self.slots = [(m, k) for m in self.modules for k, p in m._parameters.items() if p is not None]
        self.slot_names = tuple(f"{n}.{k}" if n else k for n, m in named for k, p in m._parameters.items() if p is not None)
        self.buffer_slots = [(m, k) for m in self.modules for k, t in m._buffers.items() if t is not None]
        # Slots registered empty (``bias=False`` layers, untracked batch-norm statistics): one filled
        # later keeps the counts, so each is checked itself.
        self.empty = ([(m._parameters, k) for m in self.modules for k, p in m._parameters.items() if p is None]
                      + [(m._buffers, k) for m in self.modules for k, t in m._buffers.items() if t is None])
        self.buffer_names = [f"{n}.{k}" if n else k for n, m in named for k, t in m._buffers.items() if t is not None]
        self._read_attributes()

    def _read_attributes(self) -> None:
        """Each module's own attributes (:func:`attribute_value`), and what :meth:`now` checks them by:
        per module its ``__dict__``'s size and the identities of its attributes' values (one
        ``itemgetter`` call), and the versions of its tensor attributes."""
        import operator

        import torch

        internal = module_internals()
        self.attr_checks, self.tensor_attrs, attributes = [], [], []
        for m in self.modules:
            d = m.__dict__
            keys = [k for k in d if k not in internal]
            if keys:  # (itemgetter of one key returns the value itself, of two or more a tuple)
                get = operator.itemgetter(*keys) if len(keys) > 1 else (lambda d, k=keys[0]: (d[k],))
                values = get(d)  # held, so that no other object takes one of their ids meanwhile
                self.attr_checks.append((d, len(d), get, values, tuple(map(id, values))))
            else:
                self.attr_checks.append((d, len(d), None, (), ()))
            attributes.append(tuple((k, a) for k in keys if (a := attribute_value(d[k])) is not None))
            self.tensor_attrs += [(v, v._version) for k in keys if isinstance(v := d[k], torch.Tensor)]
        self.attributes = tuple(attributes)

    def _attributes_intact(self) -> bool:
        for d, n, get, _, ids in self.attr_checks:
            if len(d) != n or get is not None and tuple(map(id, get(d))) != ids:
                return False
        return all(t._version == v for t, v in self.tensor_attrs)

    def _intact(self) -> bool:
        if [(len(m._modules), len(m._parameters), len(m._buffers)) for m in self.modules] != self.counts:
            return False
        for m, k, c in self.edges:
            if m._modules.get(k) is not c:
                return False
        for slots, k in self.empty:  # the dicts walked: a module whose dict was replaced changes a count or
            if slots.get(k) is not None:  # reads a slot through its own (below)
                return False
        return True

    def now(self, precision: str) -> Against:
        """The model as it is now; ``precision``: the step's own, unless the caller runs it under
        ``torch.autocast`` (then the autocast's dtype: "bf16" or "fp16")."""
        import torch
        import torch.nn.modules.module as tmm

        if torch.is_autocast_enabled(self.where):
            dtype = str(torch.get_autocast_dtype(self.where)).removeprefix("torch.")
            precision = _AUTOCAST_PRECISION.get(dtype, dtype)
        if not self._intact():
            self._walk()
        elif not self._attributes_intact():
            self._read_attributes()
        params = [m._parameters.get(k) for m, k in self.slots]
        buffers = [m._buffers.get(k) for m, k in self.buffer_slots]
        if any(t is None for t in params) or any(t is None for t in buffers):  # a slot emptied (``module.bias = None``): walk again
            self._walk()
            params = [m._parameters[k] for m, k in self.slots]
            buffers = [m._buffers[k] for m, k in self.buffer_slots]
        hooks = (sum(len(m._backward_hooks) + len(m._backward_pre_hooks) for m in self.modules)
                 + sum(1 for p in params if p._backward_hooks or p._post_accumulate_grad_hooks))
        # Forward hooks run in the captured forward: one registered or removed since needs a new capture.
        forward = tuple(k for m in self.modules if m._forward_hooks or m._forward_pre_hooks
                        for k in (*m._forward_hooks, *m._forward_pre_hooks))
        if tmm._global_forward_hooks or tmm._global_forward_pre_hooks:
            forward += (-1, *tmm._global_forward_hooks, -2, *tmm._global_forward_pre_hooks)
        return Against(tuple(m.training for m in self.modules),
                       tuple((id(p), p.requires_grad, p.dtype, tuple(p.shape)) for p in params), precision,
                       tuple(map(id, buffers)), hooks, forward, self.attributes,
                       self.loss_reads.now() if self.loss_reads is not None else (), self.slot_names)


def refuse_backward_hooks(model) -> None:
    """TypeError naming each backward hook of ``model``: a module's (``register_full_backward_hook``,
    ``register_full_backward_pre_hook``, or a global one), a parameter's (``register_hook``,
    ``register_post_accumulate_grad_hook``). remat computes the gradients in its own program, so it
    could not call them, and ignoring them would give other gradients than eager PyTorch's."""
    import torch.nn.modules.module as tmm

    found = [f"module {n or '(the model)'}" for n, m in model.named_modules()
             if m._backward_hooks or m._backward_pre_hooks]
    found += [f"parameter {n}" for n, p in model.named_parameters()
              if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]
    if getattr(tmm, "_global_backward_hooks", None) or getattr(tmm, "_global_backward_pre_hooks", None):
        found.append("a global module backward hook (torch.nn.modules.module.register_module_full_backward_hook)")
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise TypeError(f"remat cannot run backward hooks, and ignoring them would change the gradients: {shown} "
                        "has one. remat computes gradients in its own program; remove the hook (handle.remove()) "
                        "or apply its effect otherwise (a gradient mask in the forward, or on .grad after a step "
                        "compiled without optimizer=)")
