"""``precision="bf16"``: the step computes as eager PyTorch under ``torch.autocast`` in bfloat16,
with fp32 master weights, and its bf16 bytes are planned and measured as they are."""
from __future__ import annotations

import copy

import pytest
import torch

import remat
from _train_util import eager_loss, make


def _global_rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(((a.double() - b.double()) ** 2).sum() for a, b in zip(got, want)) ** 0.5
    return float(num / sum((b.double() ** 2).sum() for b in want) ** 0.5)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def _eager(model, inputs, loss_fn, autocast: bool):
    m = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        eager_loss(m, inputs, loss_fn).backward()
    return _grads(m)


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet"])
def test_bf16_gradients_match_eager_autocast(name):
    model, inputs, loss_fn = make(name)
    want = _eager(model, inputs, loss_fn, autocast=True)
    m = copy.deepcopy(model)
    step = remat.compile(m, inputs, loss_fn, precision="bf16")
    step(*inputs)
    assert _global_rel(_grads(m), want) < 2e-2
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in m.parameters())
    r = step.report()
    assert r.measured_peak == r.predicted_peak
    assert r.precision == "bf16" and r.casts > 0 and sum(r.low_precision_ops.values()) > 0
    assert "bf16 (torch.autocast's op lists" in str(r)


def test_bf16_unet_is_as_accurate_as_eager_autocast():
    """The tiny U-Net's bf16 gradients are far from fp32 in eager PyTorch too (deep convolutions
    with batch norms over small maps): remat's are as close to the fp32 ones as eager autocast's."""
    model, inputs, loss_fn = make("unet")
    fp32, eager_bf16 = _eager(model, inputs, loss_fn, False), _eager(model, inputs, loss_fn, True)
    m = copy.deepcopy(model)
    remat.compile(m, inputs, loss_fn, precision="bf16")(*inputs)
    assert _global_rel(_grads(m), fp32) <= 1.25 * _global_rel(eager_bf16, fp32)


def test_bf16_activations_take_fewer_bytes_and_plan_under_a_budget():
    model, inputs, loss_fn = make("gpt")
    fp32 = remat.compile(copy.deepcopy(model), inputs, loss_fn)
    bf16 = remat.compile(copy.deepcopy(model), inputs, loss_fn, precision="bf16")
    # Fewer, not half: at the peak the fp32 parts (layer norms, the loss) and the weights' bf16 copies
    # are live too (zoo GPT small: 18.7 -> 13.2 MB of activations; tiny: 166 -> 154 KB).
    assert bf16.report().memory["activations"] < fp32.report().memory["activations"]
    probe = copy.deepcopy(model)
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(probe, inputs, loss_fn, optimizer=torch.optim.AdamW(probe.parameters()), precision="bf16",
                      budget=1)
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    step = remat.compile(m, inputs, loss_fn, optimizer=opt, precision="bf16", budget=e.value.minimum)
    for _ in range(2):
        step(*inputs)
    r = step.report()
    assert r.measured_peak == r.predicted_peak <= r.budget
    assert all(p.dtype == torch.float32 for p in m.parameters())


def test_a_model_already_under_autocast_is_not_cast_twice():
    model, inputs, loss_fn = make("mlp")

    class Autocast(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.inner(x)

    plain = remat.compile(copy.deepcopy(model), inputs, loss_fn, precision="bf16").report()
    wrapped = remat.compile(Autocast(copy.deepcopy(model)), inputs, loss_fn, precision="bf16").report()
    assert (wrapped.casts, wrapped.cast_bytes, wrapped.low_precision_ops) == \
        (plain.casts, plain.cast_bytes, plain.low_precision_ops)
    assert plain.casts > 0


def test_fp16_and_unknown_precisions_are_refused_clearly():
    model, inputs, loss_fn = make("mlp")
    with pytest.raises(NotImplementedError, match="loss scaling"):
        remat.compile(model, inputs, loss_fn, precision="fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        remat.compile(model, inputs, loss_fn, precision="int8")


@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_without_native_bf16_is_named_at_compile_and_in_the_report(monkeypatch, native):
    """Where the processor has no bf16 instructions (PyTorch's bf16 kernels run in scalar code), the
    compile warns once and ``report()`` says so; where it has them, neither does."""
    import warnings

    import remat.runtime.hardware as hardware

    monkeypatch.setattr(hardware, "native_precision", lambda precision, device=None: native or precision == "fp32")
    model, inputs, loss_fn = make("mlp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = remat.compile(model, inputs, loss_fn, precision="bf16")
        fp32 = remat.compile(copy.deepcopy(model), inputs, loss_fn)
    said = [w for w in caught if issubclass(w.category, RuntimeWarning) and "remat: precision='bf16'" in str(w.message)]
    assert len(said) == (0 if native else 1)
    assert (step.report().precision_note is None) is native and fp32.report().precision_note is None
    if not native:
        assert "scalar code" in str(said[0].message) and said[0].filename == __file__  # the caller's line
        assert "no AVX-512 BF16 or AMX instructions" in str(step.report())


def test_the_report_names_the_weights_dtype():
    """fp32 parameters are master weights under autocast; bf16 ones (pure bf16 training) are said to be bf16."""
    for dtype, says in ((torch.float32, "fp32 master weights"), (torch.bfloat16, "bf16 weights")):
        model, inputs, loss_fn = remat.zoo.make("mlp", "tiny", dtype=dtype)
        rep = remat.compile(model, inputs, loss_fn, precision="bf16").report()
        assert rep.weights == {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
        assert says in str(rep)


def test_bf16_ops_keep_their_submodule_paths():
    """torch.export makes the autocast block a higher-order op; its ops keep the submodule and source
    line they came from (the report's recomputed layers, error messages), as in fp32."""
    def paths(precision):
        model, inputs, loss_fn = remat.zoo.make("gpt", "tiny", dropout=0.0)
        step = remat.compile(model, inputs, loss_fn, precision=precision)
        return {i.loc.path for i in step.compilation.joint.entry.instrs if i.loc is not None}

    fp32, bf16 = paths("fp32"), paths("bf16")
    assert "blocks.0.attn" in fp32 and fp32 - {""} <= bf16


def _ops_of(step) -> set[str]:
    return {ins.op.name for ins in step.program.instructions()}


class _LongAttention(torch.nn.Module):
    """One causal attention written out, over a sequence long against its width: its scores
    dominate the step's bytes."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        s = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        y = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, t, c)
        return self.out(y)


@pytest.mark.parametrize("name", ["gpt", "long"])
def test_bf16_explicit_attention_runs_as_eager_autocast_and_fuses_only_to_fit(name):
    """Attention written out (matmul, mask, softmax, matmul) stays explicit in bf16, as eager
    autocast runs it: its bf16 matmuls and softmax with the probabilities kept beat the fused
    kernels on the CPU. The fused ``attention`` is the lean algorithm, chosen only where the explicit
    form cannot fit the budget (``long``: at its floor); both are within bf16 tolerance of eager
    autocast."""
    if name == "gpt":
        model, inputs, loss_fn = make("gpt")  # no dropout: the import pass's case
    else:
        torch.manual_seed(0)
        model, inputs = _LongAttention(), (torch.randn(2, 128, 16), torch.randn(2, 128, 16))
        loss_fn = torch.nn.functional.mse_loss
    want = _eager(model, inputs, loss_fn, autocast=True)
    m = copy.deepcopy(model)
    free = remat.compile(m, inputs, loss_fn, precision="bf16")
    free(*inputs)
    assert "softmax" in _ops_of(free) and "attention" not in _ops_of(free)
    assert _global_rel(_grads(m), want) < 2e-2
    fp32 = remat.compile(copy.deepcopy(model), inputs, loss_fn)
    assert "attention" in _ops_of(fp32)  # in fp32 the import pass fuses it
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(copy.deepcopy(model), inputs, loss_fn, precision="bf16", budget=1)
    floor = e.value.minimum
    m2 = copy.deepcopy(model)
    lean = remat.compile(m2, inputs, loss_fn, precision="bf16", budget=floor)
    lean(*inputs)
    r = lean.report()
    assert r.measured_peak == r.predicted_peak <= floor
    fused = "attention" in _ops_of(lean)
    assert fused == any(a.startswith("attention at ") and ": chosen" in a for a in r.algorithms)
    assert fused == (name == "long")  # the long sequence's floor needs the fused form
    assert _global_rel(_grads(m2), want) < 2e-2


class _ConvBN(torch.nn.Module):
    """Convolutions each followed by a training-mode batch norm (running statistics) and a ReLU."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                       torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1, bias=False),
                                       torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1))

    def forward(self, x):
        return self.net(x)


def _conv_bn_case():
    """(:class:`_ConvBN`, images, per-pixel targets, loss), seeded."""
    torch.manual_seed(0)
    return _ConvBN(), torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4, 16, 16)), torch.nn.functional.cross_entropy


def _bn_input_dtypes(fn) -> list[tuple[str, str, str]]:
    """(op, input dtype, per-channel dtype) of every batch norm of ``fn`` and of its backward."""
    return [(i.op.name, i.operands[1 if i.op.name == "batch_norm_grad" else 0].type.dtype.value,
             i.operands[-1].type.dtype.value)
            for i in fn.instructions() if i.op.name in ("batch_norm", "batch_norm_grad")]


@pytest.mark.parametrize("budget", [None, "minimum"])
def test_bf16_batch_norm_keeps_its_bf16_input_not_a_float32_copy(budget):
    """Under bf16 autocast a batch norm's input is bf16 and its weight and statistics f32: it is one
    mixed-dtype batch norm, as ATen's kernel (and eager autograd, which saves the bf16 input and f32
    statistics), so no f32 copy of an activation is made or kept for the backward. Gradients and
    running statistics are eager autocast's, the peak is the one predicted."""
    model, x, target, loss_fn = _conv_bn_case()
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(ref(x), target)
    loss.backward()
    if budget == "minimum":
        with pytest.raises(remat.BudgetTooSmall) as e:
            remat.compile(copy.deepcopy(model), (x, target), loss_fn, precision="bf16", budget=1)
        budget = e.value.minimum
    m = copy.deepcopy(model)
    step = remat.compile(m, (x, target), loss_fn, precision="bf16", budget=budget)
    got = step(x, target)
    kinds = _bn_input_dtypes(step.compilation.joint)
    assert kinds.count(("batch_norm", "bf16", "f32")) == 2 and kinds.count(("batch_norm_grad", "bf16", "f32")) == 2
    assert set(kinds) == {("batch_norm", "bf16", "f32"), ("batch_norm_grad", "bf16", "f32")}
    fed = [getattr(v, "instr", None) for i in step.compilation.joint.instructions()
           if i.op.name in ("batch_norm", "batch_norm_grad") for v in i.operands]
    assert not [i for i in fed if i is not None and i.op.name == "cast"], "a batch norm reads a cast"
    assert abs(float(got) - float(loss)) < 1e-3
    assert _global_rel(_grads(m), _grads(ref)) < 1e-2
    for a, b in zip(m.buffers(), ref.buffers()):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in m.parameters())
    r = step.report()
    assert r.measured_peak == r.predicted_peak
    if budget is not None:
        assert r.measured_peak <= r.budget


def test_bf16_hugging_face_resnet_matches_eager_autocast():
    """A model nobody here wrote with batch norms (``transformers``' ResNet, random weights): bf16
    gradients within 2e-2 of eager autocast's, fp32 master weights, the predicted peak measured."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[16, 32], depths=[2, 1], layer_type="basic",
                          num_labels=10)
    model = tf.ResNetForImageClassification(cfg).train()
    inputs = dict(pixel_values=torch.randn(8, 3, 32, 32), labels=torch.randint(0, 10, (8,)))
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ref(**inputs).loss
    loss.backward()
    m = copy.deepcopy(model)
    step = remat.compile(m, inputs, precision="bf16")
    step(**inputs)
    assert ("batch_norm_grad", "bf16", "f32") in _bn_input_dtypes(step.compilation.joint)
    assert _global_rel(_grads(m), _grads(ref)) < 2e-2
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in m.parameters())
    r = step.report()
    assert r.measured_peak == r.predicted_peak


def test_bf16_eval_mode_batch_norm_is_mixed_too():
    """A frozen (eval-mode) batch norm under bf16 autocast: the same mixed-dtype op, with the
    running statistics; gradients as eager autocast's."""
    torch.manual_seed(0)
    model, x = _ConvBN(), torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        for bn in (model.net[1], model.net[4]):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    model.eval()
    target = torch.randint(0, 4, (4, 16, 16))
    loss_fn = torch.nn.functional.cross_entropy
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(ref(x), target).backward()
    m = copy.deepcopy(model)
    step = remat.compile(m, (x, target), loss_fn, precision="bf16")
    step(x, target)
    assert set(_bn_input_dtypes(step.compilation.joint)) == {("batch_norm", "bf16", "f32"),
                                                             ("batch_norm_grad", "bf16", "f32")}
    assert _global_rel(_grads(m), _grads(ref)) < 1e-2
    r = step.report()
    assert r.measured_peak == r.predicted_peak


def test_fp16_batch_norm_is_mixed_too():
    """precision="fp16" (loss scaling): the batch norms are the f16 form of the mixed op, and a step
    updates the fp32 master weights as eager autocast's step does."""
    model, x, target, loss_fn = _conv_bn_case()
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.float16):
        loss_fn(ref(x), target).backward()
    torch.optim.SGD(ref.parameters(), lr=1e-2).step()
    m = copy.deepcopy(model)
    step = remat.compile(m, (x, target), loss_fn, optimizer=torch.optim.SGD(m.parameters(), lr=1e-2),
                         precision="fp16")
    step(x, target)
    assert set(_bn_input_dtypes(step.compilation.joint)) == {("batch_norm", "f16", "f32"),
                                                             ("batch_norm_grad", "f16", "f32")}
    for a, b in zip(m.parameters(), ref.parameters()):
        assert a.dtype == torch.float32 and float((a - b).abs().max()) <= 1e-2 * float(b.abs().max())
    r = step.report()
    assert r.measured_peak == r.predicted_peak


class _BiasedAttention(torch.nn.Module):
    """SDPA with a learned additive mask (a relative position bias, as T5 and Swin have)."""

    def __init__(self, t: int = 16, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.out = torch.nn.Linear(d, d, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(1, heads, t, t))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, scale=1.0)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


def test_bf16_learned_attention_mask_gradient_is_as_accurate_as_eager_autocast():
    """The cotangent of a float mask is computed from primitives; in bf16 its exponentials, row sums
    and the sum over the mask's broadcast axes run in f32 (the products in bf16), so the bias's
    gradient is about as far from the f32 one as eager autocast's (in bf16 throughout: 1.7x)."""
    torch.manual_seed(0)
    model, x, y = _BiasedAttention(), torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    loss_fn = torch.nn.functional.mse_loss
    fp32, bf16 = (_eager(model, (x, y), loss_fn, autocast=a) for a in (False, True))
    m = copy.deepcopy(model)
    remat.compile(m, (x, y), loss_fn, precision="bf16")(x, y)
    got = _grads(m)
    for i, name in enumerate(n for n, _ in model.named_parameters()):
        assert _global_rel([got[i]], [fp32[i]]) <= 1.25 * _global_rel([bf16[i]], [fp32[i]]), name


def test_bf16_loss_reads_the_bf16_logits_and_trains_bit_identically(monkeypatch):
    """Autocast computes the loss in f32: the step reads the bf16 logits a chunk of rows at a time
    (``cross_entropy {upcast}``), with no f32 copy of them or of their gradient in the program, and
    trains bit for bit as the step with the f32 copy does (fold off), in no more bytes."""
    import remat.passes.crossentropy as ce

    monkeypatch.setenv("REMAT_CAPTURE_CACHE", "0")
    model, inputs, loss_fn = make("gpt")
    runs = {}
    for fold in (True, False):
        if not fold:
            monkeypatch.setattr(ce, "fold_upcast", lambda f: (f, 0))
        m = copy.deepcopy(model)
        step = remat.compile(m, inputs, loss_fn, optimizer=torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                             precision="bf16")
        losses = [step(*inputs) for _ in range(3)]
        runs[fold] = losses, [p.detach().clone() for p in m.parameters()], step.report(), step.program
    (l1, p1, r1, prog), (l0, p0, r0, _) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(l1, l0)) and all(torch.equal(a, b) for a, b in zip(p1, p0))
    ces = [i for i in prog.instructions() if i.op.name in ("cross_entropy", "cross_entropy_grad")]
    assert len(ces) == 2 and all(i.attrs["upcast"] and i.operands[-3 if i.op.name == "cross_entropy_grad" else 0]
                                 .type.dtype == remat.ir.DType.bf16 for i in ces)
    logits = ces[0].operands[0].type.shape
    assert not any(r.type.shape == logits and r.type.dtype == remat.ir.DType.f32
                   for i in prog.instructions() for r in i.results)
    assert r1.measured_peak == r1.predicted_peak <= r0.predicted_peak
