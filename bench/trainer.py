"""The Trainer recipe (issue 43): ``RematTrainer`` against Hugging Face gradient checkpointing, as ratios.

Models (random weights, built by bench/speed.py's Hugging Face builders from one seed, so every method
starts from the same weights): Llama, Gemma 3 (``Gemma3ForCausalLM`` on a ``Gemma3TextConfig``), GPT-2,
and Llama + LoRA (peft, rank 8 on the attention projections, base weights frozen); 4 layers of width
256, batches of 4 sequences of 256 random tokens (labels = inputs, the model's own causal-LM loss).
``--quick``: the same classes at width 32, 2 layers, 32 tokens.

The recipe, the same for every method: ``transformers.Trainer`` with AdamW (the Trainer's default
optimizer), ``lr_scheduler_type="cosine"`` with warmup, ``max_grad_norm=1.0``, one process on the CPU,
no logging, no saving. Methods, per model, each on its own fresh model:

* ``eager``          the plain ``Trainer``;
* ``checkpointing``  the plain ``Trainer`` with Hugging Face activation checkpointing
                     (``activation_checkpointing=True``, the name of ``gradient_checkpointing=True`` in
                     transformers 5; every decoder layer, non-reentrant);
* ``remat@B``        ``RematTrainer(..., budget=B)``, B the largest of the candidates (``--budgets``,
                     default 90% .. 40% of remat's unconstrained peak) whose measured allocator peak is at
                     most the checkpointing run's. Each candidate is a ``RematTrainer`` of its own,
                     compiled and measured in turn until one fits; their peaks are in ``budget_search``.
                     When none fits, the smallest feasible candidate is kept and the row says so.

Per method: a warm-up ``trainer.train()`` of ``--steps`` optimizer steps (remat compiles its step on the
first batch: that first step's excess over the median step is ``setup_s``), then the allocator peak of
one optimizer step: a one-step ``trainer.train()`` measured with bench/_measure.py's ``measure_peak``
(torch.profiler's memory events; resident = parameters, buffers and the optimizer's state, which the
warm-up allocated; the batch is collated inside the measured call). Then ``--rounds`` alternating rounds
(the start of the order rotates each round): each method runs ``trainer.train()`` of ``--steps`` steps,
timed per optimizer step by a ``TrainerCallback`` (``on_step_begin`` to ``on_step_end``: forward,
backward, clipping, ``optimizer.step()``, ``scheduler.step()``, ``zero_grad``; not the data loader).
A method's time in a round is the median of its steps; ``x_eager`` is the median over rounds of that
divided by eager's in the same round, ``x_checkpointing`` likewise against checkpointing's.

Every method runs the same sequence of ``train()`` calls on the same data, so each round's
``training_loss`` is compared with eager's (``loss_rel_diff``): a cross-check that all train alike.
The target (issue 43): remat's step time <= 0.9x checkpointing's at an allocator peak <= checkpointing's,
reported, never asserted.

Run:  PYTHONPATH=src .venv/bin/python bench/trainer.py [--quick] [--models llama,gpt2] [--rounds 5]
Writes bench/results/trainer.json and trainer.csv (trainer_quick.* with --quick) and prints the table.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure_peak, mib as _mib, resident_bytes  # noqa: E402
from speed import HF_MODELS, _f, _hf_text, _transformers_version  # noqa: E402
from train_bench import _err, _num, _ratio, _report_dict, show_and_write  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CANDIDATE_BUDGETS = ("90%", "80%", "70%", "60%", "50%", "40%")
TARGET_TIME = 0.9  # remat's step time / checkpointing's, at a peak <= checkpointing's
LR, WARMUP_RATIO, BATCH = 1e-3, 0.2, 4

_gemma3 = _hf_text("Gemma3ForCausalLM", "Gemma3TextConfig", hidden_size=256, intermediate_size=688,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   max_position_embeddings=256, use_cache=False)


def _lora(size: str) -> torch.nn.Module:
    """bench/speed.py's Llama with LoRA adapters (rank 8) on q, k, v and o; the base weights frozen."""
    import peft

    model = HF_MODELS["hf-llama"](size)[0]
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(model, lora)


MODELS: dict[str, Callable[[str], torch.nn.Module]] = {
    "llama": lambda size: HF_MODELS["hf-llama"](size)[0],
    "gemma3": lambda size: _gemma3(size)[0],
    "gpt2": lambda size: HF_MODELS["hf-gpt2"](size)[0],
    "llama-lora": _lora,
}
"""Benchmark name -> ``build(size)``: a seeded random-weight model (``size`` "small" or "tiny")."""


@dataclass
class Row:
    """One (model, method). Bytes and seconds; None where not measured."""

    model: str
    method: str                            # eager | checkpointing | remat@B
    status: str = "ok"                     # ok | error
    error: str = ""
    budget: str | None = None              # remat: the chosen candidate
    peak_bytes: int | None = None          # allocator peak of one optimizer step (resident + peak net)
    resident_bytes: int | None = None
    peak_x_eager: float | None = None
    peak_le_checkpointing: bool | None = None
    step_s: float | None = None            # median over rounds of the round's median step time
    x_eager: float | None = None           # median over rounds of (step time / eager's in that round)
    x_checkpointing: float | None = None   # median over rounds of (step time / checkpointing's in that round)
    rounds: int = 0
    first_step_s: float | None = None      # the warm-up run's first step (remat: compiles here)
    setup_s: float | None = None           # first step's excess over the median step
    loss_rel_diff: float | None = None     # max over rounds of |training_loss - eager's| / |eager's|
    predicted_peak: int | None = None      # remat report
    budget_bytes: int | None = None
    unconstrained_peak: int | None = None
    extra: dict = field(default_factory=dict)  # per-round times and losses; remat: budget_search, report


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step, from ``on_step_begin`` to ``on_step_end``."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t0)


@dataclass
class _Method:
    row: Row
    trainer: Any
    timer: Any


def make_data(vocab: int, length: int, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` random token sequences (the same for every method), labels = inputs."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    return [dict(input_ids=x, labels=x.clone()) for x in ids]


def _args(out_dir: str, steps: int, checkpointing: bool):
    ckpt = {}
    if checkpointing:  # transformers 5 renamed gradient_checkpointing (a deprecated alias since)
        name = ("activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
                else "gradient_checkpointing")
        ckpt[name] = True
    return TrainingArguments(output_dir=out_dir, report_to=[], use_cpu=True, logging_strategy="no", save_strategy="no",
                             max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=LR, optim="adamw_torch",
                             lr_scheduler_type="cosine", warmup_steps=max(1, round(WARMUP_RATIO * steps)),
                             max_grad_norm=1.0, seed=0, disable_tqdm=True, dataloader_num_workers=0, **ckpt)


def _train(m: _Method, steps: int) -> tuple[list[float], float]:
    """``trainer.train()`` of ``steps`` optimizer steps: each step's seconds and the run's training loss."""
    m.trainer.args.max_steps = steps
    m.trainer.args.warmup_steps = max(1, round(WARMUP_RATIO * steps))
    m.timer.times = []
    out = m.trainer.train()
    return list(m.timer.times), float(out.training_loss)


def set_up(name: str, method: str, args: argparse.Namespace, out_dir: str) -> _Method:
    """A fresh model in its trainer, warmed up (``steps`` steps: remat compiles) and its peak measured."""
    size = "tiny" if args.quick else "small"
    model = MODELS[name](size)
    length = 32 if args.quick else 256
    data = make_data(model.config.vocab_size, length, BATCH * args.steps)
    timer = StepTimer()
    row = Row(name, method)
    targs = _args(out_dir, args.steps, method == "checkpointing")
    if method.startswith("remat@"):
        from remat.integrations.transformers import RematTrainer

        row.budget = method.split("@", 1)[1]
        trainer = RematTrainer(model=model, args=targs, train_dataset=data, callbacks=[timer], budget=row.budget)
    else:
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # each train()'s metrics printed: noise in the bench's output
    m = _Method(row, trainer, timer)
    times, loss = _train(m, args.steps)
    row.first_step_s = times[0]
    row.extra = {"warmup_step_s": times, "warmup_loss": loss, "step_s_rounds": [], "loss_rounds": []}
    # the peak of one optimizer step: a one-step train() (the optimizer's state exists from the warm-up)
    m.trainer.args.max_steps = 1
    gc.collect()
    res = resident_bytes(trainer.model, trainer.optimizer)
    meas = measure_peak(lambda: trainer.train(), resident=res)
    row.peak_bytes, row.resident_bytes = meas.peak_bytes, meas.resident_bytes
    del meas
    if row.budget is not None:
        rep = _report_dict(trainer.remat_report())
        row.predicted_peak = _num(rep, "predicted_peak")
        row.budget_bytes = _num(rep, "budget")
        row.unconstrained_peak = _num(rep, "unconstrained_peak")
        row.extra["report"] = {k: v for k, v in rep.items() if isinstance(v, (int, float, str, bool, type(None)))}
    return m


def choose_remat(name: str, ckpt_peak: int | None, args: argparse.Namespace, out_dir: str,
                 log: Callable[[str], None]) -> _Method | None:
    """The ``RematTrainer`` at the largest candidate budget whose measured peak is at most ``ckpt_peak``
    (without one, the first candidate that compiles); when none fits, the smallest feasible candidate."""
    from remat import BudgetTooSmall

    search: list[dict] = []
    best: _Method | None = None
    for budget in args.budgets:
        t = time.perf_counter()
        try:
            m = set_up(name, f"remat@{budget}", args, out_dir)
        except BudgetTooSmall as e:
            search.append({"budget": budget, "status": "infeasible", "error": _err(e)})
            log(f"{name} remat@{budget}: infeasible")
            break  # smaller budgets are infeasible too
        except Exception as e:
            search.append({"budget": budget, "status": "error", "error": _err(e)})
            log(f"{name} remat@{budget}: error {_err(e)[:200]}")
            if args.verbose:
                traceback.print_exc()
            continue
        fits = ckpt_peak is None or m.row.peak_bytes <= ckpt_peak
        search.append({"budget": budget, "status": "ok", "peak_bytes": m.row.peak_bytes, "fits": fits,
                       "first_step_s": m.row.first_step_s, "set_up_s": time.perf_counter() - t})
        log(f"{name} remat@{budget}: peak {_mib(m.row.peak_bytes)} MiB "
            f"(checkpointing {_mib(ckpt_peak)} MiB){' fits' if fits else ''}")
        best = m
        if fits:
            break
        gc.collect()
    if best is None:
        row = Row(name, "remat", status="error", error="; ".join(f"{s['budget']}: {s.get('error', '')}" for s in search))
        row.extra["budget_search"] = search
        return _Method(row, None, None)
    best.row.peak_le_checkpointing = None if ckpt_peak is None else best.row.peak_bytes <= ckpt_peak
    best.row.extra["budget_search"] = search
    return best


def bench_model(name: str, args: argparse.Namespace, out_dir: str, log: Callable[[str], None]) -> list[Row]:
    """Set up eager, checkpointing and remat (budget search) for one model, then the timed rounds."""
    methods: list[_Method] = []
    for method in ("eager", "checkpointing"):
        try:
            methods.append(set_up(name, method, args, out_dir))
            log(f"{name} {method}: peak {_mib(methods[-1].row.peak_bytes)} MiB")
        except Exception as e:
            methods.append(_Method(Row(name, method, status="error", error=_err(e)), None, None))
            log(f"{name} {method}: error {_err(e)[:200]}")
            if args.verbose:
                traceback.print_exc()
    ckpt = methods[1].row
    methods.append(choose_remat(name, ckpt.peak_bytes if ckpt.status == "ok" else None, args, out_dir, log))
    live = [m for m in methods if m.row.status == "ok"]
    for r in range(args.rounds):
        gc.collect()
        k = r % len(live) if live else 0
        for m in live[k:] + live[:k]:
            if m.row.status != "ok":
                continue
            try:
                times, loss = _train(m, args.steps)
                m.row.extra["step_s_rounds"].append(statistics.median(times))
                m.row.extra["loss_rounds"].append(loss)
            except Exception as e:
                m.row.status, m.row.error = "error", _err(e)
                if args.verbose:
                    traceback.print_exc()
        log(f"{name}: round {r + 1}/{args.rounds} done")
    rows = [m.row for m in methods]
    summarise(rows)
    return rows


def _median_ratio(a: list[float], b: list[float]) -> float | None:
    ratios = [x / y for x, y in zip(a, b) if y]
    return statistics.median(ratios) if ratios else None


def summarise(rows: list[Row]) -> None:
    """Fill each row's medians and ratios to eager and checkpointing (rows of one model)."""
    by = {r.method: r for r in rows}
    eager, ckpt = by.get("eager"), by.get("checkpointing")

    def rounds(r: Row | None) -> list[float]:
        return r.extra.get("step_s_rounds", []) if r is not None and r.status == "ok" else []

    for r in rows:
        ts = rounds(r)
        if not ts:
            continue
        r.rounds, r.step_s = len(ts), statistics.median(ts)
        r.setup_s = max(0.0, r.first_step_s - r.step_s)
        if len(rounds(eager)) == len(ts):
            r.x_eager = _median_ratio(ts, rounds(eager))
            r.peak_x_eager = _ratio(r.peak_bytes, eager.peak_bytes)
            losses, ref = r.extra["loss_rounds"], eager.extra["loss_rounds"]
            r.loss_rel_diff = max((abs(a - b) / abs(b) for a, b in zip(losses, ref) if b), default=None)
        if len(rounds(ckpt)) == len(ts):
            r.x_checkpointing = _median_ratio(ts, rounds(ckpt))


def targets(rows: list[Row]) -> list[dict]:
    """Per model: remat's time <= 0.9x checkpointing's at a peak <= checkpointing's (met None: a side missing)."""
    out = []
    for name in dict.fromkeys(r.model for r in rows):
        ck = next((r for r in rows if r.model == name and r.method == "checkpointing" and r.status == "ok"), None)
        rm = next((r for r in rows if r.model == name and r.method.startswith("remat") and r.status == "ok"), None)
        t = rm.x_checkpointing if rm is not None and ck is not None else None
        met = None if t is None or rm.peak_le_checkpointing is None else bool(rm.peak_le_checkpointing and t <= TARGET_TIME)
        out.append({"model": name, "target": f"remat step time <= {TARGET_TIME}x checkpointing's at a peak <= its",
                    "value": t, "peak_le_checkpointing": None if rm is None else rm.peak_le_checkpointing,
                    "budget": None if rm is None else rm.budget, "met": met})
    return out


def print_table(rows: list[Row], comps: list[dict]) -> None:
    hdr = (f"{'model':11} {'method':14} {'peak MiB':>9} {'x eager':>7} {'step ms':>8} {'x eager':>7} {'x ckpt':>7} "
           f"{'setup s':>7} {'loss diff':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if r.status != "ok":
            print(f"{r.model:11} {r.method:14} ERROR: {r.error[:120]}")
            continue
        print(f"{r.model:11} {r.method:14} {_mib(r.peak_bytes):>9} {_f(r.peak_x_eager, '.2f'):>7} "
              f"{_f(None if r.step_s is None else r.step_s * 1e3, '.1f'):>8} {_f(r.x_eager, '.2f'):>7} "
              f"{_f(r.x_checkpointing, '.2f'):>7} {_f(r.setup_s, '.1f'):>7} {_f(r.loss_rel_diff, '.1e'):>9}")
    print("\nTarget (reported, not asserted):")
    for c in comps:
        met = {True: "MET", False: "NOT MET", None: "n/a"}[c["met"]]
        print(f"  {c['model']:11} remat@{c['budget']}: time x checkpointing {_f(c['value'], '.2f')}, "
              f"peak <= checkpointing's: {c['peak_le_checkpointing']}  -> {met} (target <= {TARGET_TIME})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny models (width 32, 2 layers, 32 tokens), "
                   "2 rounds of 2 steps")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--budgets", default=",".join(CANDIDATE_BUDGETS),
                   help="remat's candidate budgets, largest first (percentages of its unconstrained peak)")
    p.add_argument("--rounds", type=int, default=None, help="alternating timed rounds (default 5; 2 with --quick)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per train() call (default 5; 2 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1, as train_bench.py; "
                   "0 keeps torch's default)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (trainer.json/.csv; trainer_quick.* "
                   "with --quick)")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing methods")
    a = p.parse_args(argv)
    a.rounds = a.rounds if a.rounds is not None else (2 if a.quick else 5)
    a.steps = a.steps if a.steps is not None else (2 if a.quick else 5)
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    a.budgets = tuple(b.strip() for b in a.budgets.split(",") if b.strip())
    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    if not a.budgets or any(not b.endswith("%") for b in a.budgets):
        p.error("--budgets: percentages such as 80%,60%")
    if a.rounds < 1 or a.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()  # one notice per model built: noise in the bench's output
    torch.set_num_threads(args.threads or torch.get_num_threads())
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as out_dir:
        for name in args.models:
            rows += bench_model(name, args, out_dir, log)
    comps = targets(rows)
    config = {"quick": args.quick, "models": args.models, "candidate_budgets": list(args.budgets),
              "rounds": args.rounds, "steps_per_round": args.steps, "batch": BATCH,
              "tokens": 32 if args.quick else 256, "width": 32 if args.quick else 256,
              "layers": 2 if args.quick else 4, "optimizer": f"AdamW (adamw_torch, lr={LR})",
              "schedule": f"cosine, warmup {WARMUP_RATIO:.0%} of each run's steps", "max_grad_norm": 1.0,
              "transformers": _transformers_version(), "wall_s": time.perf_counter() - t_start}
    return show_and_write(rows, comps, config, args.out, "trainer_quick" if args.quick else "trainer", print_table)


if __name__ == "__main__":
    main()
