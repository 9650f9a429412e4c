"""A step never runs stale: what it was compiled against (training mode, parameters, their
``requires_grad`` and dtype, the precision) is checked at every call, and a change is followed by
a step compiled for it, as eager PyTorch would follow it."""
from __future__ import annotations

import copy
import types

import pytest
import torch

import remat
from _train_util import eager_loss, make, rel_err


def _sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _eager_step(model, opt, inputs, loss_fn):
    opt.zero_grad()
    loss = eager_loss(model, inputs, loss_fn)
    loss.backward()
    opt.step()
    return loss


def _assert_models_close(a, b, tol=1e-5):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert rel_err(p, q) <= tol, f"{n}: {rel_err(p, q):.2e}"
    for (n, x), y in zip(a.named_buffers(), b.buffers()):
        assert torch.equal(x, y) if not x.is_floating_point() else rel_err(x, y) <= tol, n


def _assert_step_like_eager(step, m_r, m_e, o_e, inputs, loss_fn):
    """One compiled step on ``m_r`` and one eager step on ``m_e``: the same loss and the same model after."""
    got = step(*inputs)
    want = _eager_step(m_e, o_e, inputs, loss_fn)
    assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
    _assert_models_close(m_r, m_e)


@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_eval_after_compile_runs_in_eval_mode_like_eager(name):
    """A ResNet in eval mode normalises with its running statistics and leaves them alone; a GPT
    in eval drops no activations."""
    kw = {"dropout": 0.1} if name == "gpt" else {}
    model, inputs, loss_fn = make(name, **kw)
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    messages = []
    step = remat.compile(m_r, inputs, loss_fn, optimizer=_sgd(m_r), progress=messages.append)
    o_e = _sgd(m_e)
    step(*inputs)
    with torch.no_grad():  # dropout: same parameters after a first step in train mode, by construction
        for p, q in zip(m_e.parameters(), m_r.parameters()):
            p.copy_(q)
        for x, y in zip(m_e.buffers(), m_r.buffers()):
            x.copy_(y)
    o_e.load_state_dict(copy.deepcopy(step.optimizer.state_dict()))  # its own buffers, not remat's
    m_r.eval(), m_e.eval()
    _assert_step_like_eager(step, m_r, m_e, o_e, inputs, loss_fn)
    assert any("model.eval() was called" in m for m in messages)
    m_r.train()
    step(*inputs)  # back to the first step: no new compile
    assert step.shapes_cached() == 2


def test_a_submodule_put_in_eval_after_compile_is_followed_like_eager():
    """Only the stem in eval (a frozen, pretrained stem's batch norms): it normalises with its
    running statistics and leaves them alone, while the other stages still train their own."""
    model, inputs, loss_fn = make("resnet")
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    messages = []
    step = remat.compile(m_r, inputs, loss_fn, optimizer=_sgd(m_r), progress=messages.append)
    o_e = _sgd(m_e)
    m_r.stem.eval(), m_e.stem.eval()
    _assert_step_like_eager(step, m_r, m_e, o_e, inputs, loss_fn)
    assert any("the training mode of stem" in m for m in messages), messages


def test_a_replaced_submodule_is_used():
    """A new head module (the classifier swapped for fine-tuning) is trained, the old one left alone."""
    model, inputs, loss_fn = make("resnet")
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    step = remat.compile(m_r, inputs, loss_fn, optimizer=_sgd(m_r), progress=lambda _: None)
    step(*inputs)
    _eager_step(m_e, _sgd(m_e), inputs, loss_fn)  # the same first step, eagerly
    _assert_models_close(m_r, m_e)
    old = m_r.fc
    torch.manual_seed(3)
    m_r.fc = torch.nn.Linear(old.in_features, old.out_features)
    torch.manual_seed(3)
    m_e.fc = torch.nn.Linear(old.in_features, old.out_features)
    kept = old.weight.detach().clone()
    step.optimizer.add_param_group({"params": list(m_r.fc.parameters())})
    o_e = torch.optim.SGD(m_e.parameters(), lr=0.1)  # plain SGD on both: no state to carry over
    for g in step.optimizer.param_groups:
        g["momentum"] = 0.0
    got = step(*inputs)
    want = _eager_step(m_e, o_e, inputs, loss_fn)
    assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
    assert torch.equal(old.weight, kept)
    _assert_models_close(m_r, m_e)


def test_a_replaced_buffer_is_read_and_updated():
    """``bn.running_mean = torch.full(...)`` (or ``load_state_dict(assign=True)``): the step reads the
    new buffer and updates it, as eager does, instead of the orphaned old one."""
    model, inputs, loss_fn = make("resnet")
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    messages = []
    step = remat.compile(m_r, inputs, loss_fn, optimizer=_sgd(m_r), progress=messages.append)
    o_e = _sgd(m_e)
    step(*inputs)
    _eager_step(m_e, o_e, inputs, loss_fn)
    for m in (m_r, m_e):
        m.stem[1].running_mean = torch.full_like(m.stem[1].running_mean, 0.5)
        m.stem[1].running_var = torch.full_like(m.stem[1].running_var, 2.0)
    _assert_step_like_eager(step, m_r, m_e, o_e, inputs, loss_fn)
    assert any("buffer stem.1.running_mean was replaced" in m for m in messages), messages


def test_a_replaced_parameter_is_used():
    model, inputs, loss_fn = make("mlp")
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    step = remat.compile(m_r, inputs, loss_fn)  # gradients into .grad
    step(*inputs)
    name, old = list(m_r.named_parameters())[0]
    new = torch.nn.Parameter(torch.randn_like(old))
    owner = m_r.get_submodule(name.rsplit(".", 1)[0]) if "." in name else m_r
    setattr(owner, name.rsplit(".", 1)[-1], new)
    setattr(m_e.get_submodule(name.rsplit(".", 1)[0]) if "." in name else m_e, name.rsplit(".", 1)[-1],
            torch.nn.Parameter(new.detach().clone()))
    for p in [old, *m_r.parameters()]:
        p.grad = None
    step(*inputs)
    eager_loss(m_e, inputs, loss_fn).backward()
    assert new.grad is not None and old.grad is None  # the new parameter gets its gradient, the orphan none
    for (n, p), q in zip(m_r.named_parameters(), m_e.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-5, n


def test_a_parameter_stored_in_another_layout_after_compile_keeps_training():
    """The step updates parameters in place: one whose storage became non-contiguous since compile
    (``p.data`` rebound to a transposed layout) is stored contiguous again, not updated as a copy."""
    model, inputs, loss_fn = make("mlp")
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    o_r, o_e = _sgd(m_r), _sgd(m_e)
    step = remat.compile(m_r, inputs, loss_fn, optimizer=o_r)
    _assert_step_like_eager(step, m_r, m_e, o_e, inputs, loss_fn)
    for m in (m_r, m_e):
        w = next(p for p in m.parameters() if p.dim() == 2)
        w.data = w.data.t().contiguous().t()
    _assert_step_like_eager(step, m_r, m_e, o_e, inputs, loss_fn)
    _assert_step_like_eager(step, m_r, m_e, o_e, inputs, loss_fn)
    name, w = next((n, p) for n, p in m_r.named_parameters() if p.dim() == 2)
    w.data = torch.cat([w.data, w.data], 1)[:, :w.shape[1]]  # a strided view of a larger tensor
    before = [p.detach().clone() for p in m_r.parameters()]
    with pytest.raises(ValueError, match=f"parameter '{name}'.*shares its storage"):
        step(*inputs)
    assert all(torch.equal(p, q) for p, q in zip(m_r.parameters(), before))


def test_tying_and_growing_parameters_after_compile_are_named_and_followed():
    """Two slots given one parameter (tied), a parameter's data rebound to another shape (an
    embedding grown by two rows): each is announced by name and followed like eager."""
    torch.manual_seed(0)

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mix, self.out = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, i):
            return self.out(torch.tanh(self.mix(self.emb(i)))).mean(1)

    m_r = Tagger()
    m_e = copy.deepcopy(m_r)
    i, y = torch.randint(0, 10, (4, 5)), torch.randn(4, 8)
    said = []
    step = remat.compile(m_r, (i, y), torch.nn.functional.mse_loss, progress=said.append)
    step(i, y)
    for m in (m_r, m_e):
        m.out.weight = m.mix.weight
        m.emb.weight.data = torch.cat([m.emb.weight.data, torch.zeros(2, 8)])
        m.zero_grad()
    i = torch.randint(0, 12, (4, 5))
    got = step(i, y)
    want = torch.nn.functional.mse_loss(m_e(i), y)
    want.backward()
    assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want))
    for (n, p), q in zip(m_r.named_parameters(), m_e.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-5, n
    announced = " ".join(map(str, said))
    assert "parameter out.weight is now tied to mix.weight" in announced, announced
    assert "parameter emb.weight has shape [12, 8] now, was [10, 8]" in announced, announced


def test_a_parameter_put_in_an_empty_slot_is_used():
    """A layer built without a bias gets one after compile (its slot held None, so the count of slots
    did not change): the step compiles for the new parameter, as eager uses it, instead of running
    without it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    loss_fn = torch.nn.functional.cross_entropy
    messages = []
    step = remat.compile(model, (x, y), loss_fn, progress=messages.append)
    step(x, y)
    model[0].bias = torch.nn.Parameter(torch.full((3,), 5.0))
    for p in model.parameters():
        p.grad = None
    got = step(x, y)
    want = loss_fn(model(x), y)
    assert abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
    assert any("parameter 0.bias was added" in m for m in messages), messages
    (g_bias,) = torch.autograd.grad(want, [model[0].bias])
    assert model[0].bias.grad is not None and rel_err(model[0].bias.grad, g_bias) <= 1e-5


@pytest.mark.parametrize("kind", ["forward", "pre", "global"])
def test_a_forward_hook_registered_after_compile_runs_like_eager(kind):
    """The captured forward ran the hooks there were at compile; one registered since (on a module,
    as a pre-hook, or globally) is run by a step compiled for it, and once it is removed the first
    step runs again."""
    import torch.nn.modules.module as tmm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    loss_fn = torch.nn.functional.cross_entropy
    messages = []
    step = remat.compile(model, (x, y), loss_fn, progress=messages.append)
    first = float(step(x, y))
    if kind == "forward":
        handle = model[0].register_forward_hook(lambda mod, inp, out: out * 2)
    elif kind == "pre":
        handle = model[0].register_forward_pre_hook(lambda mod, inp: (inp[0] * 3,))
    else:
        handle = tmm.register_module_forward_hook(lambda mod, inp, out: out * 2 if isinstance(mod, torch.nn.ReLU) else None)
    try:
        got = float(step(x, y))
        want = float(loss_fn(model(x), y))
    finally:
        handle.remove()
    assert abs(got - want) <= 1e-6 * max(1.0, abs(want)) and abs(got - first) > 1e-3
    assert any("a forward hook was registered or removed" in m for m in messages), messages
    assert float(step(x, y)) == first


class _Scaled(torch.nn.Module):
    """A forward that reads a dropout's ``p``, a float attribute, a flag and a plain tensor attribute."""

    def __init__(self, p: float):
        super().__init__()
        self.inner, self.drop, self.head = torch.nn.Linear(4, 8), torch.nn.Dropout(p), torch.nn.Linear(8, 2)
        self.scale, self.shift_on = 1.0, False
        self.shift = torch.full((8,), 0.25)

    def forward(self, x):
        h = self.drop(torch.relu(self.inner(x))) * self.scale
        return self.head(h + self.shift if self.shift_on else h)


@pytest.mark.parametrize("change, said", [
    (lambda m: setattr(m.drop, "p", 0.0), "attribute drop.p was changed (0.5 -> 0.0)"),
    (lambda m: setattr(m, "scale", 3.0), "attribute scale was changed (1.0 -> 3.0)"),
    (lambda m: setattr(m, "shift_on", True), "attribute shift_on was changed (False -> True)"),
    (lambda m: (setattr(m, "shift_on", True), m.shift.fill_(2.0)), "attribute shift was changed"),
])
def test_a_changed_module_attribute_is_followed_like_eager(change, said):
    """Attributes the forward reads were constants of the capture: a changed one (by value; a tensor
    by identity or in place) gets a step compiled for it, as eager reads it at every call."""
    torch.manual_seed(0)
    model = _Scaled(0.5 if "drop.p" in said else 0.0)  # ends without dropout: losses compare exactly
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    loss_fn = torch.nn.functional.cross_entropy
    messages = []
    step = remat.compile(model, (x, y), loss_fn, progress=messages.append)
    step(x, y)
    step(x, y)
    assert not any("compiling a step" in m for m in messages)  # nothing changed: no new step
    change(model)
    got = float(step(x, y))
    assert abs(got - float(loss_fn(model(x), y))) <= 1e-6
    assert any(said in m for m in messages), messages


def test_a_replaced_parameter_not_in_the_optimizer_is_a_clear_error():
    model, inputs, loss_fn = make("mlp")
    step = remat.compile(model, inputs, loss_fn, optimizer=_sgd(model))
    step(*inputs)
    name = list(model.named_parameters())[0][0]
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    setattr(owner, name.rsplit(".", 1)[-1], torch.nn.Parameter(torch.zeros_like(getattr(owner, name.rsplit(".", 1)[-1]))))
    with pytest.raises(TypeError, match=f"parameter {name} was replaced.*not in the optimizer"):
        step(*inputs)


def test_freezing_and_unfreezing_after_compile_follow_eager():
    model, inputs, loss_fn = make("mlp")
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    o_r, o_e = _sgd(m_r), _sgd(m_e)
    step = remat.compile(m_r, inputs, loss_fn, optimizer=o_r)
    step(*inputs), _eager_step(m_e, o_e, inputs, loss_fn)
    head_r, head_e = list(m_r.parameters())[-1], list(m_e.parameters())[-1]
    head_r.requires_grad_(False), head_e.requires_grad_(False)  # frozen: no update any more
    step(*inputs), _eager_step(m_e, o_e, inputs, loss_fn)
    _assert_models_close(m_r, m_e)
    head_r.requires_grad_(True), head_e.requires_grad_(True)  # trainable again: updated again
    step(*inputs), _eager_step(m_e, o_e, inputs, loss_fn)
    _assert_models_close(m_r, m_e)


def test_unfreezing_a_layer_behind_under_adam_names_it_and_the_way_that_follows_eager():
    """Adam's bias correction reads each parameter's own step count; the fused update applies one:
    a layer unfrozen after the others trained is refused by name, and the step without optimizer=
    (the user's optimizer.step() on .grad), which the message advises, follows eager."""
    model, inputs, loss_fn = make("mlp")
    m_r, m_e, m_own = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    o_r, o_e, o_own = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (m_r, m_e, m_own))
    step = remat.compile(m_r, inputs, loss_fn, optimizer=o_r)
    own = remat.compile(m_own, inputs, loss_fn)
    for frozen in (True, False):
        for m in (m_r, m_e, m_own):
            list(m.parameters())[-1].requires_grad_(not frozen)
        if frozen:
            step(*inputs)
        else:
            name = list(dict(m_r.named_parameters()))[-1]
            with pytest.raises(ValueError, match=rf"0 step\(s\) for parameter '{name}' but 1 for .*without optimizer="):
                step(*inputs)
        _eager_step(m_e, o_e, inputs, loss_fn)
        o_own.zero_grad()
        own(*inputs)
        o_own.step()
    _assert_models_close(m_own, m_e)


def test_a_model_cast_to_another_dtype_gets_its_own_step():
    model, inputs, loss_fn = make("mlp")
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    step = remat.compile(m_r, inputs, loss_fn)
    step(*inputs)
    m_r.double(), m_e.double()
    x = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    for p in m_r.parameters():
        p.grad = None
    step(*x)
    eager_loss(m_e, x, loss_fn).backward()
    for (n, p), q in zip(m_r.named_parameters(), m_e.parameters()):
        assert p.grad.dtype == torch.float64 and rel_err(p.grad, q.grad) <= 1e-10, n


def test_a_step_called_under_autocast_computes_in_bf16_like_eager_autocast():
    model, inputs, loss_fn = make("gpt")
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    step = remat.compile(m_r, inputs, loss_fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = step(*inputs)
        want = eager_loss(m_e, inputs, loss_fn)
    want.backward()
    assert abs(float(got) - float(want)) < 1e-2 * abs(float(want))
    num = sum(((p.grad - q.grad) ** 2).sum() for p, q in zip(m_r.parameters(), m_e.parameters())) ** 0.5
    assert float(num / sum((q.grad ** 2).sum() for q in m_e.parameters()) ** 0.5) < 2e-2
    assert step.shapes_cached() == 2 and all(p.dtype == torch.float32 for p in m_r.parameters())


def test_an_input_that_requires_grad_is_a_clear_error():
    model, inputs, loss_fn = make("mlp")
    step = remat.compile(model, inputs, loss_fn)
    x = inputs[0].clone().requires_grad_(True)
    with pytest.raises(TypeError, match="requires grad.*x.detach()"):
        step(x, *inputs[1:])


class _LossConfig:
    alpha = 1.0


_LOSS_CONFIG = _LossConfig()


def _weighted_mse(out, y):
    return torch.nn.functional.mse_loss(out, y) * _LOSS_CONFIG.alpha


class _Weighted:
    def __init__(self):
        self.cfg = types.SimpleNamespace(loss=types.SimpleNamespace(alpha=1.0))

    def __call__(self, out, t):
        return _scaled(torch.nn.functional.cross_entropy(out, t), self.cfg.loss.alpha)


def _scaled(loss, alpha):
    return loss * alpha * _LOSS_CONFIG.alpha  # a helper of the user's reading a global


@pytest.mark.parametrize("kind", ["global object's field", "closure dict entry", "loss module attribute",
                                  "loss module in a closure, its weight rebound", "callable object's nested field",
                                  "global read by a helper"])
def test_a_value_the_loss_reads_changed_after_compile_is_followed_like_eager(kind, monkeypatch):
    """The loss's capture made what it reads constants (a loss weight annealed between steps): a
    change is announced and followed by a step compiled for it, as eager PyTorch follows it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    weights, key = {"ce": 1.0}, "ce"
    monkeypatch.setattr(_LOSS_CONFIG, "alpha", 1.0)
    if kind == "global object's field":
        y = torch.randn(6, 3)
        loss_fn, change, said = _weighted_mse, (lambda: setattr(_LOSS_CONFIG, "alpha", 4.0)), "_LOSS_CONFIG.alpha"
    elif kind == "closure dict entry":
        def loss_fn(out, t):
            return torch.nn.functional.cross_entropy(out, t) * weights[key]

        change, said = (lambda: weights.__setitem__("ce", 0.25)), "weights['ce']"
    elif kind == "loss module attribute":
        loss_fn = torch.nn.CrossEntropyLoss()
        change, said = (lambda: setattr(loss_fn, "label_smoothing", 0.2)), "loss_fn.label_smoothing"
    elif kind == "loss module in a closure, its weight rebound":
        crit = torch.nn.CrossEntropyLoss(weight=torch.ones(3))

        def loss_fn(out, t):
            return crit(out, t)

        change, said = (lambda: setattr(crit, "weight", torch.tensor([0.2, 1.0, 3.0]))), "crit.weight"
    elif kind == "callable object's nested field":
        loss_fn = _Weighted()
        change, said = (lambda: setattr(loss_fn.cfg.loss, "alpha", 3.0)), "loss_fn.cfg.loss.alpha"
    else:
        loss_fn = _Weighted()
        change, said = (lambda: setattr(_LOSS_CONFIG, "alpha", 0.5)), "_LOSS_CONFIG.alpha"
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    o_r, o_e = _sgd(m_r), _sgd(m_e)
    said_now = []
    step = remat.compile(m_r, (x, y), loss_fn, optimizer=o_r, progress=said_now.append)
    _assert_step_like_eager(step, m_r, m_e, o_e, (x, y), loss_fn)
    change()
    _assert_step_like_eager(step, m_r, m_e, o_e, (x, y), loss_fn)
    assert any(f"the loss function's {said} changed" in str(m) for m in said_now), said_now
    _assert_step_like_eager(step, m_r, m_e, o_e, (x, y), loss_fn)
    assert step.shapes_cached() == 2


def test_a_value_that_changes_at_every_call_compiles_at_every_call_within_a_bounded_cache(monkeypatch):
    """A loss reading a step counter is compiled again at each call (announced): correct, slow, and
    the steps kept are bounded (the least recently used dropped)."""
    from remat.train import api

    monkeypatch.setattr(api, "MAX_VARIANTS", 2)
    counter = {"calls": 0}

    def loss_fn(out, t):
        return torch.nn.functional.mse_loss(out, t) + 0 * counter["calls"]

    model, x, y = torch.nn.Linear(4, 2), torch.randn(3, 4), torch.randn(3, 2)
    said = []
    step = remat.compile(model, (x, y), loss_fn, progress=said.append)
    for _ in range(4):
        counter["calls"] += 1
        step(x, y)
    assert step.shapes_cached() == 3
    assert sum("the loss function's counter['calls'] changed" in str(m) for m in said) == 4


def test_a_loss_weight_kept_as_a_buffer_changes_without_a_compile():
    """What the announcement advises for a weight that changes every step: a buffer of the model,
    updated in place and read by the loss, is an argument of the one compiled step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model.register_buffer("alpha", torch.tensor(1.0))
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    o_r, o_e = _sgd(m_r), _sgd(m_e)
    x, y = torch.randn(6, 8), torch.randn(6, 3)
    step = remat.compile(m_r, (x, y), lambda out, t: torch.nn.functional.mse_loss(out, t) * m_r.alpha, optimizer=o_r)
    for k in range(3):
        m_r.alpha.fill_(1.0 + k)
        m_e.alpha.fill_(1.0 + k)
        _assert_step_like_eager(step, m_r, m_e, o_e, (x, y), lambda out, t: torch.nn.functional.mse_loss(out, t) * m_e.alpha)
    assert step.shapes_cached() == 1


_FACTOR = {"t": torch.tensor(2.0)}


class _ScaledByAGlobal(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(x) * _FACTOR["t"]  # a tensor that is not the model's


@pytest.mark.parametrize("where", ["loss", "forward"])
def test_a_parameter_outside_the_model_is_refused_not_frozen(where, tmp_path, monkeypatch):
    """A tensor that trains but is not the model's (a learnable temperature in the loss's closure, a
    global parameter in the forward) would be captured as a constant and never train: refused with
    where it is read, also after a capture of the same model was cached."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(_FACTOR, "t", torch.tensor(2.0))
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    scale = torch.nn.Parameter(torch.tensor(1.0))
    if where == "loss":
        model, loss_fn = torch.nn.Linear(8, 2), (lambda out, t: torch.nn.functional.mse_loss(out * scale, t))
    else:
        model, loss_fn = _ScaledByAGlobal(), torch.nn.functional.mse_loss
        remat.compile(model, (x, y), loss_fn)  # a constant: compiles, and its capture is cached
        _FACTOR["t"].requires_grad_()  # now it would train (and eager would train it)
        scale = _FACTOR["t"]
    opt = torch.optim.SGD([*model.parameters(), scale], lr=0.1)
    with pytest.raises(TypeError, match=r"reads a \w+ of shape \[\] \(float32\) read at .*test_never_stale.py.*"
                                        r"not a parameter of the model"):
        remat.compile(model, (x, y), loss_fn, optimizer=opt)


class _TiedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mix = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 8)

    def forward(self, i):
        return torch.tanh(self.mix(self.emb(i))) @ self.emb.weight.t()  # a view of a parameter


def test_views_of_the_models_parameters_are_its_own_also_when_the_capture_is_cached(tmp_path, monkeypatch):
    """The check that refuses a tensor that trains but is not the model's runs again on a cached
    capture (without gradients, where a view of a parameter is a leaf that requires grad): a tied
    head's ``weight.t()`` is the model's parameter, not a stranger."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    model, i = _TiedHead(), torch.randint(0, 20, (3, 5))
    y = torch.randint(0, 20, (3, 5))

    def loss_fn(out, t):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())

    remat.compile(copy.deepcopy(model), (i, y), loss_fn)
    again = remat.compile(copy.deepcopy(model), (i, y), loss_fn)
    assert again.report().capture_cached


class _MarksItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20)

    def forward(self, i):
        h = self.emb(i)
        if not h.requires_grad:  # as transformers' enable_input_require_grads hook does
            h = h.detach().requires_grad_()
        return self.out(h)


def test_a_tensor_the_forward_marks_as_requiring_grad_is_not_refused_from_the_cache(tmp_path, monkeypatch):
    """The cached capture's check runs the forward without grad, where a tensor the forward makes and
    marks ``requires_grad_()`` is a leaf too: it is the forward's own, not a stranger that trains."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    i, y = torch.randint(0, 20, (3, 5)), torch.randint(0, 20, (3, 5))

    def loss_fn(out, t):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())

    model = _MarksItsInput()
    remat.compile(copy.deepcopy(model), (i, y), loss_fn)
    assert remat.compile(copy.deepcopy(model), (i, y), loss_fn).report().capture_cached


def test_adam_with_decoupled_weight_decay_is_adamw():
    model, inputs, loss_fn = make("mlp")
    m_r, m_e = copy.deepcopy(model), copy.deepcopy(model)
    o_r = torch.optim.Adam(m_r.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    o_e = torch.optim.Adam(m_e.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    step = remat.compile(m_r, inputs, loss_fn, optimizer=o_r)
    for _ in range(3):
        step(*inputs), _eager_step(m_e, o_e, inputs, loss_fn)
    _assert_models_close(m_r, m_e, tol=1e-5)


@pytest.mark.parametrize("given,fraction", [("0.5", 0.5), ("1.0", 1.0), (".25", 0.25)])
def test_a_numeric_string_budget_means_the_number_it_spells(given, fraction):
    from remat.budget import Budget

    assert Budget.of(given) == Budget.of(float(given)) == Budget(fraction=fraction)
    with pytest.raises(ValueError, match="not valid"):
        Budget.of("2.5")


def test_first_calls_from_two_threads_do_not_crash():
    """The first call of a budgeted step measures the allocator under torch.profiler, which must not
    be started from two threads at once (it crashed the process): other threads run unmeasured."""
    import threading

    model, inputs, loss_fn = make("mlp")
    steps = [remat.compile(copy.deepcopy(model), inputs, loss_fn, budget="100%") for _ in range(2)]
    losses, errors = [], []

    def call(step):
        try:
            losses.append(float(step(*inputs)))
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(s,)) for s in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(losses) == 2 and losses[0] == losses[1]
    assert all(s.report().measured_allocator_peak is None for s in steps)  # measured later, on the main thread
    steps[0](*inputs)
    assert steps[0].report().measured_allocator_peak is not None


def test_dropout_follows_torch_manual_seed_across_recompiles_and_resumes():
    """Each step draws its dropout seed from torch's global generator, as eager dropout does: two
    seeds give two masks, the same seed the same step, a new compile continues the sequence, and a
    resume that restores the model, the optimizer and ``torch.get_rng_state()`` continues the run."""
    model, inputs, loss_fn = make("gpt", dropout=0.2)
    start = copy.deepcopy(model)
    step = remat.compile(model, inputs, loss_fn, progress=lambda _: None)  # no optimizer: the model stays
    torch.manual_seed(1)
    a = float(step(*inputs))
    torch.manual_seed(2)
    b = float(step(*inputs))
    torch.manual_seed(1)
    assert float(step(*inputs)) == a != b
    again = remat.compile(model, inputs, loss_fn, progress=lambda _: None)
    torch.manual_seed(1)
    assert float(again(*inputs)) == a  # the sequence is torch's, not the compile's

    m1 = copy.deepcopy(start)
    s1 = remat.compile(m1, inputs, loss_fn, optimizer=_sgd(m1), progress=lambda _: None)
    torch.manual_seed(5)
    s1(*inputs), s1(*inputs)
    saved = copy.deepcopy(m1.state_dict()), copy.deepcopy(s1.optimizer.state_dict()), torch.get_rng_state()
    want = float(s1(*inputs))
    m2 = copy.deepcopy(start)
    m2.load_state_dict(saved[0])
    o2 = _sgd(m2)
    o2.load_state_dict(saved[1])
    s2 = remat.compile(m2, inputs, loss_fn, optimizer=o2, progress=lambda _: None)
    torch.set_rng_state(saved[2])
    assert float(s2(*inputs)) == want
    _assert_models_close(m1, m2, tol=0.0)


def test_a_fixed_seed_ignores_torch_generator():
    """``seed=``: the step's own sequence (``seed + calls``), whatever torch's generator says."""
    model, inputs, loss_fn = make("gpt", dropout=0.2)
    step = remat.compile(model, inputs, loss_fn, seed=3, progress=lambda _: None)
    torch.manual_seed(1)
    a = float(step(*inputs))
    other = remat.compile(copy.deepcopy(model), inputs, loss_fn, seed=3, progress=lambda _: None)
    torch.manual_seed(2)
    assert float(other(*inputs)) == a


def test_backward_hooks_are_refused_not_ignored():
    """A gradient hook (a mask on a parameter's gradient, a module's backward hook) would change
    eager's gradients; remat cannot run one, so it refuses it by name, at compile or at the next call."""
    model, inputs, loss_fn = make("gpt")
    handle = model.blocks[0].attn.register_full_backward_hook(lambda m, gi, go: None) if hasattr(
        model.blocks[0], "attn") else model.blocks[0].register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(TypeError, match="remat cannot run backward hooks.*module blocks.0"):
        remat.compile(model, inputs, loss_fn)
    handle.remove()
    step = remat.compile(model, inputs, loss_fn, progress=lambda _: None)
    step(*inputs)
    model.ln_f.weight.register_hook(lambda g: g * 0)
    with pytest.raises(TypeError, match="parameter ln_f.weight"):
        step(*inputs)
