"""The ``gelu`` pass: the tanh approximation of GELU written out in primitives (Hugging Face's
``gelu_new``) becomes ``gelu {approximate="tanh"}`` with the same values to rounding; near misses are
left alone. Verified after the pass."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from _checked import run_checked
from _interp import evaluate

K = math.sqrt(2.0 / math.pi)


def _prog(cube: str, kappa: float = 0.044715, k: float = K, extra_use: bool = False) -> str:
    ret = "(f64[2,5], f64[2,5])" if extra_use else "f64[2,5]"
    last = "%12, %5" if extra_use else "%12"
    return f"""func @f(%0: f64[2,5]) -> {ret} {{
  %1 = constant {{value=0.5, dtype=f64}} : f64[]
  %2 = mul %0, %1 : f64[2,5]
  {cube}
  %4 = constant {{value={kappa}, dtype=f64}} : f64[]
  %5 = mul %3, %4 : f64[2,5]
  %6 = add %0, %5 : f64[2,5]
  %7 = constant {{value={k!r}, dtype=f64}} : f64[]
  %8 = mul %7, %6 : f64[2,5]
  %9 = tanh %8 : f64[2,5]
  %10 = constant {{value=1.0, dtype=f64}} : f64[]
  %11 = add %10, %9 : f64[2,5]
  %12 = mul %2, %11 : f64[2,5]
  return {last}
}}
"""


POW = "%13 = constant {value=3.0, dtype=f64} : f64[]\n  %3 = pow %0, %13 : f64[2,5]"
MULS = "%13 = mul %0, %0 : f64[2,5]\n  %3 = mul %13, %0 : f64[2,5]"


def _run(text):
    return run_checked(text, ["gelu", "dce"])


def _ops(f):
    return [i.op.name for i in f.instructions()]


@pytest.mark.parametrize("cube", [POW, MULS], ids=["pow", "x*x*x"])
def test_written_out_tanh_gelu_becomes_the_op(cube):
    m, out = _run(_prog(cube))
    assert _ops(out["f"]) == ["gelu", "return"], str(out)
    (g,) = [i for i in out["f"].instructions() if i.op.name == "gelu"]
    assert g.attrs["approximate"] == "tanh" and g.operands[0] is out["f"].params[0]
    x = np.random.default_rng(0).uniform(-4, 4, (2, 5))
    np.testing.assert_allclose(evaluate(out["f"], [x], out)[0], evaluate(m["f"], [x], m)[0], rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("case", ["other_kappa", "other_scale", "intermediate_used", "square_of_other"])
def test_near_misses_are_left_alone(case):
    text = {"other_kappa": _prog(POW, kappa=0.05), "other_scale": _prog(POW, k=0.8),
            "intermediate_used": _prog(POW, extra_use=True),
            "square_of_other": _prog("%13 = mul %0, %0 : f64[2,5]\n  %14 = mul %13, %13 : f64[2,5]\n"
                                     "  %3 = mul %14, %0 : f64[2,5]")}[case]
    m, out = _run(text)
    assert "gelu" not in _ops(out["f"])


def test_hugging_face_gelu_new_imports_as_the_op_and_matches_eager():
    """GPT-2's MLP activation (NewGELUActivation, written out in torch ops) is one op after import; the
    training step's loss and gradients equal eager's to float32 rounding."""
    import copy

    import transformers as tf

    import remat
    from remat.frontend.torch_import import import_module

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = tf.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 64, (2, 16))
    inputs = dict(input_ids=ids, labels=ids)
    ops = [i.op.name for i in import_module(copy.deepcopy(model), inputs).function.instructions()]
    assert ops.count("gelu") == 1 and "tanh" not in ops and "pow" not in ops
    ref = copy.deepcopy(model)
    step = remat.compile(model, inputs)
    loss = step(**inputs)
    want = ref(**inputs).loss
    want.backward()
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        scale = float(p.grad.abs().max()) or 1.0
        assert float((q.grad - p.grad).abs().max()) <= 1e-5 * scale, name
