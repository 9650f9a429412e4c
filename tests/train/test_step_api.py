"""The ``TrainStep`` object: the model's own tensors updated in place (``state_dict``
saves and loads), argument checking at call time, and dropout (training, and random ops replayed
bit-identically when recomputed under a budget)."""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from _train_util import assert_snapshot_equal, batches, grads_of, make, snapshot


def test_state_dict_saves_and_parameters_stay_the_models_own():
    model, inputs, loss_fn = make("resnet")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tensors = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    ptrs = {n: t.data_ptr() for n, t in tensors.items()}
    initial = copy.deepcopy(model.state_dict())
    step = remat.compile(model, inputs, loss_fn, optimizer=opt)
    for xs in batches(inputs, 3):
        step(*xs)
    # Updated in place: same tensors, same storage, new values.
    assert {n: t.data_ptr() for n, t in tensors.items()} == ptrs
    assert all(t is tensors[n] for n, t in list(model.named_parameters()) + list(model.named_buffers()))
    assert not torch.equal(model.stem[0].weight, initial["stem.0.weight"])
    assert int(model.stem[1].num_batches_tracked) == 3
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    fresh, _, _ = make("resnet")
    fresh.load_state_dict(saved["model"])
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fresh_opt.load_state_dict(saved["optim"])
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], fresh_opt.state[q]["momentum_buffer"])


@pytest.fixture(scope="module")
def mlp_step():
    model, inputs, loss_fn = make("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, inputs, opt, remat.compile(model, inputs, loss_fn, optimizer=opt)


@pytest.mark.parametrize("case", ["shape", "dtype", "target-dtype", "target-shape", "count", "not-a-tensor"])
def test_wrong_arguments_raise_type_error_and_change_nothing(mlp_step, case):
    model, (x, y), opt, step = mlp_step
    args, which = {
        "shape": ((x[:4], y), 0), "dtype": ((x.double(), y), 0), "target-dtype": ((x, y.int()), 1),
        "target-shape": ((x, y[:, None]), 1), "count": ((x,), None), "not-a-tensor": ((x.tolist(), y), 0)}[case]
    before = snapshot(model, opt)
    with pytest.raises(TypeError) as info:
        step(*args)
    msg = str(info.value)
    if which is None:
        assert "takes 2" in msg and "got 1" in msg
    else:
        assert f"argument {which}" in msg and "expected" in msg
        assert str(list(args[which].shape) if hasattr(args[which], "shape") else "") in msg
    assert_snapshot_equal(snapshot(model, opt), before)


def test_wrong_argument_after_steps_leaves_the_optimizer_alone(mlp_step):
    model, (x, y), opt, step = mlp_step
    step(x, y)
    taken = int(opt.state[model.head.weight]["step"])
    before = snapshot(model, opt)
    with pytest.raises(TypeError, match="argument 0"):
        step(x.T.contiguous(), y)
    assert_snapshot_equal(snapshot(model, opt), before)
    step(x, y)  # and it keeps working
    assert int(opt.state[model.head.weight]["step"]) == taken + 1


# ---------------------------------------------------------------- dropout
def test_gpt_with_dropout_trains():
    model, inputs, loss_fn = make("gpt", dropout=0.1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = remat.compile(model, inputs, loss_fn, optimizer=opt)
    assert step.compilation.imported.has_seed  # dropout is active: the step draws masks from a seed
    losses = [step(*inputs).item() for _ in range(8)]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.3, losses  # one fixed batch: the loss must come down
    # A fresh seed per step: masks differ, so eval-mode loss is not what the train steps saw.
    with torch.no_grad():
        model.eval()
        eval_loss = loss_fn(model(inputs[0]), inputs[1]).item()
    assert math.isfinite(eval_loss) and eval_loss < losses[0]


def test_dropout_is_replayed_when_recomputed_under_a_budget(monkeypatch):
    import remat.lower.small_values as small

    # About the replay of what a plan recomputes: small recomputed values (the masks' folded seeds)
    # stay recomputed, not read from their first run (remat.lower.small_values).
    monkeypatch.setattr(small, "find_small", lambda *args, **kwargs: [])
    model, inputs, loss_fn = make("gpt", dropout=0.1)
    runs = []
    for budget in (None, 0.85):
        m = copy.deepcopy(model)
        # The reference algorithms throughout: a lean cross-entropy (chosen by predicted time) would
        # sum the head's gradient in another order; this test is about the dropout mask's replay.
        step = remat.compile(m, inputs, loss_fn, budget=budget, seed=7, algorithms="reference")
        loss = step(*inputs)
        runs.append((step, loss, grads_of(m)))
    (base, l0, g0), (step, l1, g1) = runs
    r = step.report()
    assert r.measured_peak <= r.budget and r.measured_peak == r.predicted_peak

    def random_ops(fn):
        return sum(1 for ins in fn.entry.instrs if "random" in ins.op.tags)

    # Some dropout mask is drawn more than once (recomputed) ...
    assert random_ops(step.program) > random_ops(base.program) > 0
    # ... and the replay draws the same mask: bit-identical loss and gradients.
    assert torch.equal(l0, l1)
    for n, g in g0.items():
        assert torch.equal(g1[n], g), f"gradient of {n} differs"
    # The seed is really used: the next step (seed 7 + 1) draws other masks on the same,
    # unchanged parameters (no optimizer), so its loss differs.
    assert not torch.equal(base(*inputs), l0)


@pytest.mark.parametrize("change", ["amsgrad", "moved-parameter"])
def test_a_changed_form_of_update_is_refused_without_side_effects(mlp_step, change):
    """What shapes the compiled update (amsgrad here, a parameter's param group) cannot change
    after compile: the step says so and leaves the model and optimizer untouched."""
    model, (x, y), opt, step = mlp_step
    if change == "amsgrad":
        opt.param_groups[0]["amsgrad"] = True
    else:
        first = opt.param_groups[0]["params"].pop(0)
        opt.add_param_group({"params": [first]})
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="compile the step again"):
        step(x, y)
    assert_snapshot_equal(snapshot(model, opt), before)


# ---------------------------------------------------------------- bad indices: an error, and nothing changes
class _Classifier(torch.nn.Module):
    """A classifier, optionally with a parameter the loss never reads: its gradient is a constant
    zero, so without the index barrier its (weight-decayed) update would run before the loss is
    checked. (Under a budget the chain planner refuses such a parameter today: "no stage produces
    the gradient of program parameter 0", a separate limitation.)"""

    def __init__(self, unused: bool):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                        torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
        if unused:
            self.unused = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.body(x)


_OPTIMIZERS = {"sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
               "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}


@pytest.mark.parametrize("budget", [None, 0.93])
@pytest.mark.parametrize("opt_name", sorted(_OPTIMIZERS))
def test_out_of_range_targets_raise_and_change_nothing(opt_name, budget):
    torch.manual_seed(0)
    model = _Classifier(unused=budget is None)
    opt = _OPTIMIZERS[opt_name](model.parameters())
    x, y = torch.randn(256, 8), torch.randint(0, 10, (256,))
    step = remat.compile(model, (x, y), torch.nn.functional.cross_entropy, optimizer=opt, budget=budget)
    assert budget is None or step.compilation.recomputed > 0
    for k in range(2):  # on the first call (no optimizer state yet), then after a successful step
        before = snapshot(model, opt)
        for bad in (99, -5, 10):
            yb = y.clone()
            yb[3] = bad
            with pytest.raises(IndexError, match=rf"'(nll_loss|cross_entropy)(_grad)?': target {bad} is out of range; valid: \[0, 10\) "
                                                 r"or equal ignore_index \(-100\)"):
                step(x, yb)
            assert_snapshot_equal(snapshot(model, opt), before)
        step(x, y)
    if budget is None:  # no gradient reaches it: as eager PyTorch's optimizers, the step leaves it alone
        assert torch.equal(model.unused, torch.ones(3)) and model.unused not in opt.state


def test_out_of_range_token_id_raises_naming_gather_and_changes_nothing():
    model, (tokens, targets), loss_fn = make("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = remat.compile(model, (tokens, targets), loss_fn, optimizer=opt)
    before = snapshot(model, opt)
    bad = tokens.clone()
    bad[0, 1] = 10**6
    with pytest.raises(IndexError, match=r"'gather': index \(axis 0\) 1000000 is out of range; valid: \[0, \d+\)"):
        step(bad, targets)
    assert_snapshot_equal(snapshot(model, opt), before)
    step(tokens, targets)


def test_ignore_index_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 10))
    eager = copy.deepcopy(model)
    x, y = torch.randn(5, 8), torch.tensor([1, 3, 3, 7, 3])

    def loss_fn(out, t):
        return torch.nn.functional.cross_entropy(out, t, ignore_index=3)

    step = remat.compile(model, (x, y), loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    eopt = torch.optim.SGD(eager.parameters(), lr=0.5)
    for _ in range(2):
        loss = step(x, y)
        eopt.zero_grad()
        want = loss_fn(eager(x), y)
        want.backward()
        eopt.step()
        assert torch.allclose(loss, want, atol=1e-6)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_no_update_runs_before_the_first_check_of_an_index():
    """A gradient complete before the loss (a parameter the loss does not read) still gets its
    update after the targets were checked; a backward re-check (nll_loss_grad) is no barrier."""
    from remat.ir import DType, TensorType, parse
    from remat.step.optim import updates_from_torch
    from remat.step.program import Layout, last_new_index_check, step_program

    joint = parse("""func @train_joint(%0: f32[3], %1: f32[4,5], %2: i64[4]) -> (f32[], f32[3]) {
  %3 = constant {value=0.0, shape=[3]} : f32[3]
  %4 = nll_loss %1, %2 : f32[]
  %5 = constant {value=1.0} : f32[]
  %6 = nll_loss_grad %5, %2 {num_classes=5} : f32[4,5]
  return %4, %3
}
""")["train_joint"]
    assert last_new_index_check(joint.entry.instrs[:-1]) == 1
    p = torch.nn.Parameter(torch.ones(3))
    updates = updates_from_torch(torch.optim.SGD([p], lr=0.1, momentum=0.9), [p])
    fn = step_program(joint, Layout(1, 1, 2, False, 0), updates, [[TensorType(DType.f32, (3,))]], keep_grads=False)
    names = [ins.op.name for ins in fn.entry.instrs]
    assert names.index("sgd_step") > names.index("nll_loss"), names
    assert names.index("sgd_step") < names.index("nll_loss_grad"), names  # not held back by the re-check


def test_slices_of_a_larger_batch_are_counted_as_predicted():
    """Inputs that are views into a larger batch (``x[k * n:(k + 1) * n]``, not cloned): the VM counts
    the step's copy of each, so measured == predicted; its bytes by kind (measured on the first step)
    are the simulator's, and the training is that of cloned inputs."""
    from remat.distributed.memory import predicted

    model, (x, y), loss_fn = make("mlp")
    twin = copy.deepcopy(model)
    big_x, big_y = torch.cat([x, x.flip(0), x * 0.5]), torch.cat([y, y.flip(0), y])
    n = x.shape[0]
    steps = [remat.compile(m, (x, y), loss_fn, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2))
             for m in (model, twin)]
    for k in range(3):
        steps[0](big_x[k * n:(k + 1) * n], big_y[k * n:(k + 1) * n])
        steps[1](big_x[k * n:(k + 1) * n].clone(), big_y[k * n:(k + 1) * n].clone())
        assert steps[0].last_stats.peak_bytes == steps[0].predicted_peak == steps[1].last_stats.peak_bytes
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    s = steps[0]
    first, n_state = s.binding.layout.n_args, sum(len(ts) for ts in s.binding.state_types)
    want = predicted(s.program, s.binding.layout.n_params, range(first, first + n_state))
    assert s.kind_stats == want and s.last_stats.by_kind is None  # later steps record the peak only
    assert s.kind_stats.at_peak["inputs"] >= big_x[:n].nbytes + big_y[:n].nbytes
    assert s.kind_stats.at_peak["optimizer state"] == sum(2 * p.numel() * p.element_size() for p in model.parameters())
    assert s.report().memory == s.kind_stats.at_peak


@pytest.mark.parametrize("budget", [None, "min"])
def test_frozen_and_unused_parameters_get_no_gradient_and_no_update(budget):
    """As in eager PyTorch: a parameter with ``requires_grad=False``, and one computed with but never
    reaching the loss, get no ``.grad`` and no optimizer update (AdamW's weight decay would move
    them), and an optimizer over the trainable parameters alone is accepted. An unused parameter
    used to get a zero gradient and an update, and made every budgeted compile fail in the chain
    planner (found on Hugging Face's CANINE)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            _ = self.unused(h)  # computed, never used
            return self.c(torch.tanh(self.b(h)))

    torch.manual_seed(0)
    model = Net()
    model.b.weight.requires_grad_(False)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for trainable_only in (False, True):
        eager, ours = copy.deepcopy(model), copy.deepcopy(model)

        def adamw(m):
            ps = [p for p in m.parameters() if p.requires_grad] if trainable_only else m.parameters()
            return torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5)
        opt_e, opt_o = adamw(eager), adamw(ours)
        b = budget
        if budget == "min":
            probe = copy.deepcopy(model)
            with pytest.raises(remat.BudgetTooSmall) as e:
                remat.compile(probe, (x, y), F.cross_entropy, optimizer=adamw(probe), budget=1, keep_grads=True)
            b = e.value.minimum
        step = remat.compile(ours, (x, y), F.cross_entropy, optimizer=opt_o, budget=b, keep_grads=True)
        for _ in range(2):
            opt_e.zero_grad()
            F.cross_entropy(eager(x), y).backward()
            opt_e.step()
            step(x, y)
        for (name, p), q, p0 in zip(ours.named_parameters(), eager.parameters(), model.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)  # summation order
            if name in ("b.weight", "unused.weight", "unused.bias"):
                assert p.grad is None and torch.equal(p, p0), name
        def with_state(m, opt):
            return [n for n, p in m.named_parameters() if p in opt.state]
        assert with_state(ours, opt_o) == with_state(eager, opt_e)
