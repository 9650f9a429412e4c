"""The PyTorch importer: every zoo model (tiny) imported and evaluated against PyTorch eager, in
float32 and float64, training and eval mode; batch-norm running statistics; dropout masks; tied
weights; the unsupported-op error."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

import remat
from remat import zoo
from remat.frontend.torch_import import ImportedModel, UnsupportedOpError, import_module, supported_ops
from remat.ir import DType, TensorType, parse, verify

RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def evaluate(im: ImportedModel, *inputs, seed: int = 0, dialects=("numpy",)) -> list[np.ndarray]:
    """Run the imported function on the VM (by default with the numpy reference kernels)."""
    outs, _ = remat.run(im, *im.arguments(*inputs, seed=seed), dialects=dialects)
    return [np.asarray(o) for o in outs]


def assert_close(got, want, dtype, what):
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if want.dtype.kind in "iub":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    tol = RTOL[dtype]
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(got - want))) / scale if want.size else 0.0
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def _imported_roundtrips(im: ImportedModel) -> None:
    verify(im.module)
    text = str(im.module)
    assert str(parse(text)) == text


MODELS = ["mlp", "resnet", "gpt", "unet"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", MODELS)
def test_zoo_loss_and_buffers_match_eager(name, train, dtype):
    kwargs = {"dropout": 0.0} if name == "gpt" else {}
    model, inputs, loss_fn = zoo.make(name, "tiny", dtype, **kwargs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    im = import_module(model, inputs, loss_fn, train=train)
    # Importing neither runs nor changes the model.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training  # factories return models in training mode; the import restores it
    _imported_roundtrips(im)
    assert im.input_count == len(inputs) and not im.has_seed
    assert im.function.param_types[:im.state_count] == [
        TensorType(DType.f32 if t.dtype == torch.float32 else (DType.f64 if t.dtype == torch.float64 else DType.i64
                   if t.dtype == torch.int64 else DType.bool), tuple(t.shape)) for t in im.param_tensors()]

    ref_model = copy.deepcopy(model).train(train)
    want = loss_fn(ref_model(*inputs[:-1]), inputs[-1])
    outs = evaluate(im, *inputs)
    assert len(outs) == len(im.output_names)
    assert im.output_names[0] == "loss"
    assert_close(outs[0], want, dtype, f"{name} loss")
    # Training mode: the new batch-norm running statistics (and counters) equal PyTorch's.
    buffers = dict(ref_model.named_buffers())
    updated = im.output_names[1:]
    has_bn = any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert bool(updated) == (train and has_bn)
    for n, o in zip(updated, outs[1:]):
        assert n in buffers and n in im.buffer_names
        assert_close(o, buffers[n], dtype, f"{name} buffer {n}")
    assert {n.rsplit(".", 1)[1] for n in updated} <= {"running_mean", "running_var", "num_batches_tracked"}


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_zoo_forward_outputs_match_eager(name):
    kwargs = {"dropout": 0.0} if name == "gpt" else {}
    model, inputs, _ = zoo.make(name, "tiny", torch.float64, **kwargs)
    x = inputs[:-1]
    im = import_module(model, x, train=False)
    assert im.output_names == ["output"]
    (out,) = evaluate(im, *x)
    assert_close(out, copy.deepcopy(model).eval()(*x), torch.float64, f"{name} forward")


@pytest.mark.parametrize("name", ["resnet", "unet"])
def test_zoo_on_default_dialects(name):
    """The same imported training step on the preferred dialects (torch kernels where they exist)."""
    model, inputs, loss_fn = zoo.make(name, "tiny", torch.float32)
    im = import_module(model, inputs, loss_fn, train=True)
    outs = evaluate(im, *inputs, dialects=None)
    ref = copy.deepcopy(model)
    assert_close(outs[0], loss_fn(ref(inputs[0]), inputs[1]), torch.float32, f"{name} loss")
    buffers = dict(ref.named_buffers())
    for n, o in zip(im.output_names[1:], outs[1:]):
        assert_close(o, buffers[n], torch.float32, n)


def test_parameter_order_and_tied_weights():
    model, inputs, loss_fn = zoo.make_gpt("tiny", dropout=0.0)
    im = import_module(model, inputs, loss_fn)
    names = [n for n, _ in model.named_parameters()]  # tied lm_head.weight is listed once, as wte.weight
    assert im.param_names == names and "lm_head.weight" not in names
    assert im.buffer_names == [n for n, _ in model.named_buffers()]
    tensors = im.param_tensors()
    assert tensors[0] is not model.wte.weight and torch.equal(tensors[0], model.wte.weight)
    params = im.function.params
    assert len(params) == len(names) + len(im.buffer_names) + im.input_count
    assert params[-2].type == TensorType(DType.i64, tuple(inputs[0].shape))


def _dropout_net(p: float) -> nn.Module:
    return nn.Sequential(nn.Dropout(p), nn.Dropout(p))


def test_dropout_rate_scaling_and_determinism():
    p = 0.3
    x = torch.ones(64, 64, dtype=torch.float64)
    im = import_module(_dropout_net(p), (x,), train=True)
    assert im.has_seed and im.function.params[-1].type == TensorType(DType.i64, ())
    ops = [i.op.name for i in im.function.instructions()]
    assert ops.count("bernoulli") == 2 and ops.count("fold_seed") == 2
    salts = {i.attrs["salt"] for i in im.function.instructions() if i.op.name == "fold_seed"}
    assert len(salts) == 2  # each dropout draws from its own seed
    (y,) = evaluate(im, x, seed=7)
    kept = y != 0
    keep_rate = kept.mean()
    assert abs(keep_rate - (1 - p) ** 2) < 0.03  # two independent masks; 4096 draws, std ≈ 0.008
    np.testing.assert_allclose(y[kept], 1.0 / (1 - p) ** 2, rtol=1e-12)
    (y2,) = evaluate(im, x, seed=7)
    np.testing.assert_array_equal(y, y2)
    (y3,) = evaluate(im, x, seed=8)
    assert not np.array_equal(y, y3)


def test_inplace_dropout_exports_as_bernoulli_and_is_imported():
    """``nn.Dropout(inplace=True)`` (Hugging Face MobileNetV2's classifier) exports as ``bernoulli.p``
    on a fresh tensor, times the input: a seeded keep mask of rate 1-p, kept values scaled by 1/(1-p)."""
    p = 0.25
    torch.manual_seed(0)
    lin = nn.Linear(64, 64).double()
    x = torch.randn(64, 64, dtype=torch.float64)
    im = import_module(nn.Sequential(lin, nn.Dropout(p, inplace=True)), (x,), train=True)
    assert im.has_seed and [i.op.name for i in im.function.instructions()].count("bernoulli") == 1
    (y,) = evaluate(im, x, seed=3)
    kept = y != 0
    assert abs(kept.mean() - (1 - p)) < 0.03  # 4096 draws, std ≈ 0.007
    np.testing.assert_allclose(y[kept], lin(x).detach().numpy()[kept] / (1 - p), rtol=1e-12)
    np.testing.assert_array_equal(evaluate(im, x, seed=3)[0], y)


def test_dropout_off_in_eval_mode_and_with_p0():
    x = torch.randn(3, 4)
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    assert import_module(net, (x,), train=True).has_seed
    im = import_module(net, (x,), train=False)
    assert not im.has_seed
    assert_close(evaluate(im, x)[0], net.eval()(x), torch.float32, "eval-mode dropout")
    im = import_module(nn.Dropout(0.0), (x,), train=True)
    assert not im.has_seed
    assert_close(evaluate(im, x)[0], x, torch.float32, "dropout p=0")


def test_gpt_train_mode_dropout_loss_is_finite_and_seeded():
    model, inputs, loss_fn = zoo.make_gpt("tiny", torch.float64, dropout=0.1)
    im = import_module(model, inputs, loss_fn, train=True)
    a, b = evaluate(im, *inputs, seed=1)[0], evaluate(im, *inputs, seed=2)[0]
    ref = loss_fn(copy.deepcopy(model).eval()(inputs[0]), inputs[1]).item()
    assert np.isfinite(a) and a != b
    assert abs(a - ref) / ref < 0.2  # dropout perturbs, does not wreck, the loss


class _DropPath(nn.Module):
    """Stochastic depth as timm and transformers write it: ``floor(keep + rand)`` per sample."""

    def __init__(self, p: float):
        super().__init__()
        self.p, self.fc = p, nn.Linear(8, 8)

    def forward(self, x):
        keep = 1.0 - self.p
        mask = torch.floor(keep + torch.rand((x.shape[0], 1), dtype=x.dtype))
        return x + self.fc(x) / keep * mask


def test_stochastic_depth_rand_and_floor_are_seeded():
    p = 0.4
    x = torch.ones(4096, 8, dtype=torch.float64)
    net = _DropPath(p).double()
    im = import_module(net, (x,), train=True)
    assert im.has_seed
    ops = [i.op.name for i in im.function.instructions()]
    assert "uniform" in ops and "floor" in ops
    (y,) = evaluate(im, x, seed=3)
    branch = net.fc(x).detach().numpy() / (1 - p)
    dropped = np.isclose(y, 1.0).all(axis=1)
    np.testing.assert_allclose(y[~dropped], 1.0 + branch[~dropped], rtol=1e-12)  # kept rows: whole residual
    assert abs(dropped.mean() - p) < 0.03  # 4096 rows, std ≈ 0.008
    np.testing.assert_array_equal(y, evaluate(im, x, seed=3)[0])
    assert not np.array_equal(y, evaluate(im, x, seed=4)[0])


class _Flip(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.flip(self.proj(x), dims=[1])  # the unsupported line


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Flip()

    def forward(self, x):
        return self.inner(x).relu()


def test_unsupported_op_names_op_module_and_source():
    with pytest.raises(UnsupportedOpError) as ei:
        import_module(_Outer(), (torch.randn(2, 4),))
    e = ei.value
    msg = str(e)
    assert e.op == "aten.flip.default" and "aten.flip.default" in msg
    assert e.module_path == "inner" and "'inner'" in msg
    assert "test_torch_import.py" in e.source and "torch.flip(self.proj(x), dims=[1])" in e.source
    assert "remat translates" in msg and "remat.frontend.torch_import.SUPPORTED lists them" in msg
    assert len(msg) < 1000, msg  # the place and the op, not a list of every op remat translates


def test_unsupported_variant_explains_why():
    class RunningMax(nn.Module):
        def forward(self, x):
            return torch.cummax(x, 1).values

    with pytest.raises(UnsupportedOpError, match="aten.cummax"):
        import_module(RunningMax(), (torch.randn(3, 5),))

    class BoolIndex(nn.Module):
        def forward(self, x):
            return torch.div(x, 2, rounding_mode="trunc")

    with pytest.raises(UnsupportedOpError, match="rounding_mode"):
        import_module(BoolIndex(), (torch.randn(3, 5),))


def test_supported_ops_listed():
    ops = supported_ops()
    assert "aten.addmm.default" in ops and "aten.native_dropout.default" in ops
    assert list(ops) == sorted(ops)


def test_loss_target_count_and_errors():
    model, (x, y), loss_fn = zoo.make_mlp("tiny")
    im = import_module(model, (x, y), lambda out, target: nn.functional.cross_entropy(out, target))
    assert im.input_count == 2 and im.output_names == ["loss"]
    with pytest.raises(TypeError, match="num_targets"):
        import_module(model, (x, y), lambda *a: a[0].sum())
    im = import_module(model, (x, y), lambda *a: nn.functional.cross_entropy(*a), num_targets=1)
    assert im.function.result_types == [TensorType(DType.f32, ())]
    with pytest.raises(TypeError, match="takes 2 input"):
        im.arguments(x)


def test_lifted_constants_and_unused_parameters():
    class WithConstant(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.unused = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) + torch.tensor([1.0, 2.0])

    torch.manual_seed(0)
    net, x = WithConstant(), torch.randn(4, 2)
    im = import_module(net, (x,))
    assert im.param_names == ["lin.weight", "lin.bias"]  # trainable: some output depends on them
    assert im.frozen_names == ["unused.weight", "unused.bias"]  # still arguments, never differentiated
    assert len(im.constant_names) == 1 and im.state_count == 5
    assert_close(evaluate(im, x)[0], net(x), torch.float32, "output")


@pytest.mark.parametrize("name", MODELS)
def test_zoo_gradients_match_autograd(name):
    """End to end: the imported loss, differentiated by remat's autodiff, gives PyTorch's gradients."""
    from remat.autodiff.api import gradient_transform

    kwargs = {"dropout": 0.0} if name == "gpt" else {}
    model, inputs, loss_fn = zoo.make(name, "tiny", torch.float64, **kwargs)
    im = import_module(model, inputs, loss_fn, train=True)
    n = len(im.param_names)
    module, gname = gradient_transform(tuple(range(n)))(im.module, im.function.name)
    # Cotangents: 1 for the loss, 0 for the updated running statistics (integer counters take none).
    cts = [np.ones((), t.dtype.numpy) if i == 0 else np.zeros(t.shape, t.dtype.numpy)
           for i, t in enumerate(im.function.result_types) if t.dtype.is_float]
    if len(module[gname].params) == im.state_count + im.input_count:
        cts = []  # a single scalar output needs no cotangent argument
    outs, _ = remat.run(module[gname], *im.arguments(*inputs), *cts, dialects=("numpy",))
    ref = copy.deepcopy(model)
    loss_fn(ref(inputs[0]), inputs[1]).backward()
    assert len(outs) == n
    for (pname, p), g in zip(ref.named_parameters(), outs):
        assert_close(g, p.grad, torch.float64, f"{name} grad of {pname}")


class _Sorter(nn.Module):
    def forward(self, x):
        return torch.cummax(x, dim=-1).values  # the second unsupported op


class _TwoProblems(nn.Module):
    """flip in four submodules, cummax in one more, each followed by supported ops."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Flip() for _ in range(4))
        self.head = _Sorter()

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x).tanh()
        return self.head(x) * 2


def test_every_unsupported_op_is_listed_in_one_error():
    with pytest.raises(UnsupportedOpError) as ei:
        import_module(_TwoProblems(), (torch.randn(2, 4),))
    e = ei.value
    assert e.ops == ["aten.flip.default", "aten.cummax.default"]
    # one problem per untranslatable node; the supported ops computed from them are not reported
    assert [p.op for p in e.problems] == ["aten.flip.default"] * 4 + ["aten.cummax.default"]
    assert [p.module_path for p in e.problems] == [f"blocks.{i}" for i in range(4)] + ["head"]
    assert all("test_torch_import.py" in p.source for p in e.problems)
    assert "torch.cummax(x, dim=-1)" in e.problems[-1].source
    msg = str(e)
    assert "2 PyTorch ops that remat cannot translate, at 5 places" in msg
    assert "aten.flip.default: 4 uses" in msg and "aten.cummax.default: 1 use " in msg
    assert "in module 'blocks.0'" in msg and "in module 'head'" in msg
    assert "... and 1 more place\n" in msg  # at most MAX_PLACES places per op are spelled out
    assert e.op == "aten.flip.default" and e.module_path == "blocks.0"  # the first problem's


def test_unsupported_op_list_is_capped():
    from remat.frontend.torch_import import Unsupported

    problems = [Unsupported(f"aten.op{i}.default", f"m{i}", f"model.py:{i}") for i in range(25)]
    msg = str(UnsupportedOpError(problems=problems))
    assert "25 PyTorch ops" in msg and "aten.op19.default: 1 use" in msg
    assert "aten.op20.default: 1 use" not in msg and "... and 5 more ops: aten.op20.default" in msg


def test_keyword_options_are_compiled_in():
    """A non-tensor keyword input (CLIP's ``return_loss=True``) is an option passed to the model as
    it is: the step is called with the same value or without it; another value, or a non-scalar,
    is refused by name. It crashed deep in the importer before."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, return_loss=False, scale=1.0):
            y = self.lin(x) * scale
            return {"loss": y.square().mean() if return_loss else None, "logits": y}

    torch.manual_seed(0)
    model, x = M(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    ref(x, return_loss=True, scale=0.5)["loss"].backward()
    step = remat.compile(model, dict(x=x, return_loss=True, scale=0.5))
    loss = step(x=x, return_loss=True, scale=0.5)
    assert_close(loss, ref(x, return_loss=True, scale=0.5)["loss"], torch.float32, "loss")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, torch.float32, "grad")
    step(x=x)  # options left out: as compiled
    with pytest.raises(TypeError, match=r"compiled with return_loss=True; got return_loss=False"):
        step(x=x, return_loss=False)
    with pytest.raises(TypeError, match=r"keyword example input scale=\[0.5\] is a list"):
        remat.compile(M(), dict(x=x, return_loss=True, scale=[0.5]))


@pytest.mark.parametrize("act", [nn.ELU(alpha=0.7), nn.SELU(), nn.CELU(alpha=1.5)], ids=["elu", "selu", "celu"])
def test_elu_family_is_decomposed_and_trains_as_eager(act):
    """ELU (and SELU, CELU, which PyTorch writes with it) has no rule of remat's: PyTorch's own
    decomposition gives ops remat lowers, and a step's loss and gradients match eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), act, nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 8) * 2, torch.randn(6, 4)

    def loss_fn(out, t):
        return (out - t).square().mean()

    loss = remat.compile(model, (x, y), loss_fn)(x, y)
    want = loss_fn(ref(x), y)
    want.backward()
    assert_close(loss, want, torch.float32, "loss")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, torch.float32, "grad")


def test_one_tensor_passed_as_two_inputs_stays_two_inputs():
    """An example passing one tensor as two inputs (``labels=input_ids``) compiles a step with two
    inputs: a later call with two different tensors reads each (torch.export alone captures the
    pair as one input, and the step read the first for both, silently)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16)

        def forward(self, input_ids, labels):
            logits = self.head(self.emb(input_ids))
            return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}

    torch.manual_seed(0)
    model = M()
    ids, other = torch.randint(0, 16, (2, 5)), torch.randint(0, 16, (2, 5))
    ref = copy.deepcopy(model)
    step = remat.compile(model, dict(input_ids=ids, labels=ids))
    loss = step(input_ids=other, labels=ids)
    want = ref(other, ids)["loss"]
    want.backward()
    assert_close(loss, want, torch.float32, "loss")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, torch.float32, "grad")
    positional = remat.compile(copy.deepcopy(ref), (ids, ids))  # positionally too
    assert_close(positional(other, ids), want, torch.float32, "loss")
    # Called with one tensor for both, the step holds two inputs, as planned: measured == predicted
    # (tests/train/test_allocator_budget.py checks the allocator's peak).
    step = remat.compile(copy.deepcopy(ref), dict(input_ids=ids, labels=ids))
    step(input_ids=ids, labels=ids)
    assert step.report().measured_peak == step.report().predicted_peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_precision_batch_norm_updates_running_statistics_as_eager(dtype):
    """PyTorch's functional batch norm gives a half-precision input's new running statistics in f32
    (its statistics are f32) and the module's copy rounds them into its buffers: the imported step
    trains, and its loss and buffers equal eager's to half-precision rounding (convolutions and
    normalisation round in another order than eager's)."""
    model, inputs, loss_fn = zoo.make("resnet", "tiny", dtype, batch=8)
    eager = copy.deepcopy(model)
    step = remat.compile(model, inputs, loss_fn, dialects=("torch",))
    loss = step(*inputs)
    want = loss_fn(eager(*inputs[:-1]), inputs[-1])
    torch.testing.assert_close(loss.detach().float(), want.detach().float(), rtol=1e-2, atol=0)
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        assert b.dtype == c.dtype, name
        torch.testing.assert_close(b.float(), c.float(), rtol=1e-2, atol=1e-3, msg=name)
