"""Per-instruction overhead of the VM (issue 8, "a lean VM").

Overhead = (time of ``VM.run`` on a program) - (time of the same kernels called on the same,
precomputed arguments in a plain Python loop), in the same process, alternating the two in every
round; reported per executed instruction (µs) and as the ratio VM / plain loop. Programs:

* ``adds``: N cheap instructions (``add`` on f32[4]) in the torch and the numpy dialect, where
  almost everything is overhead;
* ``zoo/<model>/<size>``: the training-step program ``remat.compile`` builds for a zoo model
  (SGD with momentum, unconstrained), run on copies of its arguments.

The plain loop's arguments are captured from one VM run (each kernel wrapped once to record the
operands it received, already converted to its dialect). Each VM variant is timed: recording
``full`` (timeline and per-instruction times), ``peak`` (bytes only: from its second run on, the
generated straight-line form of a function without control flow, ``remat.runtime.straight``),
``peak-interpreted`` (the same, always interpreted) and ``peak+kinds`` (``peak`` with bytes by kind,
``run(..., by_kind=True)``: what a training step records on its first call), and with ``--baseline REV``
the VM of git revision REV too (its ``vm.py`` and ``memory.py`` loaded under private module names;
the kernels are this checkout's), so before/after comparisons come from one process. ``--steps``
also times whole training steps (``TrainStep.__call__``) of the zoo models with each VM swapped in.

    PYTHONPATH=src .venv/bin/python bench/vm_overhead.py                       # ~1-2 min
    PYTHONPATH=src .venv/bin/python bench/vm_overhead.py --baseline main --steps
    PYTHONPATH=src .venv/bin/python bench/vm_overhead.py --quick               # tiny models only

Writes ``bench/results/vm_overhead.json`` (``--out`` to change). Timings on a shared machine are
noisy: medians over alternating rounds, compare ratios rather than absolute numbers.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import remat
from remat import zoo
from remat.ir import Builder, DType, Function, Module, TensorType
from remat.runtime import vm as vm_mod
from _measure import machine  # noqa: E402  (bench/ is on the path: run as a script)

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- programs
def adds_program(n: int, size: int = 4) -> Function:
    """``n`` dependent adds on f32[size]: each result is used by the next one and then dies."""
    t = TensorType(DType.f32, (size,))
    f = Function("adds", [t], [t])
    b = Builder(f.entry)
    (x,) = f.params
    y = x
    for _ in range(n):
        y = b.op("add", y, x)
    b.ret(y)
    Module([f])
    return f


def zoo_step(name: str, size: str):
    """(TrainStep, example inputs) for a zoo model with SGD momentum, unconstrained."""
    torch.manual_seed(0)
    model, ex, loss_fn = zoo.make(name, size)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return remat.compile(model, ex, loss_fn, optimizer=opt), ex


# ---------------------------------------------------------------- VM variants
def load_baseline_vm(rev: str) -> Any:
    """The ``vm`` module of git revision ``rev`` (with that revision's ``memory.py``)."""
    def show(path: str) -> str:
        return subprocess.check_output(["git", "show", f"{rev}:{path}"], cwd=ROOT, text=True)

    def load(modname: str, source: str) -> Any:
        spec = importlib.util.spec_from_loader(modname, loader=None)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = "remat.runtime"
        sys.modules[modname] = mod
        exec(compile(source, f"{rev}:{modname}", "exec"), mod.__dict__)
        return mod

    load("remat.runtime._baseline_memory", show("src/remat/runtime/memory.py"))
    src = show("src/remat/runtime/vm.py").replace("from .memory import", "from ._baseline_memory import")
    return load("remat.runtime._baseline_vm", src)


def runner(vm: Any, name: str, record: str | None) -> Callable[..., Any]:
    """``vm.run`` with a recording level (None: the VM's default; for VMs without the option)."""
    if record is None:
        return lambda *a, **kw: vm.run(name, *a, **kw)
    if record == "peak+kinds":
        return lambda *a, **kw: vm.run(name, *a, record="peak", by_kind=True, **kw)
    return lambda *a, **kw: vm.run(name, *a, record=record, **kw)


def capture_calls(vm: Any, name: str, args: list) -> tuple[list, int]:
    """(kernel, operands, attrs) of every kernel call of one run, and the executed instruction count."""
    calls: list = []
    plan = vm._plans[name]
    saved = []
    for bp in plan.blocks:
        for st in bp.steps:
            if st.fn is not None:
                saved.append((st, st.fn))

                def wrap(*a, _f=st.fn, **kw):
                    calls.append((_f, a, kw))
                    return _f(*a, **kw)

                st.fn = wrap
    try:
        _, stats = vm.run(name, *args)
    finally:
        for st, fn in saved:
            st.fn = fn
    return calls, len(stats.timeline)


def plain_loop(calls: list) -> None:
    for fn, a, kw in calls:
        fn(*a, **kw)


def time_variants(variants: dict[str, Callable[[], Any]], rounds: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of each variant over ``rounds`` alternating rounds (after three
    untimed ones).

    CPU time is the calling thread's (``time.thread_time``; torch runs single-threaded here): on a
    shared machine it leaves out the time the process waited for a core, which wall time includes."""
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    warm = 3  # untimed rounds: kernels load, and lean runs are generated (from the second on)
    for r in range(rounds + warm):
        for k, f in variants.items():
            gc.collect()
            c0, t0 = time.thread_time(), time.perf_counter()
            f()
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if r >= warm:
                wall[k].append(dt)
                cpu[k].append(dc)
    return {k: {"wall": statistics.median(wall[k]), "cpu": statistics.median(cpu[k])} for k in variants}


def overhead_row(label: str, vms: dict[str, tuple[Any, str | None]], name: str, args: list, rounds: int,
                 outputs: str = "numpy") -> dict:
    """Times every VM variant and the plain loop on one program; µs of overhead per instruction."""
    first = next(iter(vms.values()))[0]
    calls, n_instr = capture_calls(first, name, [a.copy() if hasattr(a, "copy") else a.clone() for a in args])
    variants: dict[str, Callable[[], Any]] = {"plain_loop": lambda: plain_loop(calls)}
    for k, (vm, record) in vms.items():
        run = runner(vm, name, record)
        variants[k] = (lambda run=run: run(*args, outputs=outputs))
    t = time_variants(variants, rounds)
    base = t["plain_loop"]
    row = {"program": label, "instructions": n_instr, "kernel_calls": len(calls), "rounds": rounds,
           "plain_loop_ms": base["wall"] * 1e3, "plain_loop_cpu_ms": base["cpu"] * 1e3}
    for k in vms:
        row[f"{k}_ms"] = t[k]["wall"] * 1e3
        row[f"{k}_cpu_ms"] = t[k]["cpu"] * 1e3
        row[f"{k}_overhead_us_per_instr"] = (t[k]["cpu"] - base["cpu"]) / n_instr * 1e6
        row[f"{k}_overhead_us_per_instr_wall"] = (t[k]["wall"] - base["wall"]) / n_instr * 1e6
        row[f"{k}_ratio"] = t[k]["cpu"] / base["cpu"]
    return row


class _Recording:
    """Stands in for a TrainStep's VM so that its ``run`` uses a given recording level."""

    def __init__(self, vm: Any, record: str | None) -> None:
        self.vm, self.record = vm, record

    def run(self, *a, **kw):
        kw.pop("record", None)
        if self.record is None:  # a baseline VM: no by_kind
            kw.pop("by_kind", None)
            return self.vm.run(*a, **kw)
        kw.pop("by_kind", None)
        if self.record == "peak+kinds":
            return self.vm.run(*a, record="peak", by_kind=True, **kw)
        return self.vm.run(*a, record=self.record, **kw)


def step_row(label: str, step: Any, ex: tuple, vms: dict[str, tuple[Any, str | None]], rounds: int) -> dict:
    """Median whole training-step time with each VM variant swapped into the TrainStep."""
    own = step.vm
    variants = {}
    for k, (vm, record) in vms.items():
        wrapped = _Recording(vm, record)

        def go(w=wrapped):
            step.vm = w
            step(*ex)
        variants[k] = go
    try:
        t = time_variants(variants, rounds)
    finally:
        step.vm = own
    first = next(iter(vms))
    return {"model": label, "rounds": rounds, **{f"{k}_ms": v["wall"] * 1e3 for k, v in t.items()},
            **{f"{k}_cpu_ms": v["cpu"] * 1e3 for k, v in t.items()},
            **{f"{k}_vs_{first}": v["wall"] / t[first]["wall"] for k, v in t.items()},
            **{f"{k}_vs_{first}_cpu": v["cpu"] / t[first]["cpu"] for k, v in t.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="git revision whose VM is timed alongside this one (e.g. main)")
    ap.add_argument("--models", default="mlp,resnet,gpt,unet")
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--quick", action="store_true", help="tiny models only, fewer rounds")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=1000, help="instructions of the synthetic program")
    ap.add_argument("--steps", action="store_true", help="also time whole training steps (small models)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the overhead is Python-side, and kernel threads "
                         "contending on a shared machine only add noise)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vm_overhead.json"))
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    sizes = ["tiny"] if opts.quick else opts.sizes.split(",")
    rounds = 3 if opts.quick else opts.rounds
    models = opts.models.split(",")
    lean = "record" in vm_mod.VM.run.__code__.co_varnames

    def variants_for(module: Module | Function, dialects=None, kinds=None) -> dict[str, tuple[Any, str | None]]:
        """The VMs to time; ``kinds``: labels of the module's one function for ``peak+kinds``
        (None: every value one kind)."""
        out: dict[str, tuple[Any, str | None]] = {}
        if opts.baseline:
            out["baseline"] = (base_mod.VM(module, dialects=dialects), None)
        if lean:
            out["full"] = (vm_mod.VM(module, dialects=dialects), "full")
            out["peak"] = (vm_mod.VM(module, dialects=dialects), "peak")
            if hasattr(vm_mod.VM, "straight_runs"):  # "peak" runs generated: the interpreter's lean run too
                vm = vm_mod.VM(module, dialects=dialects)
                vm.straight_runs = False
                out["peak-interpreted"] = (vm, "peak")
            if hasattr(vm_mod.VM, "set_kinds"):
                vm = vm_mod.VM(module, dialects=dialects)
                fn = next(iter(module)) if isinstance(module, Module) else module
                vm.set_kinds(fn, kinds if kinds is not None else {v: "values" for v in fn.params})
                out["peak+kinds"] = (vm, "peak+kinds")
        else:
            out["current"] = (vm_mod.VM(module, dialects=dialects), None)
        return out

    base_mod = load_baseline_vm(opts.baseline) if opts.baseline else None
    rows = []
    for dialect in ("torch", "numpy"):
        f = adds_program(opts.n)
        x = np.ones(4, np.float32)
        arg = torch.from_numpy(x) if dialect == "torch" else x
        rows.append(overhead_row(f"adds{opts.n}/{dialect}", variants_for(f.module, dialect), "adds", [arg],
                                 4 * rounds, outputs=dialect))
        print(rows[-1], flush=True)
    steps = []
    for size in sizes:
        for m in models:
            step, ex = zoo_step(m, size)
            args = step.binding.step_args(ex, copy=True, step=1)
            vms = variants_for(Module([step.program]), step.dialects, step.compilation.kinds)
            rows.append(overhead_row(f"zoo/{m}/{size}", vms, step.program.name, args,
                                     rounds if size == "tiny" else max(3, rounds // 2), outputs="torch"))
            print(rows[-1], flush=True)
            if opts.steps and size == "small":
                steps.append(step_row(f"{m}/{size}", step, ex, vms, rounds))
                print(steps[-1], flush=True)
            del step, vms
            gc.collect()
    result = {
        "what": "VM per-instruction overhead: (VM.run time - plain loop over the same kernel calls) / instructions",
        "command": " ".join(["bench/vm_overhead.py"] + sys.argv[1:]),
        "baseline": opts.baseline,
        "baseline_commit": subprocess.check_output(["git", "rev-parse", opts.baseline], cwd=ROOT, text=True).strip()
        if opts.baseline else None,
        "commit": subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip(),
        "machine": {**machine(), "torch_threads": opts.threads},
        "rounds": rounds,
        "overhead": rows,
        "steps": steps,
    }
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    keys = [k[:-len("_overhead_us_per_instr")] for k in rows[0] if k.endswith("_overhead_us_per_instr")]
    print("\nVM overhead in µs per instruction from median CPU times (from wall times), "
          "and VM / plain loop (CPU)")
    print(f"{'program':<20}{'instrs':>7}{'plain ms':>10}" + "".join(f"{k:>24}" for k in keys))
    for r in rows:
        print(f"{r['program']:<20}{r['instructions']:>7}{r['plain_loop_cpu_ms']:>10.2f}"
              + "".join(f"{r[k + '_overhead_us_per_instr']:>7.2f} ({r[k + '_overhead_us_per_instr_wall']:>7.2f}) "
                        f"{r[k + '_ratio']:>5.2f}x" for k in keys))
    for s in steps:
        print(s)


if __name__ == "__main__":
    main()
