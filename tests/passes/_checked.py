"""Running passes on IR text in tests: the input verified, the passes' output verified after each
pass (run_pipeline under the test suite's REMAT_VERIFY_EACH_PASS), and the input left untouched;
the autocast pass against a capture under ``torch.autocast``."""
from __future__ import annotations

import collections

import numpy as np
import torch

import remat
from remat.frontend.torch_import import import_module
from remat.ir import DType, Function, Module, parse, verify
from remat.passes.autocast import autocast
from remat.passes.cse import cse_function
from remat.passes.dce import dce_function
from remat.pipeline import run_pipeline


def run_checked(text: str, passes: list[str]):
    """``(the parsed input module, the module after the passes)``."""
    m = parse(text)
    verify(m)
    before = str(m)
    out = run_pipeline(m, passes).module
    assert str(m) == before, "the pass mutated its input"
    return m, out


def dtype_counts(f: Function) -> collections.Counter:
    """Each (op, operand dtypes, result dtypes) and how often, after CSE and DCE (a capture casts a
    value once per reader; the pass once)."""
    g = dce_function(cse_function(f))
    return collections.Counter((i.op.name, tuple(o.type.dtype for o in i.operands), tuple(r.type.dtype for r in i.results))
                               for i in g.instructions())


def _run(f: Function, args) -> list[np.ndarray]:
    outs, _ = remat.run(f, *args, dialects=("torch",), outputs="torch")
    return [o.float().numpy() if o.is_floating_point() else o.numpy() for o in outs]


def autocast_as_captured(model, inputs, loss_fn=None) -> None:
    """The autocast pass on ``model``'s float32 capture gives its capture under ``torch.autocast``:
    the same instructions in the same dtypes, bit-identical outputs; input and signature kept."""
    fp32 = import_module(model, inputs, loss_fn, train=None, cache=False)
    captured = import_module(model, inputs, loss_fn, train=None, cache=False, autocast=torch.bfloat16)
    before = str(fp32.function)
    mixed = autocast(fp32.function, DType.bf16)
    assert str(fp32.function) == before, "the pass changed its input"
    verify(Module([mixed]))
    assert mixed.param_types == fp32.function.param_types and mixed.result_types == fp32.function.result_types
    assert dtype_counts(mixed) == dtype_counts(captured.function)
    args = fp32.arguments(*([inputs[n] for n in fp32.input_names] if isinstance(inputs, dict) else inputs))
    for got, want in zip(_run(mixed, args), _run(captured.function, args)):
        np.testing.assert_array_equal(got, want)
