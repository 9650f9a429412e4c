"""Import a vanilla PyTorch model from the zoo into remat IR, run its training-mode loss on the VM
and compare with PyTorch eager.

    python examples/import_pytorch.py gpt --size small --show-ir 20
"""
from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch

import remat
from remat import zoo
from remat.frontend.torch_import import import_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=sorted(zoo.MODELS))
    ap.add_argument("--size", choices=zoo.SIZES, default="tiny")
    ap.add_argument("--f64", action="store_true", help="build the model in float64")
    ap.add_argument("--eval", action="store_true", help="import in eval mode (running stats, no dropout)")
    ap.add_argument("--show-ir", type=int, default=0, metavar="N", help="print the first N lines of the IR")
    args = ap.parse_args()

    dtype = torch.float64 if args.f64 else torch.float32
    kwargs = {"dropout": 0.0} if args.model == "gpt" else {}  # so that eager and remat see the same function
    model, inputs, loss_fn = zoo.make(args.model, args.size, dtype, **kwargs)
    reference = copy.deepcopy(model).train(not args.eval)

    t0 = time.perf_counter()
    im = import_module(model, inputs, loss_fn, train=not args.eval)
    t1 = time.perf_counter()
    n_instr = sum(1 for _ in im.function.instructions())
    state_bytes = sum(t.numel() * t.element_size() for t in im.param_tensors())
    print(f"imported {args.model} ({args.size}) in {t1 - t0:.2f} s: {n_instr} instructions, "
          f"{len(im.param_names)} parameters and {len(im.buffer_names)} buffers ({remat.format_bytes(state_bytes)}), "
          f"{im.input_count} inputs, results {', '.join(im.output_names[:4])}{' …' if len(im.output_names) > 4 else ''}")
    if args.show_ir:
        print("\n".join(str(im.module).splitlines()[:args.show_ir]))

    outs, stats = remat.run(im, *im.arguments(*inputs))
    want = loss_fn(reference(*inputs[:-1]), inputs[-1]).item()
    print(f"loss: remat {float(outs[0]):.8g}, PyTorch {want:.8g} (relative difference {abs(float(outs[0]) - want) / abs(want):.1e})")
    buffers = dict(reference.named_buffers())
    if len(outs) > 1:
        worst = max(float(np.max(np.abs(o - buffers[n].detach().numpy()))) for n, o in zip(im.output_names[1:], outs[1:]))
        print(f"{len(outs) - 1} updated buffers, largest difference from PyTorch's {worst:.1e}")
    print(stats)


if __name__ == "__main__":
    main()
