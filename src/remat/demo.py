"""``python -m remat.demo`` (``make demo``): train a GPT within 40% of its unconstrained peak memory.

A character-level GPT (``remat.zoo.GPT``, vanilla PyTorch) learns the text corpus shipped in
``remat/data`` with AdamW. ``remat.compile`` captures the model, builds the training step
(forward, backward, optimizer update) as IR, and plans recomputation so that the step's peak
memory stays within a budget of 40% of the peak without recomputation, in bf16 (fp32 master weights)
on a CPU with AVX-512 BF16 or AMX instructions, where it is the faster choice. The demo prints the plan,
the loss as it goes down, predicted vs measured peak, and the cost in time, then checks itself:
it exits 1 if the loss did not decrease or any step's measured peak exceeded the budget.

The helpers here (:func:`build_gpt`, :func:`compile_step`, :func:`train_loop`,
:func:`unconstrained_twin`) are the machinery behind ``remat train`` as well.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .budget import parse_budget
from .errors import BudgetTooSmall, format_bytes
from .runtime.hardware import native_precision

Batch = tuple[torch.Tensor, ...]
Write = Callable[[str], None]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a character-level GPT run: batch × sequence tokens per step, and the model."""

    batch: int
    seq_len: int
    layers: int
    heads: int
    width: int
    dropout: float = 0.0


# The demo's model is activation-heavy on purpose: 16×64 tokens per step through 6 layers of
# width 48, so attention maps and MLP activations (about 30 MB) dwarf the parameters, gradients
# and AdamW state (about 2 MB) and recomputation can bring the peak to 40% (the planner's
# minimum for it is about 29%). Deep and narrow also keeps a step cheap on a CPU.
DEMO = GPTConfig(batch=16, seq_len=64, layers=6, heads=4, width=48)
# Quick mode (tests): the same story in seconds. Parameters weigh more at this size, so the
# minimum feasible budget is about 50% and 40% exercises the fallback to the minimum.
QUICK = GPTConfig(batch=8, seq_len=32, layers=2, heads=2, width=16)
REFERENCE_EVERY = 5  # interleave one unconstrained reference step per this many training steps
# ``remat train --model gpt --size ...``: the zoo's GPT dimensions with the corpus vocabulary.
GPT_SIZES = {"tiny": GPTConfig(batch=2, seq_len=16, layers=2, heads=2, width=32),
             "small": GPTConfig(batch=8, seq_len=64, layers=4, heads=4, width=128)}


def build_gpt(vocab_size: int, cfg: GPTConfig, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised ``remat.zoo.GPT`` for ``cfg`` (deterministic in ``seed``)."""
    from .zoo import GPT

    torch.manual_seed(seed)
    return GPT(vocab_size, cfg.seq_len, cfg.layers, cfg.heads, cfg.width, cfg.dropout)


def compile_step(model: torch.nn.Module, example: Batch, loss_fn: Callable, optimizer, budget,
                 *, fallback: bool, write: Write = print, **options):
    """``remat.compile`` the training step, printing each stage with its elapsed time.

    With ``fallback``, a budget below the minimum feasible one is raised to that minimum (the
    user is told why); otherwise ``BudgetTooSmall`` propagates. Returns ``(step, note)`` where
    ``note`` explains a raised budget (None if the requested one was used).
    """
    from .train import compile as remat_compile

    t0 = time.perf_counter()

    def stage(name: str) -> None:
        write(f"  [{time.perf_counter() - t0:5.1f} s] {name}")

    try:
        return remat_compile(model, example, loss_fn, optimizer=optimizer, budget=budget, progress=stage,
                             **options), None
    except BudgetTooSmall as e:
        if not fallback:
            raise
        first = e
    # ``minimum`` is the planner's own figure: normally the exact peak of its most frugal plan, but
    # a heuristic planner is not monotone in the budget, so when it does not plan there either
    # the budget grows by 10% per attempt (each attempt is a full compile).
    target = max(int(first.minimum), int(first.budget) + 1)
    for attempt in range(6):
        write(f"  budget {format_bytes(first.budget) if attempt == 0 else format_bytes(prev)} is infeasible: "
              f"planning again at {format_bytes(target)}")
        try:
            step = remat_compile(model, example, loss_fn, optimizer=optimizer, budget=target, progress=stage,
                                 **options)
        except BudgetTooSmall as e:
            prev, target = target, max(int(e.minimum), int(target * 1.1))
            continue
        frac = target / step.unconstrained_peak
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        found = "the minimum feasible budget" if attempt == 0 else "the smallest budget the planner could fit"
        note = (f"the requested {_describe_budget(budget)} ({format_bytes(first.budget)}) is infeasible for this "
                f"step; {found} is {format_bytes(target)} = {frac:.1%} of its unconstrained peak: even "
                f"recomputing as much as possible, the parameters ({format_bytes(params)}), their gradients (as much "
                f"again), the optimizer state and one layer's working set must be live at once; "
                f"training at {format_bytes(target)} instead")
        return step, note
    raise first


def _describe_budget(budget) -> str:
    return f"budget {budget}" if isinstance(budget, str) else f"budget of {format_bytes(parse_budget(budget))}"


@dataclass
class TrainResult:
    """Per-step losses, measured peaks (bytes) and step times (seconds) of a training run, and
    the paired timings (budgeted step, reference step) where a reference step was interleaved."""

    losses: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    paired: list[tuple[float, float]] = field(default_factory=list)
    reference_peaks: list[int] = field(default_factory=list)

    def loss_decreased(self) -> bool:
        """The mean loss of the last tenth of the steps (at least one) is below the first loss."""
        if len(self.losses) < 2:
            return False
        k = max(1, len(self.losses) // 10)
        return statistics.fmean(self.losses[-k:]) < self.losses[0]

    def median_step_seconds(self) -> float:
        """Median step time, leaving out the first step (it warms caches) when there are others."""
        ts = self.seconds[1:] or self.seconds
        return statistics.median(ts)

    def paired_overhead(self) -> tuple[float, float, float] | None:
        """``(overhead, budgeted s, reference s)``: the ratio of median step times, minus 1, over
        the steps where both ran back to back on the same batch (so under the same CPU load)."""
        if not self.paired:
            return None
        ours = statistics.median(a for a, _ in self.paired)
        ref = statistics.median(b for _, b in self.paired)
        return ours / ref - 1.0, ours, ref


def train_loop(step, next_batch: Callable[[int], Batch], steps: int, log_every: int,
               write: Write = print, progress: bool = True, reference=None, reference_every: int = 5) -> TrainResult:
    """Run ``steps`` training steps on ``next_batch(i)``, with a tqdm bar; every ``log_every``
    steps (and at the last) write the loss, the running mean and the measured peak.

    ``reference``: another compiled step (e.g. without a budget, on a copy of the model) run right
    after every ``reference_every``-th step on the same batch, to time both under the same load.
    """
    from tqdm import tqdm

    res = TrainResult()
    bar = tqdm(range(1, steps + 1), desc="training", unit="step", disable=not progress, leave=False,
               dynamic_ncols=True)
    for i in bar:
        batch = next_batch(i)
        t0 = time.perf_counter()
        loss = float(step(*batch))
        res.seconds.append(time.perf_counter() - t0)
        res.losses.append(loss)
        res.peaks.append(int(step.last_stats.peak_bytes))
        if reference is not None and i > 1 and i % reference_every == 0:  # step 1 warms caches
            t1 = time.perf_counter()
            reference(*batch)
            res.paired.append((res.seconds[-1], time.perf_counter() - t1))
            res.reference_peaks.append(int(reference.last_stats.peak_bytes))
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if i % log_every == 0 or i == steps or i == 1:
            recent = res.losses[-log_every:]
            line = (f"  step {i:>{len(str(steps))}}/{steps}  loss {loss:.4f}  (mean of last {len(recent)}: "
                    f"{statistics.fmean(recent):.4f})  peak {format_bytes(res.peaks[-1])}  "
                    f"{res.seconds[-1] * 1e3:.0f} ms")
            if progress:
                bar.write(line, file=sys.stdout)
            else:
                write(line)
    bar.close()
    return res


def unconstrained_twin(model: torch.nn.Module, example: Batch, loss_fn: Callable, make_optimizer: Callable,
                       **options):
    """The same training step compiled without a budget, on a deep copy of the model (so running
    it never touches the model being trained): the reference for peak memory and step time."""
    from .train import compile as remat_compile

    twin = copy.deepcopy(model)
    return remat_compile(twin, example, loss_fn, optimizer=make_optimizer(twin), budget=None, **options)


def _eval_loss(model: torch.nn.Module, loss_fn: Callable, batches: Sequence[Batch]) -> float:
    """Mean loss of the model's current parameters in eager PyTorch (an independent check that
    the compiled steps really trained the model's own tensors)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        val = statistics.fmean(float(loss_fn(model(x), y)) for x, y in batches)
    model.train(was)
    return val


def _section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 76 - len(title)))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m remat.demo", description=(
        "Train a character-level GPT on the shipped corpus within a memory budget (default: 40%% of the "
        "unconstrained peak), then check that the loss went down and no step exceeded the budget."))
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: 150; quick: 6)")
    ap.add_argument("--budget", default="40%",
                    help="memory budget: a percentage of the unconstrained peak ('40%%'), bytes, or a size "
                         "('12MiB'); below the minimum feasible one, the demo trains at the minimum and says why")
    ap.add_argument("--lr", type=float, default=6e-3, help="AdamW learning rate (default: 6e-3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initialisation and of the batches")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                    help="the step's precision (bf16: bf16 autocast, fp32 master weights); default auto: bf16 on a "
                         "CPU with AVX-512 BF16 or AMX instructions, where it is the faster choice, else fp32")
    ap.add_argument("--log-every", type=int, default=None, help="print the loss every N steps (default: steps/10)")
    ap.add_argument("--quick", action="store_true", help="a tiny model for a run of seconds (tests)")
    ap.add_argument("--threads", type=int, default=1,
                    help="PyTorch intra-op threads (default: 1; the VM runs thousands of small kernels per step, "
                         "for which extra threads mostly add contention)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit code (0: all checks passed, 1: a check failed, 2: bad arguments)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    steps = args.steps if args.steps is not None else (6 if args.quick else 150)
    if steps < 2:
        print(f"error: --steps must be at least 2 to see the loss change, got {steps}", file=sys.stderr)
        return 2
    try:
        parse_budget(args.budget, reference=1 << 40)
    except ValueError as e:
        print(f"error: --budget: {e}", file=sys.stderr)
        return 2
    if args.threads < 1:
        print(f"error: --threads must be at least 1, got {args.threads}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, steps, args.log_every or max(1, steps // 10))
    finally:
        torch.set_num_threads(threads)


def _precision(asked: str) -> tuple[str, str]:
    """(the precision the demo trains in, why)."""
    if asked != "auto":
        return asked, "as asked"
    if native_precision("bf16"):
        return "bf16", "this CPU computes bf16 natively (AVX-512 BF16 or AMX), so bf16 is the faster choice; --precision fp32 for float32"
    return "fp32", "this CPU does not compute bf16 natively (no AVX-512 BF16 or AMX), so float32 is the faster choice"


def _run(args: argparse.Namespace, steps: int, log_every: int) -> int:
    cfg = QUICK if args.quick else DEMO
    args.precision, why = _precision(args.precision)
    t_start = time.perf_counter()

    from .data import CharCorpus
    from .zoo import lm_loss

    _section("1. Data and model")
    corpus = CharCorpus()
    model = build_gpt(corpus.vocab_size, cfg, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed + 1)
    val_gen = torch.Generator().manual_seed(args.seed + 2)
    val_batches = [corpus.batch(cfg.batch, cfg.seq_len, val_gen, "val") for _ in range(4)]
    train_batches = [corpus.batch(cfg.batch, cfg.seq_len, gen) for _ in range(steps)]
    n_train, n_val = len(corpus.splits["train"]), len(corpus.splits["val"])
    print(f"  corpus: {n_train + n_val:,} characters of English prose from CPython's documentation "
          f"({n_train:,} train, {n_val:,} held out), vocabulary of {corpus.vocab_size} characters")
    print(f"  model: GPT, {cfg.layers} layers, {cfg.heads} heads, width {cfg.width}, context {cfg.seq_len}; "
          f"{n_params:,} parameters ({format_bytes(4 * n_params)} in f32)")
    print(f"  batch: {cfg.batch} sequences x {cfg.seq_len} characters = {cfg.batch * cfg.seq_len:,} tokens per step; "
          f"AdamW, lr {args.lr:g}; {steps} steps")
    print(f"  precision: {args.precision} ({why})")

    _section(f"2. Compile the training step under a budget of {args.budget}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    example = train_batches[0]
    try:
        step, note = compile_step(model, example, lm_loss, optimizer, args.budget, fallback=True, seed=args.seed,
                                  precision=args.precision)
    except BudgetTooSmall as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rep = step.report()
    print(f"  unconstrained peak (no recomputation): {format_bytes(rep.unconstrained_peak)}")
    print(f"  budget: {format_bytes(rep.budget)} = {rep.budget / rep.unconstrained_peak:.1%} of it")
    if note:
        print(f"  note: {note}")
    print(f"  plan: {rep.solver}; recomputes {rep.recomputed_instructions} of {rep.instructions} instructions; "
          f"predicted peak {format_bytes(rep.predicted_peak)} "
          f"({rep.predicted_peak / rep.unconstrained_peak:.1%} of unconstrained); "
          f"predicted recompute overhead {rep.predicted_overhead:+.1%}")
    for n in rep.solver_notes:
        print(f"    - {n}")

    _section("3. Reference: the same step without a budget, on a copy of the model")
    twin = unconstrained_twin(model, example, lm_loss, lambda m: torch.optim.AdamW(m.parameters(), lr=args.lr),
                              seed=args.seed, precision=args.precision)
    every = 1 if args.quick else REFERENCE_EVERY
    print(f"  compiled; it runs after every {'' if every == 1 else f'{every}th '}training step on the same batch, to measure its "
          f"peak and to time both steps under the same CPU load")

    _section("4. Training")
    val_before = _eval_loss(model, lm_loss, val_batches)
    res = train_loop(step, lambda i: train_batches[i - 1], steps, log_every, progress=not args.no_progress,
                     reference=twin, reference_every=every)
    val_after = _eval_loss(model, lm_loss, val_batches)
    print(f"  held-out loss (eager PyTorch on the trained parameters): {val_before:.4f} -> {val_after:.4f}")

    _section("5. Report")
    print(step.report())
    max_peak = max(res.peaks)
    ref_peak = max(res.reference_peaks) if res.reference_peaks else twin.predicted_peak
    print(f"\n  measured peak over all {steps} steps: {format_bytes(max_peak)} ({max_peak:,} B); predicted "
          f"{format_bytes(step.predicted_peak)} ({step.predicted_peak:,} B); without a budget: "
          f"{format_bytes(ref_peak)} ({ref_peak:,} B, {'measured' if res.reference_peaks else 'predicted'})")
    paired = res.paired_overhead()
    if paired is not None:
        overhead, ours, ref = paired
        print(f"  measured overhead: median step {ours * 1e3:.0f} ms under the budget vs {ref * 1e3:.0f} ms without, "
              f"{overhead:+.1%} (over {len(res.paired)} back-to-back pairs; predicted {step.compilation.plan.overhead:+.1%})")
    else:
        overhead = None
        print("  measured overhead: too few steps to pair with the reference")

    _section("6. Checks")
    tail = max(1, steps // 10)
    final = statistics.fmean(res.losses[-tail:])
    checks = [
        (res.loss_decreased(), f"training loss decreased: {res.losses[0]:.4f} -> {final:.4f} "
                               f"(mean of the last {tail} step{'s' if tail > 1 else ''})"),
        (val_after < val_before, f"held-out loss decreased: {val_before:.4f} -> {val_after:.4f}"),
        (max_peak <= step.budget, f"every step's measured peak <= budget: {format_bytes(max_peak)} <= "
                                  f"{format_bytes(step.budget)}"),
    ]
    for ok, what in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {what}")
    passed = all(ok for ok, _ in checks)
    wall = time.perf_counter() - t_start
    verdict = "OK" if passed else "FAILED"
    print(f"\n{verdict}: trained a {n_params:,}-parameter GPT for {steps} steps in {wall:.0f} s; loss "
          f"{res.losses[0]:.3f} -> {final:.3f}; peak {format_bytes(max_peak)} = "
          f"{max_peak / ref_peak:.0%} of the unconstrained {format_bytes(ref_peak)} (budget {format_bytes(step.budget)})"
          + ("" if overhead is None else f"; step time {overhead:+.0%}"))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
