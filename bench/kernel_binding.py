"""Kernels bound per instruction: what deciding a kernel's attribute-only work once saves per call.

The layout wrappers (``remat.backends._layout``: convolutions, pooling and batch norm in NHWC, OHWI
weights) decide from an instruction's attributes which operands and results to permute and which
keywords to pass. Called as ``fn(*operands, **attrs)`` they decide it at every call; the VM binds
them once when it prepares a program (``remat.backends.bound``) and then calls ``bound(*operands)``.

For every instruction of a training step (SGD with momentum, unconstrained) whose kernel offers
``bind``, this captures the operands the VM passed in one run, then times both calls on them,
alternating, ``--repeats`` times ``--number`` calls each (minimum per call), and checks that both
give the same bits. Reported per op: calls per step, microseconds per call each way, and the
milliseconds per step saved. Models: zoo ResNet and U-Net (size small); ``--hf`` adds Hugging Face
ResNet and ConvNeXt (``bench/conv_layout.py``'s configurations).

    PYTHONPATH=src .venv/bin/python bench/kernel_binding.py [--hf]     # ~1 min

Writes ``bench/results/kernel_binding.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import timeit
from pathlib import Path
from typing import Any

import torch

import remat
from remat import backends

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conv_layout import HF_MODELS, make_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def captured_calls(name: str) -> list[tuple[Any, Any, tuple]]:
    """(instruction, kernel implementation, operands) of every bound kernel call of one step of ``name``."""
    torch.manual_seed(0)
    model, inputs, loss_fn = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    step = remat.compile(model, inputs, loss_fn, optimizer=opt)
    step(*inputs)
    plan = step.vm._plans[step.program.name]  # the prepared program (private: this benchmark inspects it)
    calls: list[tuple[Any, Any, tuple]] = []
    kept = []
    for bp in plan.blocks:
        for st in bp.steps:
            if st.fn is None or st.attrs:  # not a kernel, or a kernel called with its attributes
                continue
            impl = backends.kernel_for(st.ins, st.ins.dialect)
            if not hasattr(impl.fn, "bind"):
                continue
            kept.append((st, st.fn))

            def spy(*ops, _fn=st.fn, _ins=st.ins, _impl=impl):
                calls.append((_ins, _impl, ops))
                return _fn(*ops)
            st.fn = spy
    try:
        step(*inputs)
    finally:
        for st, fn in kept:
            st.fn = fn
    return calls


def same(a: Any, b: Any) -> bool:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return len(a) == len(b) and all(x.shape == y.shape and x.stride() == y.stride() and torch.equal(x, y)
                                    for x, y in zip(a, b))


def measure(name: str, repeats: int, number: int) -> dict[str, Any]:
    calls = captured_calls(name)
    per_op: dict[str, dict[str, float]] = {}
    identical = True
    with torch.no_grad():
        for ins, impl, ops in calls:
            attrs = dict(ins.attrs)
            bound = backends.bound(impl, dict(attrs))
            identical &= same(impl.fn(*ops, **attrs), bound(*ops))
            per_call, once = [], []
            for _ in range(repeats):
                per_call.append(timeit.timeit(lambda: impl.fn(*ops, **attrs), number=number) / number)
                once.append(timeit.timeit(lambda: bound(*ops), number=number) / number)
            row = per_op.setdefault(ins.op.name, {"calls": 0, "decided_per_call_us": 0.0, "bound_us": 0.0})
            row["calls"] += 1
            row["decided_per_call_us"] += min(per_call) * 1e6
            row["bound_us"] += min(once) * 1e6
    for row in per_op.values():
        row["saved_ms_per_step"] = (row["decided_per_call_us"] - row["bound_us"]) / 1e3
        row["decided_per_call_us"] /= row["calls"]
        row["bound_us"] /= row["calls"]
    return {"bound_calls_per_step": len(calls), "bit_identical": identical, "ops": per_op,
            "saved_ms_per_step": sum(r["saved_ms_per_step"] for r in per_op.values())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", action="store_true", help="also Hugging Face ResNet and ConvNeXt")
    ap.add_argument("--repeats", type=int, default=7, help="alternating timings per call (default: 7)")
    ap.add_argument("--number", type=int, default=50, help="calls per timing (default: 50)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default: bench/results)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"models": {}}
    for name in ("resnet", "unet") + (HF_MODELS if args.hf else ()):
        key = name if name in HF_MODELS else f"zoo {name} small"
        r = res["models"][key] = measure(name, args.repeats, args.number)
        print(f"{key}: {r['bound_calls_per_step']} bound kernel calls per step, {r['saved_ms_per_step']:.3f} ms saved "
              f"per step, bit-identical: {r['bit_identical']}", flush=True)
        for op, row in sorted(r["ops"].items(), key=lambda kv: -kv[1]["saved_ms_per_step"]):
            print(f"  {op:26s} x{row['calls']:<3d} {row['decided_per_call_us']:7.1f} -> {row['bound_us']:7.1f} us per call",
                  flush=True)
    res["config"] = {"repeats": args.repeats, "number": args.number, "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "hf": args.hf, "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kernel_binding.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
