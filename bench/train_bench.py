"""Training benchmark: remat against PyTorch's own ways of saving activation memory, per zoo model.

For each example model of ``remat.zoo`` (MLP, ResNet, GPT, U-Net), one training step (forward,
loss, backward, SGD-with-momentum update) is run by

* ``eager``            PyTorch eager, no checkpointing;
* ``checkpoint_sqrt``  ``torch.utils.checkpoint`` over ≈√N segments of the model's blocks
                       (``use_reentrant=False``; bench/_checkpoint.py says how segments are chosen);
* ``compile@B``        ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = B``
                       for B in 1.0, 0.5, 0.25 (model + loss compiled, optimizer step eager);
* ``remat@P``          ``remat.compile(model, example_inputs, loss_fn, optimizer=..., budget=P)`` for
                       P in 100%, 50%, 25% of remat's own unconstrained peak.

Columns, measured the same way for every method (bench/README.md has the definitions):
peak memory of one step (profiler allocation events + bytes resident at the step's start,
bench/_measure.py), step time (median of timed steps after warm-up), plan/setup time, and for the
PyTorch methods the memory autograd keeps after the forward (``saved``). Ratios to eager and the
issue's targets are computed and printed; targets are reported, not asserted.

Run:  .venv/bin/python bench/train_bench.py [--quick] [--no-compile] [--models gpt,mlp] ...
Writes bench/results/train_bench.json and bench/results/train_bench.csv (train_bench_quick.* with
--quick, so a smoke run never overwrites the full results) and prints the table.
"""
from __future__ import annotations

import argparse
import csv
import gc
import inspect
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkpoint import apply_sqrt_checkpointing  # noqa: E402
from _measure import machine, measure_peak, resident_bytes  # noqa: E402  (machine: re-exported)

from remat import zoo  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COMPILE_BUDGETS = (1.0, 0.5, 0.25)
REMAT_BUDGETS = ("100%", "50%", "25%")
MONOTONE_TOLERANCE = 0.01  # relative: peaks within 1% count as equal in the monotonicity check
LR, MOMENTUM = 1e-3, 0.9  # SGD with momentum: one state tensor per parameter, supported by remat


@dataclass
class Row:
    """One (model, method) measurement. Sizes in bytes, times in seconds; None when not measured."""

    model: str
    method: str
    status: str = "ok"               # ok | error | skipped
    error: str = ""
    peak_bytes: int | None = None    # resident + peak net allocation of one step (profiler)
    resident_bytes: int | None = None
    step_net_bytes: int | None = None  # peak net allocation of the step (peak - resident)
    saved_bytes: int | None = None   # net bytes held after forward + loss (what autograd keeps)
    step_s: float | None = None      # median step time
    step_s_min: float | None = None
    steps_timed: int = 0
    plan_s: float | None = None      # setup: wrapping / compile call + first-step excess over the median
    loss0: float | None = None       # loss of the first step (same weights and data for every method)
    detail: str = ""                 # checkpoint plan, compile backend, remat solver ...
    budget_bytes: int | None = None  # remat: the budget it was given, in bytes
    predicted_peak: int | None = None  # remat report
    vm_peak: int | None = None         # remat report: the VM's own measured peak
    unconstrained_peak: int | None = None
    remat_overhead: float | None = None
    extra: dict = field(default_factory=dict)


def _split(inputs: tuple, loss_fn: Callable) -> tuple[tuple, tuple]:
    n = len(inspect.signature(loss_fn).parameters) - 1
    return tuple(inputs[:-n]), tuple(inputs[-n:])


def _err(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    return msg if len(msg) <= 600 else msg[:600] + " ..."


def _clear_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def run_method(row: Row, model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple,
               step: Callable[[], torch.Tensor], forward: Callable[[], torch.Tensor] | None,
               setup_s: float, warmup: int, steps: int) -> Row:
    """Warm up, measure one step's peak, time ``steps`` steps, and fill ``row``.

    ``step()`` runs one full training step and returns the loss; it starts with no ``.grad``
    (cleared outside the measured window, so every method allocates its gradients inside it).
    ``forward()``, when given, runs forward + loss only (to measure what autograd keeps).
    """
    first = None
    for i in range(max(1, warmup)):
        _clear_grads(model)
        t = time.perf_counter()
        loss = step()
        dt = time.perf_counter() - t
        if i == 0:
            first, row.loss0 = dt, float(loss)
        del loss
    # peak of one step: resident = params, buffers, optimizer state, inputs (no .grad: cleared)
    _clear_grads(model)
    gc.collect()
    res = resident_bytes(model, optimizer, inputs)
    m = measure_peak(lambda: float(step()), resident=res)
    row.peak_bytes, row.resident_bytes, row.step_net_bytes = m.peak_bytes, m.resident_bytes, m.peak_net_bytes
    if forward is not None:
        _clear_grads(model)
        mf = measure_peak(forward)
        row.saved_bytes = mf.end_net_bytes
        del mf
    times = []
    for _ in range(steps):
        _clear_grads(model)
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
        del loss
    row.step_s, row.step_s_min, row.steps_timed = statistics.median(times), min(times), len(times)
    row.plan_s = setup_s + max(0.0, first - row.step_s)
    return row


def _fresh(name: str, size: str) -> tuple[torch.nn.Module, tuple, tuple, Callable]:
    """A new zoo model (same seed, so the same weights and data for every method) in training mode,
    its inputs, its targets and its loss. The caller builds the optimizer after any wrapping."""
    model, inputs, loss_fn = zoo.make(name, size)
    model.train()
    xs, ts = _split(inputs, loss_fn)
    return model, xs, ts, loss_fn


def bench_torch(name: str, size: str, method: str, args: argparse.Namespace) -> Row:
    """eager, checkpoint_sqrt or compile@B."""
    row = Row(name, method)
    try:
        model, xs, ts, loss_fn = _fresh(name, size)
        t0 = time.perf_counter()
        fwd_model: Callable = model
        budget_cm = None
        if method == "checkpoint_sqrt":
            row.detail = apply_sqrt_checkpointing(model).describe()
            fwd_model = model
        elif method.startswith("compile@"):
            from torch import _dynamo
            from torch._functorch import config as fconfig
            budget = float(method.split("@", 1)[1])
            _dynamo.reset()  # a fresh compile under this budget
            budget_cm = fconfig.patch(activation_memory_budget=budget)
            budget_cm.__enter__()
            fwd_model = torch.compile(model, backend=args.compile_backend)
            row.detail = f"backend={args.compile_backend}"
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        setup = time.perf_counter() - t0

        def forward() -> torch.Tensor:
            return loss_fn(fwd_model(*xs), *ts)

        def step() -> torch.Tensor:
            loss = forward()
            loss.backward()
            optimizer.step()
            return loss.detach()

        try:
            run_method(row, model, optimizer, xs + ts, step, forward, setup, args.warmup, args.steps)
        finally:
            if budget_cm is not None:
                budget_cm.__exit__(None, None, None)
    except Exception as e:  # record and go on: one failing baseline must not hide the others
        row.status, row.error = "error", _err(e)
        if args.verbose:
            traceback.print_exc()
    return row


def _report_dict(rep: Any) -> dict:
    if rep is None:
        return {}
    if isinstance(rep, dict):
        return dict(rep)
    if hasattr(rep, "__dataclass_fields__"):
        import dataclasses
        return dataclasses.asdict(rep)
    return {k: getattr(rep, k) for k in dir(rep) if not k.startswith("_") and not callable(getattr(rep, k))}


def _num(d: dict, *keys: str) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def bench_remat(name: str, size: str, budget: str, args: argparse.Namespace) -> Row:
    """remat.compile at ``budget`` (a percentage of remat's unconstrained peak)."""
    row = Row(name, f"remat@{budget}")
    try:
        import remat
        compile_fn = remat.compile  # AttributeError/ImportError while remat.train.api is absent
        model, xs, ts, loss_fn = _fresh(name, size)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        inputs = xs + ts
        t0 = time.perf_counter()
        compiled = compile_fn(model, inputs, loss_fn, optimizer=optimizer, budget=budget)
        setup = time.perf_counter() - t0

        def step() -> torch.Tensor:
            return compiled(*inputs)

        run_method(row, model, optimizer, inputs, step, None, setup, args.warmup, args.steps)
        rep = _report_dict(compiled.report() if hasattr(compiled, "report") else None)
        row.budget_bytes = _num(rep, "budget")
        row.predicted_peak = _num(rep, "predicted_peak")
        row.vm_peak = _num(rep, "measured_peak")
        row.unconstrained_peak = _num(rep, "unconstrained_peak")
        row.remat_overhead = _num(rep, "overhead")
        plan = _num(rep, "plan_seconds", "plan_time", "plan_s")
        row.detail = f"solver={rep.get('solver')}" + (f" plan_time={plan:.3g}s" if isinstance(plan, (int, float)) else "")
        row.extra = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)) for k, v in rep.items()}
    except Exception as e:
        row.status, row.error = "error", _err(e)
        if args.verbose:
            traceback.print_exc()
    return row


def _process_warmup(name: str, size: str) -> None:
    """One untimed eager step of a throwaway model, so that one-time process costs (kernel
    libraries' initialisation, first-touch of thread pools) do not land on the first method's
    plan time."""
    model, xs, ts, loss_fn = _fresh(name, size)
    loss_fn(model(*xs), *ts).backward()


# ---------------------------------------------------------------- comparisons and output
def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def compare(rows: list[Row]) -> list[dict]:
    """The issue's targets, per model, as ratios (None where a side is missing). Reported, not asserted."""
    out = []
    by = {(r.model, r.method): r for r in rows if r.status == "ok"}
    for name in dict.fromkeys(r.model for r in rows):
        eager, ck = by.get((name, "eager")), by.get((name, "checkpoint_sqrt"))
        r100, r50, r25 = (by.get((name, f"remat@{b}")) for b in REMAT_BUDGETS)

        def add(target: str, value: float | None, ok: bool | None, note: str = "") -> None:
            out.append({"model": name, "target": target, "value": value, "met": ok, "note": note})

        for r, lim, label in ((r50, 0.10, "50%"), (r25, 0.25, "25%")):
            ov = None if r is None or r100 is None else _ratio(r.step_s, r100.step_s) - 1
            add(f"remat@{label} step overhead vs remat@100% <= {lim:.0%}", ov, None if ov is None else ov <= lim)
        for r in (r100, r50, r25):
            if r is None:
                continue
            for what, peak in (("profiler", r.peak_bytes), ("VM", r.vm_peak)):
                q = _ratio(peak, r.budget_bytes)
                add(f"{r.method} {what}-measured peak / budget <= 1", q, None if q is None else q <= 1.0)
            q = _ratio(r.vm_peak, r.peak_bytes)
            add(f"{r.method} VM peak / profiler peak (cross-check)", q, None)
        q = None if r100 is None or eager is None else _ratio(r100.step_s, eager.step_s)
        add("remat@100% step time / eager <= 1", q, None if q is None else q <= 1.0)
        if eager and ck:
            t = _ratio(ck.step_s, eager.step_s) - 1
            add("checkpoint_sqrt step-time overhead in [15%, 40%]", t, 0.15 <= t <= 0.40)
            a = 1 - _ratio(ck.saved_bytes, eager.saved_bytes) if eager.saved_bytes else None
            add("checkpoint_sqrt saved-activation reduction in [35%, 67%]", a, None if a is None else 0.35 <= a <= 0.67)
            p = 1 - _ratio(ck.peak_bytes, eager.peak_bytes)
            add("checkpoint_sqrt peak reduction vs eager (info)", p, None)
        comp = [(b, by.get((name, f"compile@{b}"))) for b in COMPILE_BUDGETS]
        comp = [(b, r) for b, r in comp if r is not None]
        if len(comp) >= 2:
            # budgets in decreasing order; non-monotone: a smaller budget's peak is above a larger
            # budget's peak by more than MONOTONE_TOLERANCE (byte-level jitter does not count)
            comp.sort(key=lambda br: -br[0])
            peaks = [r.peak_bytes for _, r in comp]
            mono = all(peaks[j] <= peaks[i] * (1 + MONOTONE_TOLERANCE)
                       for i in range(len(peaks)) for j in range(i + 1, len(peaks)))
            desc = ", ".join(f"{b}: {r.peak_bytes / 2**20:.2f} MiB" for b, r in comp)
            add("torch.compile peak non-monotone in activation_memory_budget (expected)", None, not mono,
                "peaks " + desc)
            for b, r in comp:
                add(f"compile@{b} peak / eager peak", _ratio(r.peak_bytes, eager.peak_bytes if eager else None), None)
    return out


_UNIT = [2**20, "MiB"]  # display unit of the table: MiB, or KiB when every peak is below 10 MiB


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / _UNIT[0]:.2f}"


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row], comps: list[dict]) -> None:
    eager = {r.model: r for r in rows if r.method == "eager" and r.status == "ok"}
    peaks = [r.peak_bytes for r in rows if r.peak_bytes is not None]
    _UNIT[:] = [2**10, "KiB"] if peaks and max(peaks) < 10 * 2**20 else [2**20, "MiB"]
    hdr = (f"{'model':7} {'method':16} {'peak ' + _UNIT[1]:>9} {'x eager':>7} {'resid':>7} {'saved':>7} {'step ms':>8} "
           f"{'x eager':>7} {'plan s':>7} {'loss0':>8}  notes")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        e = eager.get(r.model)
        if r.status != "ok":
            print(f"{r.model:7} {r.method:16} {r.status.upper()}: {r.error[:140]}")
            continue
        note = r.detail
        if r.budget_bytes is not None:
            note += f" budget={_mib(r.budget_bytes)} predicted={_mib(r.predicted_peak)} vm={_mib(r.vm_peak)} {_UNIT[1]}"
        print(f"{r.model:7} {r.method:16} {_mib(r.peak_bytes):>9} {_fmt(_ratio(r.peak_bytes, e and e.peak_bytes), '.2f'):>7} "
              f"{_mib(r.resident_bytes):>7} {_mib(r.saved_bytes):>7} {_fmt(None if r.step_s is None else r.step_s * 1e3, '.2f'):>8} "
              f"{_fmt(_ratio(r.step_s, e and e.step_s), '.2f'):>7} {_fmt(r.plan_s, '.2f'):>7} "
              f"{_fmt(r.loss0, '.4f'):>8}  {note}")
    print("\nTargets (reported, not asserted):")
    for c in comps:
        met = {True: "MET", False: "NOT MET", None: ""}[c["met"]]
        val = "-" if c["value"] is None else f"{c['value']:+.3f}" if "overhead" in c["target"] or "reduction" in c["target"] else f"{c['value']:.3f}"
        print(f"  {c['model']:7} {c['target']:68} {val:>8} {met:8} {c['note']}")


def write_results(rows: list[Row], comps: list[dict], config: dict, out_dir: Path,
                  stem: str = "train_bench") -> tuple[Path, Path]:
    """Write ``<stem>.json`` (config, machine, rows, comparisons) and ``<stem>.csv`` (rows)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    import dataclasses
    dicts = [dataclasses.asdict(r) for r in rows]
    doc = {"config": config,
           "machine": machine(), "rows": dicts, "comparisons": comps}
    jp, cp = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    jp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    cols = [k for k in dicts[0] if k != "extra"] if dicts else []
    with cp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(dicts)
    return jp, cp


def show_and_write(rows: list, comps: list[dict], config: dict, out_dir: Path, stem: str,
                   print_table: Callable[[list, list[dict]], None]) -> dict:
    """A run's end: ``print_table(rows, comps)``, ``<stem>.json``/``.csv`` written (:func:`write_results`),
    and the run as ``{"rows", "comparisons", "config"}``."""
    print()
    print_table(rows, comps)
    jp, cp = write_results(rows, comps, config, out_dir, stem)
    print(f"\nwrote {jp} and {cp} ({config['wall_s']:.0f} s)")
    return {"rows": rows, "comparisons": comps, "config": config}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run (~1 min): tiny models, 1 warm-up + 3 timed steps, torch.compile with the "
                        "fast aot_eager backend and one budget")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines (the slow part)")
    p.add_argument("--no-remat", action="store_true", help="skip the remat column")
    p.add_argument("--models", default=",".join(zoo.MODELS), help=f"comma-separated subset of {', '.join(zoo.MODELS)}")
    p.add_argument("--size", choices=zoo.SIZES, default=None, help="zoo size (default: small; tiny with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before measuring (>= 1; default 2, 1 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per method, median reported (default 5, 3 with --quick)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default inductor; aot_eager with --quick). aot_eager uses the same "
                        "min-cut partitioner and memory budget without Inductor's fusion and C++ codegen")
    p.add_argument("--compile-budgets", default=None, help="comma-separated activation_memory_budget values "
                   "(default 1.0,0.5,0.25; 0.5 with --quick)")
    p.add_argument("--warm-compile-cache", action="store_true",
                   help="reuse Inductor's on-disk cache (default: a fresh one per run, so compile times are cold)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: on a shared 2-core machine, 2 OpenMP threads stall for "
                        "~1 s at barriers whenever another process holds a core, which swamps the step times)")
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="results folder (files train_bench.json/.csv; train_bench_quick.* with --quick)")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing methods")
    a = p.parse_args(argv)
    a.size = a.size or ("tiny" if a.quick else "small")
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    a.steps = a.steps if a.steps is not None else (3 if a.quick else 5)
    a.compile_backend = a.compile_backend or ("aot_eager" if a.quick else "inductor")
    a.compile_budgets = tuple(float(b) for b in (a.compile_budgets or ("0.5" if a.quick else "1.0,0.5,0.25")).split(","))
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in a.models:
        if m not in zoo.MODELS:
            p.error(f"unknown model {m!r}; valid: {', '.join(zoo.MODELS)}")
    if a.warmup < 1 or a.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    global COMPILE_BUDGETS
    COMPILE_BUDGETS = args.compile_budgets
    cache_dir = None
    if not args.no_compile and not args.warm_compile_cache:
        # Inductor keeps compiled graphs and kernels on disk across runs; a fresh cache folder makes
        # the recorded compile (plan) time a cold compile every run, not a cache hit.
        cache_dir = tempfile.mkdtemp(prefix="train_bench_inductor_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    t_start = time.perf_counter()
    rows: list[Row] = []
    methods = ["eager", "checkpoint_sqrt"]
    if not args.no_compile:
        methods += [f"compile@{b}" for b in args.compile_budgets]
    for name in args.models:
        _process_warmup(name, args.size)
        for method in methods:
            t = time.perf_counter()
            rows.append(bench_torch(name, args.size, method, args))
            print(f"[{time.perf_counter() - t_start:6.1f}s] {name} {method}: {rows[-1].status} "
                  f"({time.perf_counter() - t:.1f}s)", flush=True)
        if not args.no_remat:
            for budget in REMAT_BUDGETS:
                t = time.perf_counter()
                rows.append(bench_remat(name, args.size, budget, args))
                print(f"[{time.perf_counter() - t_start:6.1f}s] {name} remat@{budget}: {rows[-1].status} "
                      f"({time.perf_counter() - t:.1f}s)", flush=True)
    if cache_dir is not None:
        shutil.rmtree(cache_dir, ignore_errors=True)
    comps = compare(rows)
    config = {"cold_compile_cache": cache_dir is not None, "quick": args.quick, "size": args.size, "models": args.models, "warmup": args.warmup,
              "steps": args.steps, "compile": not args.no_compile, "compile_backend": args.compile_backend,
              "compile_budgets": list(args.compile_budgets), "remat": not args.no_remat,
              "remat_budgets": list(REMAT_BUDGETS), "optimizer": f"SGD(lr={LR}, momentum={MOMENTUM})",
              "wall_s": time.perf_counter() - t_start}
    return show_and_write(rows, comps, config, args.out, "train_bench_quick" if args.quick else "train_bench",
                          print_table)


if __name__ == "__main__":
    main()
