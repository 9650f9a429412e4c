"""A kernel failing during a step (out of memory, a backend error) leaves nothing silently
half-updated: fault injection fails each instruction of a small model's step in turn, and the
error (``remat.StepFailed``) names exactly the parameters already updated; every other parameter,
the optimizer's state and step counts, buffers, ``.grad`` and torch's random state are as before."""
from __future__ import annotations

import copy

import pytest
import torch

import remat
from _train_util import make


class Injected(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise Injected("injected fault")


def _kernel_steps(vm, name):
    """The VM's top-level kernel and call steps of @name, by instruction index (white box: the
    fault injector replaces one step's callable)."""
    plan = vm._plans[name]
    return {st.index: st for bp in plan.blocks for st in bp.steps if st.fn is not None or st.callee is not None}


def _snapshot(model, opt):
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
            [None if p.grad is None else p.grad.clone() for p in model.parameters()], torch.get_rng_state())


@pytest.mark.parametrize("name, make_opt, atomic", [
    ("gpt", lambda ps: torch.optim.AdamW(ps, lr=1e-2), False),
    ("resnet", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), False),
    ("gpt", lambda ps: torch.optim.AdamW(ps, lr=1e-2), True),
    ("resnet", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), True),
])
def test_each_failing_instruction_leaves_exactly_what_the_error_says(name, make_opt, atomic):
    """Without ``atomic``: the error names exactly the parameters updated; with it, they are rolled
    back and everything is as before the step."""
    kw = {"dropout": 0.1} if name == "gpt" else {}
    model, inputs, loss_fn = make(name, **kw)
    opt = make_opt(model.parameters())
    step = remat.compile(model, inputs, loss_fn, optimizer=opt, atomic=atomic, progress=lambda _: None)
    step(*inputs)  # the optimizer has its state: a failure must not touch it
    names = dict((id(p), n) for n, p in model.named_parameters())
    steps = _kernel_steps(step.vm, step.program.name)
    instrs = step.vm.instructions(step.program.name)
    tried = 0
    for index, st in sorted(steps.items()):
        before = _snapshot(model, opt)
        calls = step.binding.calls
        if st.callee is not None:  # a call (a fused group): fail its first kernel
            inner = _kernel_steps(step.vm, st.callee)
            st, index_in = inner[min(k for k, s in inner.items() if s.fn is not None)], index
        original = st.fn
        st.fn = _raise
        try:
            with pytest.raises(remat.StepFailed) as info:
                step(*inputs)
        finally:
            st.fn = original
        tried += 1
        e = info.value
        assert isinstance(e.__cause__, RuntimeError) and e.instruction == index
        sd, osd, grads, rng = before
        changed = {n for n, p in model.state_dict().items() if not torch.equal(p, sd[n])}
        failing_update = instrs[index].op.name in ("sgd_step", "adam_step")
        listed = set(e.updated)
        if atomic:
            assert not changed and not listed, (index, changed)
            assert set(e.restored) >= ({e.restored[-1]} if failing_update else set())
        assert changed <= listed, (index, instrs[index].op.name, changed - listed)
        assert listed - changed <= ({e.updated[-1]} if failing_update and listed else set()), (index, listed - changed)
        for (k, st_now), st_was in zip(opt.state_dict()["state"].items(), osd["state"].values()):
            pname = names[id(list(model.parameters())[k])]
            for key, v in st_now.items():
                same = torch.equal(v, st_was[key]) if torch.is_tensor(v) else v == st_was[key]
                if key == "step" or pname not in listed:
                    assert same, (index, pname, key)
        assert all((g is None and p.grad is None) or torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        assert torch.equal(torch.get_rng_state(), rng)
        assert step.binding.calls == calls
        if changed:  # the model is half-updated, as the error says: start again from the snapshot
            model.load_state_dict(sd)
            opt.load_state_dict(osd)
    assert tried == len(steps) > 10
    # Undisturbed, the step still runs.
    assert torch.isfinite(step(*inputs))
