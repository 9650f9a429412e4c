"""Convolution memory layout (issues 8 and 10): what NHWC (``torch.channels_last``) buys remat's
convolutions over NCHW, per kernel and per training step.

oneDNN (PyTorch's CPU convolution) computes in a blocked or NHWC layout, so an NCHW convolution
reorders its operands and result: those reorders are kernel workspaces (the allocator bound of a
plan counts them; they set the floors of ResNet and U-Net) and time. Since the ``channels-last``
pass (``remat.passes.layout``), remat computes convolutional steps NHWC; ``layout="NCHW"`` keeps
the captured layout. Two parts:

**Kernels.** Every ``conv2d`` of the compiled, unconstrained NCHW training steps of zoo ResNet and
U-Net (size ``small``) with its shapes and attributes, timed with both layouts:

* ``fwd``: ``conv2d(x, w)``;
* ``bwd``: ``convolution_backward`` for the input and weight gradients (one call, as remat's
  ``conv2d_grads``; the first convolution of a model, whose input needs no gradient, weight only);

as a whole-network layout (operands already NHWC: what a layout-assignment pass would give) and
as conversions around an NCHW convolution (``.contiguous(memory_format=channels_last)`` in,
``.contiguous()`` out: what a kernel-local change would give). Per call it records the median
time over ``--rounds`` alternating rounds, the allocator's peak above operands and results
(torch.profiler memory events: the workspace), and whether the results are bit-identical to
NCHW's. Per model it sums them over the step's convolutions.

**Steps.** Whole training steps (SGD with momentum), alternating in one process: eager PyTorch in
NCHW (the baseline of every ratio) and channels-last (``model.to(memory_format=channels_last)``),
and remat with ``layout="NCHW"``, with the default ``layout="auto"``, and with ``"auto"`` but its
weights kept OIHW (``remat.passes.layout.OHWI_WEIGHTS`` off while compiling: the layout of stops
26-35, whose kernels copy each weight to channels-last and its gradient back), unconstrained and at
50% (where feasible). Per method: median step time over ``--step-rounds`` rounds, its ratio to
eager NCHW, remat's predicted peaks, and for ``auto`` the median per-round ratio to ``auto, OIHW
weights``. Models: zoo ResNet and U-Net (size small), and with ``--hf`` Hugging Face ResNet and
ConvNeXt (random weights, batch 8 of 64x64 images, steps only).

    PYTHONPATH=src .venv/bin/python bench/conv_layout.py [--rounds 15] [--step-rounds 21] [--threads 2]
    PYTHONPATH=src .venv/bin/python bench/conv_layout.py --parts steps --hf   # whole steps only

Writes ``bench/results/conv_layout.json`` (one part only: ``conv_layout_<part>.json``). Timings are noisy on a shared machine: compare the
ratios, which come from alternating runs in one process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import remat
from remat import zoo
from remat.runtime.allocator import allocation_trace, peak_of_trace

RESULTS = Path(__file__).resolve().parent / "results"
CL = torch.channels_last


def step_convolutions(name: str) -> list[dict[str, Any]]:
    """The distinct ``conv2d`` calls of zoo ``name``'s unconstrained step (shapes, attributes, count,
    and whether the input is the step's own input, which needs no gradient)."""
    model, inputs, loss_fn = zoo.make(name, "small")
    step = remat.compile(model, inputs, loss_fn, layout="NCHW")
    params = set(step.program.params)  # a convolution of a step argument: the model's input, no gradient
    seen: dict[tuple, dict[str, Any]] = {}
    for ins in step.program.entry.instrs:
        if ins.op.name != "conv2d":
            continue
        x, w = ins.operands
        a = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in ins.attrs.items()}
        key = (x.type.shape, w.type.shape, tuple(sorted(a.items())))
        if key not in seen:
            seen[key] = {"x": x.type.shape, "w": w.type.shape, "attrs": a, "count": 0, "input_grad": x not in params}
        seen[key]["count"] += 1
    return list(seen.values())


def _workspace(fn: Callable[[], Any]) -> int:
    _, events = allocation_trace(fn)
    peak, end, _ = peak_of_trace(events)
    return peak - end  # above what the call leaves allocated (its results)


def measure(conv: dict[str, Any], rounds: int) -> dict[str, Any]:
    a = conv["attrs"]
    stride, padding = list(a.get("stride", (1, 1))), list(a.get("padding", (0, 0)))
    dilation, groups = list(a.get("dilation", (1, 1))), a.get("groups", 1)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(conv["x"], generator=g), torch.randn(conv["w"], generator=g)
    gy = torch.randn(torch.conv2d(x, w, None, stride, padding, dilation, groups).shape, generator=g)
    mask = [conv["input_grad"], True, False]
    xc, wc, gyc = (t.contiguous(memory_format=CL) for t in (x, w, gy))

    def fwd(x, w):
        return torch.conv2d(x, w, None, stride, padding, dilation, groups)

    def bwd(gy, x, w):
        gx, gw, _ = torch.ops.aten.convolution_backward(gy, x, w, None, stride, padding, dilation, False, [0, 0],
                                                        groups, mask)
        return gx, gw

    def fwd_converted():
        return fwd(x.contiguous(memory_format=CL), w.contiguous(memory_format=CL)).contiguous()

    def bwd_converted():
        gx, gw = bwd(gy.contiguous(memory_format=CL), x.contiguous(memory_format=CL), w.contiguous(memory_format=CL))
        return (None if gx is None else gx.contiguous()), gw.contiguous()

    calls = {"fwd_nchw": lambda: fwd(x, w), "fwd_nhwc": lambda: fwd(xc, wc), "fwd_converted": fwd_converted,
             "bwd_nchw": lambda: bwd(gy, x, w), "bwd_nhwc": lambda: bwd(gyc, xc, wc), "bwd_converted": bwd_converted}
    times: dict[str, list[float]] = {k: [] for k in calls}
    for f in calls.values():
        f()
    for r in range(rounds):
        names = list(calls)
        names = names[r % len(names):] + names[: r % len(names)]
        for k in names:
            t0 = time.perf_counter()
            calls[k]()
            times[k].append(time.perf_counter() - t0)

    def same(a, b) -> bool:
        a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
        return all((p is None and q is None) or torch.equal(p, q.contiguous()) for p, q in zip(a, b))

    out = {**conv, "x": list(conv["x"]), "w": list(conv["w"]),
           "seconds": {k: statistics.median(v) for k, v in times.items()},
           "workspace": {k: _workspace(f) for k, f in calls.items()},
           "bit_identical": {"fwd_nhwc": same(calls["fwd_nchw"](), calls["fwd_nhwc"]()),
                             "bwd_nhwc": same(calls["bwd_nchw"](), calls["bwd_nhwc"]())}}
    return out


HF_MODELS = ("hf-resnet", "hf-convnext")


def make_model(name: str) -> tuple[torch.nn.Module, list, Callable]:
    """(model, inputs, loss_fn) of zoo ``name`` at size small, or of a Hugging Face conv net
    (``HF_MODELS``: random weights, batch 8 of 64x64 images, 10 classes; its logits to cross-entropy)."""
    if name not in HF_MODELS:
        return zoo.make(name, "small")
    import transformers

    if name == "hf-resnet":
        cfg = transformers.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1],
                                        num_labels=10)
        net = transformers.ResNetForImageClassification(cfg)
    else:
        cfg = transformers.ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1], num_labels=10)
        net = transformers.ConvNextForImageClassification(cfg)

    class Logits(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(pixel_values=x).logits

    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g)]
    return Logits(net).train(), inputs, torch.nn.functional.cross_entropy


def step_methods(name: str, budget: str | None) -> dict[str, Callable[[], Any]]:
    """One training step of ``name`` (:func:`make_model`, SGD with momentum) per method, each on its own
    model: eager NCHW and channels-last; remat with ``layout="NCHW"``, ``"auto"`` and ``"auto"`` with
    OIHW weights (``budget``)."""
    from remat.passes import layout as layout_pass

    methods: dict[str, Callable[[], Any]] = {}
    for how in ("eager", "eager channels_last", "remat NCHW", "remat auto", "remat auto, OIHW weights"):
        if budget is not None and how.startswith("eager"):
            continue
        torch.manual_seed(0)
        model, inputs, loss_fn = make_model(name)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if how.startswith("eager"):
            if how.endswith("channels_last"):
                model = model.to(memory_format=CL)
                inputs = [inputs[0].contiguous(memory_format=CL), *inputs[1:]]

            def eager(model=model, inputs=inputs, opt=opt, loss_fn=loss_fn):
                opt.zero_grad(set_to_none=True)
                loss_fn(model(*inputs[:-1]), inputs[-1]).backward()
                opt.step()
            methods[how] = eager
        else:
            keep = layout_pass.OHWI_WEIGHTS
            layout_pass.OHWI_WEIGHTS = not how.endswith("OIHW weights")
            try:
                step = remat.compile(model, inputs, loss_fn, optimizer=opt, budget=budget,
                                     layout=how.split()[1].rstrip(","))
            finally:
                layout_pass.OHWI_WEIGHTS = keep
            methods[how] = lambda step=step, inputs=inputs: step(*inputs)
            methods[how].step = step  # type: ignore[attr-defined]
    return methods


def measure_steps(name: str, rounds: int) -> dict[str, Any]:
    """Step times of every method of :func:`step_methods`, unconstrained and at 50%, alternating."""
    methods = step_methods(name, None)
    try:
        for k, f in step_methods(name, "50%").items():
            methods[f"{k} @50%"] = f
    except remat.BudgetTooSmall:
        pass  # (ResNet small: 50% is below the floor)
    times: dict[str, list[float]] = {k: [] for k in methods}
    for f in methods.values():
        for _ in range(2):
            f()
    for r in range(rounds):
        names = list(methods)
        for k in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            methods[k]()
            times[k].append(time.perf_counter() - t0)
    eager = statistics.median(times["eager"])
    out: dict[str, Any] = {}
    for k, f in methods.items():
        row: dict[str, Any] = {"step_s": statistics.median(times[k]), "x_eager": statistics.median(times[k]) / eager}
        step = getattr(f, "step", None)
        if step is not None:
            row.update(channels_last=step.compilation.channels_last, ohwi_weights=len(step.compilation.imported.ohwi),
                       predicted_peak=step.predicted_peak, unconstrained_peak=step.unconstrained_peak,
                       recomputed_instructions=step.report().recomputed_instructions)
        base = k.replace("remat auto", "remat auto, OIHW weights")
        if k.startswith("remat auto") and base != k and base in times:  # same round, same process
            row["x_oihw_weights"] = statistics.median(a / b for a, b in zip(times[k], times[base]))
        out[k] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="alternating timing rounds per call (default: 15)")
    ap.add_argument("--step-rounds", type=int, default=21, help="alternating rounds of whole steps (default: 21)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default: bench/results)")
    ap.add_argument("--parts", default="kernels,steps", help="kernels, steps or both (default: both)")
    ap.add_argument("--hf", action="store_true", help="also whole steps of Hugging Face ResNet and ConvNeXt")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"models": {}}
    parts = set(args.parts.split(","))
    for name in ("resnet", "unet") if "kernels" in parts else ():
        rows = [measure(c, args.rounds) for c in step_convolutions(name)]
        total: dict[str, Any] = {}
        for kind in ("fwd", "bwd"):
            base = sum(r["seconds"][f"{kind}_nchw"] * r["count"] for r in rows)
            for lay in ("nhwc", "converted"):
                s = sum(r["seconds"][f"{kind}_{lay}"] * r["count"] for r in rows)
                total[f"{kind}_{lay}_vs_nchw"] = s / base
            total[f"{kind}_nchw_seconds"] = base
            for lay in ("nchw", "nhwc", "converted"):
                total[f"{kind}_{lay}_max_workspace"] = max(r["workspace"][f"{kind}_{lay}"] for r in rows)
        res["models"][f"zoo {name} small"] = {"convolutions": rows, "per_step": total}
        print(f"zoo {name} small: {sum(r['count'] for r in rows)} convolutions per step", flush=True)
        for kind in ("fwd", "bwd"):
            print(f"  {kind}: NCHW {total[f'{kind}_nchw_seconds'] * 1e3:.2f} ms; NHWC x{total[f'{kind}_nhwc_vs_nchw']:.2f},"
                  f" converted around NCHW x{total[f'{kind}_converted_vs_nchw']:.2f}; largest workspace NCHW "
                  f"{total[f'{kind}_nchw_max_workspace'] / 2**20:.2f} MiB, NHWC "
                  f"{total[f'{kind}_nhwc_max_workspace'] / 2**20:.2f} MiB", flush=True)
    names = ("resnet", "unet") + (HF_MODELS if args.hf else ())
    for name in names if "steps" in parts else ():
        steps = measure_steps(name, args.step_rounds)
        key = name if name in HF_MODELS else f"zoo {name} small"
        res["models"].setdefault(key, {})["steps"] = steps
        print(f"{key}, whole steps (x eager NCHW): " + ", ".join(f"{k} {v['x_eager']:.3f}" for k, v in steps.items()),
              flush=True)
        print(f"  remat auto / auto with OIHW weights, same rounds: "
              + ", ".join(f"{k} {v['x_oihw_weights']:.3f}" for k, v in steps.items() if "x_oihw_weights" in v), flush=True)
    res["config"] = {"rounds": args.rounds, "step_rounds": args.step_rounds, "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "parts": sorted(parts), "hf": args.hf,
                     "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("conv_layout.json" if parts >= {"kernels", "steps"} else f"conv_layout_{'_'.join(sorted(parts))}.json")
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
