"""``remat.max_batch``: the largest batch whose training step fits a byte budget, and eager
PyTorch's largest batch under the same cap (measured), for comparison.

The search compiles a step per candidate batch size and never runs one: a compiled step's
predicted peak is exactly its measured peak, so a candidate fits when planning it under the
budget succeeds (``BudgetTooSmall`` otherwise). Candidates go 1, 2, 4, … until one does not fit,
then bisect between the last that fits and the first that does not. Each candidate is captured at
its own shapes (the IR's shapes are static: reshape targets and the like are baked in by
``torch.export``, so a capture cannot be re-specialised to another batch cheaply).

Micro-batching is off in the search (``micro_batches=1``): with it, any batch splits into
micro-batches of one sample, so the largest batch would be bounded only by the inputs' storage.
"""
from __future__ import annotations

import copy
import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..budget import parse_budget
from ..errors import BudgetTooSmall, format_bytes

MakeBatch = Callable[[int], Any]
"""``make_batch(n)``: the example inputs and targets for batch size ``n`` (a tuple or a dict of
keyword inputs, as ``remat.compile`` takes them)."""


@dataclass
class Probe:
    """One candidate batch size of the search: whether it fits and the peak or minimum (bytes)."""

    batch: int
    fits: bool
    bytes: int  # fits: the planned (= measured) peak; else the minimum feasible budget at this batch


@dataclass
class MaxBatch:
    """The largest batch that fits, its compiled step, and every candidate tried (in order)."""

    batch: int
    step: Any  # remat.train.api.TrainStep compiled for ``batch`` (None when even the smallest does not fit)
    budget: int
    probes: list[Probe] = field(default_factory=list)

    def __str__(self) -> str:
        tried = ", ".join(f"{p.batch}: {'fits, peak' if p.fits else 'no, needs'} {format_bytes(p.bytes)}"
                          for p in self.probes)
        return f"largest batch {self.batch} under {format_bytes(self.budget)} (candidates: {tried})"


def absolute_budget(budget) -> int:
    """Bytes of a budget given in bytes or as a size ('1.5GiB'); ValueError for none, for a fraction
    or percentage in any spelling ('50%', 0.5, '0.5', '1.0': relative to a peak that changes with the
    batch size) and for anything not a budget."""
    if budget is None:
        raise ValueError("max_batch needs a budget in bytes or a size such as '2GiB'")
    try:  # a fraction or percentage, in any spelling ('50%', 0.5, '0.5', '1.0'), is relative to a reference
        relative = parse_budget(budget, reference=1 << 40) != parse_budget(budget, reference=1 << 41)
    except ValueError:
        relative = False  # not a valid budget at all: parse_budget below says what is valid
    if relative:
        raise ValueError(f"max_batch needs an absolute budget (bytes or a size such as '1.5GiB'), got {budget!r}: "
                         "a fraction of the unconstrained peak changes with the batch size")
    return parse_budget(budget, reference=1)


def search(fits: Callable[[int], tuple[bool, int, Any]], start: int = 1, limit: int = 1 << 16,
           target: int | None = None) -> tuple[int, Any, list[Probe]]:
    """The largest ``n`` in ``[start, limit]`` with ``fits(n)[0]`` (0 when ``start`` does not fit),
    assuming that fitting is monotone in ``n``: doubling from ``start``, then narrowing the bracket.
    ``fits(n)`` returns ``(fits, bytes, payload)``; the payload of the answer is returned too.
    With ``target`` (the budget the bytes are compared with) the bracket is narrowed at the point
    where the bytes, interpolated linearly between its ends, reach ``target`` (then at its
    neighbour, which usually closes it), falling back to bisection whenever that does not halve it."""
    probes: list[Probe] = []
    best_n, best_payload = 0, None
    by_n: dict[int, int] = {}

    def probe(n: int) -> bool:
        nonlocal best_n, best_payload
        ok, nbytes, payload = fits(n)
        probes.append(Probe(n, ok, nbytes))
        by_n[n] = nbytes
        if ok and n > best_n:
            best_n, best_payload = n, payload
        return ok

    n, hi = start, None
    while n <= limit:
        if not probe(n):
            hi = n
            break
        n *= 2
    if hi is None:  # every doubling up to ``limit`` fits
        if best_n == limit or probe(limit):
            return best_n, best_payload, probes
        hi = limit
    lo = best_n
    interpolate = target is not None
    while hi - lo > 1 and lo >= start:
        width, guess = hi - lo, (lo + hi) // 2
        if interpolate and by_n[hi] > by_n[lo]:
            est = lo + (target - by_n[lo]) * (hi - lo) / (by_n[hi] - by_n[lo])
            guess = min(max(int(est), lo + 1), hi - 1)
        if probe(guess):
            lo = guess
            if interpolate and hi - lo > 1 and probe(lo + 1) is False:
                hi = lo + 1
            elif interpolate and hi - lo > 1:
                lo += 1
        else:
            hi = guess
            if interpolate and hi - lo > 1:
                if probe(hi - 1):
                    lo = hi - 1
                else:
                    hi -= 1
        interpolate = target is not None and hi - lo <= width // 2  # an estimate that did not halve: bisect next
    return best_n, best_payload, probes


def max_batch(model, make_batch: MakeBatch, loss_fn: Callable | None = None, optimizer=None, budget=None, *,
              start: int = 1, limit: int = 1 << 16, progress: Callable[[str], None] | None = None,
              **options: Any) -> MaxBatch:
    """The largest batch size ``n`` whose training step of ``model`` fits ``budget`` (bytes or a
    size such as "1.5GiB", including parameters, gradients and optimizer state), with the step
    compiled for it (``result.step``; call it with ``make_batch(n)``'s tensors to train at ``n``).

    ``make_batch(n)`` returns example inputs and targets for batch size ``n``. No step is run:
    each candidate is compiled (capture and plan) and fits when its plan's exact peak does. Other
    ``options`` go to ``remat.compile`` (``micro_batches`` is fixed to 1). Nothing of the model or
    the optimizer is modified."""
    from .api import compile

    cap = absolute_budget(budget)
    if options.pop("micro_batches", 1) not in (1, None):
        raise ValueError("max_batch searches whole-batch steps (micro_batches=1): with micro-batching the batch is "
                         "bounded only by the inputs' storage")
    say = progress or (lambda msg: None)

    def fits(n: int) -> tuple[bool, int, Any]:
        try:
            step = compile(model, make_batch(n), loss_fn, optimizer, cap, **options)
        except BudgetTooSmall as e:
            say(f"batch {n}: does not fit (needs {format_bytes(e.minimum)})")
            return False, e.minimum, None
        say(f"batch {n}: fits (peak {format_bytes(step.predicted_peak)})")
        return True, step.predicted_peak, step

    n, step, probes = search(fits, start, limit, target=cap)
    return MaxBatch(n, step, cap, probes)


def eager_step_peak(model, batch: Sequence | dict, loss_fn: Callable | None = None, optimizer=None) -> int:
    """PyTorch's allocator peak (bytes) of one eager training step on ``batch``, measured with the
    profiler's memory events (``runtime.allocator``) on copies of the model and optimizer: the
    steady-state step (a first step creates the optimizer's state), with the parameters, optimizer
    state and the batch resident and gradients set to None before it (``zero_grad()``).
    ``batch``: inputs then targets (a dict: keyword inputs, the model computing its own loss)."""
    import torch

    from ..frontend.torch_import import loss_module
    from ..runtime.allocator import allocation_trace, peak_of_trace

    m = copy.deepcopy(model)
    opt = None
    if optimizer is not None:  # the same param groups and settings, over the copy's parameters
        index = {id(p): i for i, p in enumerate(model.parameters())}
        mine = list(m.parameters())
        if any(id(p) not in index for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer holds tensors that are not the model's parameters; pass an optimizer "
                             "built from model.parameters()")
        opt = type(optimizer)([{**{k: v for k, v in g.items() if k != "params"},
                                "params": [mine[index[id(p)]] for p in g["params"]]} for g in optimizer.param_groups])
    wrapper, tensors = loss_module(m, batch, loss_fn)

    def step() -> None:
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        else:
            for p in m.parameters():
                p.grad = None
        wrapper(*tensors).backward()
        if opt is not None:
            opt.step()

    step()  # the optimizer's state now exists, as in every later step
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    else:
        for p in m.parameters():
            p.grad = None
    storages: dict[int, int] = {}
    live = list(m.parameters()) + list(m.buffers()) + list(tensors)
    if opt is not None:
        live += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    for t in live:
        st = t.untyped_storage()
        storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
    gc.collect()
    _, events = allocation_trace(step)
    return sum(storages.values()) + peak_of_trace(events)[0]


def eager_max_batch(model, make_batch: MakeBatch, loss_fn: Callable | None = None, optimizer=None, budget=None, *,
                    start: int = 1, limit: int = 1 << 16, progress: Callable[[str], None] | None = None
                    ) -> tuple[int, list[Probe]]:
    """The largest batch eager PyTorch trains within ``budget`` (allocator peak by
    :func:`eager_step_peak`, measured per candidate: on CPU nothing fails when over a cap), by the
    same doubling-then-bisection search as :func:`max_batch`; and the candidates measured."""
    cap = absolute_budget(budget)
    say = progress or (lambda msg: None)

    def fits(n: int) -> tuple[bool, int, Any]:
        peak = eager_step_peak(model, make_batch(n), loss_fn, optimizer)
        say(f"eager batch {n}: peak {format_bytes(peak)}")
        return peak <= cap, peak, None

    n, _, probes = search(fits, start, limit, target=cap)
    return n, probes
