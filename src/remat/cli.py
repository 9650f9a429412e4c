"""The ``remat`` command line.

    remat train --model gpt --size small --budget 40% --batch-size 16 --steps 50   # train a zoo model under a budget
    remat train --nproc 2 --budget 60% --steps 30                   # ... on 2 data-parallel ranks (torchrun)
    remat curve --model unet --size small --out curve/               # a training step's budget sweep (PNG + CSV)
    remat curve --chain --model mlp --depth 16                       # thesis Fig. 4.1 chain trade-off
    remat curve --random 20                                          # ... for a random heterogeneous chain
    remat max-batch --model gpt --budget 2GiB                        # largest batch under a cap, vs eager PyTorch
    remat plan --config llama3-8b.json --seq 4096 --device h100-80gb  # plan a transformers model on meta (nothing run)
    remat opt FILE --passes canonicalize,cse                         # the IR driver (remat.opt)

Exit codes: 0 success; 1 a run failed its own checks (loss did not decrease, a measured peak
exceeded the budget) or ``opt`` rejected its input; 2 bad arguments, including a budget below
the minimum feasible one (the message gives that minimum).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Sequence

from .budget import parse_budget
from .distributed.group import MODES as DP_MODES
from .errors import BudgetTooSmall, format_bytes

MODELS = ("gpt", "mlp", "resnet", "unet")
SIZES = ("tiny", "small")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Arguments that parse but make no sense together; reported with exit code 2."""


DEFAULT_TRAIN_BUDGET = "40%"
"""``remat train``'s budget when none is given; below the step's minimum it trains at the minimum."""


def _budget_arg(text: str) -> str | None:
    """argparse type of ``--budget``: validated now (so a typo fails before any work), parsed
    against the unconstrained peak later. 'none' means no budget (no recomputation)."""
    if text.strip().lower() in ("none", "off", "inf"):
        return None
    try:
        parse_budget(text, reference=1 << 40)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _absolute_budget_arg(text: str) -> str:
    """argparse type of ``max-batch --budget``: bytes or a size, validated now (a fraction of the
    unconstrained peak means nothing there: the peak changes with the batch)."""
    from .train.max_batch import absolute_budget

    try:
        absolute_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from .train.compilation import PRECISIONS

    ap = argparse.ArgumentParser(
        prog="remat", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="remat: fit deep-learning training into a memory budget with the least recomputation.",
        epilog="Run 'remat <command> --help' for a command's options. Exit codes: 0 ok, 1 a run failed its "
               "checks, 2 bad arguments or a budget below the feasible minimum.")
    sub = ap.add_subparsers(dest="command", metavar="<command>")
    sub.required = True

    tr = sub.add_parser(
        "train", help="train a zoo model within a memory budget",
        description="Compile a training step of a zoo model (vanilla PyTorch) with remat.compile under a "
                    "memory budget and train it. gpt learns the shipped text corpus (character level); mlp, "
                    "resnet and unet fit one fixed synthetic batch (random inputs and labels), which "
                    "exercises the same machinery. The run checks itself: exit 1 if the loss did not "
                    "decrease or a step's measured peak exceeded the budget.")
    tr.add_argument("--model", choices=MODELS, default="gpt", help="zoo model (default: gpt)")
    tr.add_argument("--size", choices=SIZES, default="tiny", help="model size (default: tiny)")
    tr.add_argument("--budget", type=_budget_arg, default=argparse.SUPPRESS,
                    help=f"memory budget: a percentage of the unconstrained peak ('40%%'), bytes ('800000'), a size "
                         f"('12MiB'), or 'none' for no recomputation (default: {DEFAULT_TRAIN_BUDGET}, or the "
                         "minimum feasible budget where that is higher)")
    tr.add_argument("--fit-minimum", action="store_true",
                    help="if the budget given is below the minimum feasible one, train at that minimum instead of "
                         "failing (what the default budget does)")
    tr.add_argument("--steps", type=_positive_int, default=20, help="training steps (default: 20)")
    tr.add_argument("--batch-size", type=_positive_int, default=None,
                    help="examples per step (default: the zoo model's example batch)")
    tr.add_argument("--lr", type=_positive_float, default=None,
                    help="learning rate (default: 3e-3 for adamw, 0.05 for sgd)")
    tr.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="optimizer (default: adamw)")
    tr.add_argument("--precision", choices=PRECISIONS, default="fp32",
                    help="fp32 (default), bf16 (autocast's op lists, fp32 master weights) or fp16 (with dynamic "
                         "loss scaling); see remat.compile")
    tr.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the data (default: 0)")
    tr.add_argument("--log-every", type=_positive_int, default=None, help="print the loss every N steps")
    tr.add_argument("--threads", type=_positive_int, default=1,
                    help="PyTorch intra-op threads (default: 1; the VM runs many small kernels)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--nproc", type=_positive_int, default=1,
                    help="data-parallel ranks (default: 1): N > 1 launches N processes on this machine with "
                         "torchrun (torch.distributed.run, gloo); each trains on its 1/N of every batch, and "
                         "--budget is per rank. Under torchrun itself, 'remat train' is one rank of WORLD_SIZE")
    tr.add_argument("--data-parallel", choices=DP_MODES, default=None,
                    help="with several ranks: ddp, zero1 or zero2 (the default; see remat.compile)")

    cu = sub.add_parser(
        "curve", help="sweep a model's training step over budgets (or draw a chain's trade-off)",
        description="Compile a training step of a zoo model (no optimizer) once and plan it at budgets from the "
                    "minimum to the unconstrained peak, running each plan on the VM: predicted and measured peak "
                    "and predicted/measured overhead, written as curve.png and curve.csv. With --chain (mlp) "
                    "or --random N: the thesis Fig. 4.1 trade-off of a chain of layers instead, solved with the "
                    "uniform, precise (thesis DP), extended and sqrt(N) strategies.")
    cu.add_argument("--model", choices=MODELS, default="mlp", help="zoo model (default: mlp)")
    cu.add_argument("--size", choices=SIZES, default="small", help="model size (default: small)")
    cu.add_argument("--chain", action="store_true",
                    help="profile the mlp's layers as a chain and draw the chain solvers' trade-off")
    cu.add_argument("--depth", type=_positive_int, default=None,
                    help="hidden layers of the --chain mlp (each Linear and ReLU is a stage; default: the size's)")
    cu.add_argument("--batch-size", type=_positive_int, default=None, help="batch of the profiled input")
    cu.add_argument("--random", type=_positive_int, default=None, metavar="N",
                    help="use a random heterogeneous chain of N layers (ChainCosts.random) instead of a model")
    cu.add_argument("--seed", type=int, default=0, help="seed of --random and of the model (default: 0)")
    cu.add_argument("--out", default="remat-curve", metavar="DIR", help="output folder (default: remat-curve)")
    cu.add_argument("--points", type=_positive_int, default=None, metavar="N",
                    help="budgets (default: 10 for a model's step, 40 per method for a chain)")
    cu.add_argument("--no-progress", action="store_true", help="no progress bar")

    mb = sub.add_parser(
        "max-batch", help="the largest batch whose training step fits a budget, next to eager PyTorch's",
        description="Search the largest batch size whose training step of a zoo model fits a byte budget "
                    "(parameters, gradients and optimizer state included) with remat.max_batch (each candidate "
                    "compiled and planned, none run: predicted peak == measured), and the largest batch eager "
                    "PyTorch trains under the same cap (its allocator peak measured per candidate with "
                    "torch.profiler). Then one remat step at the largest batch checks its measured peak.")
    mb.add_argument("--model", choices=MODELS, default="gpt", help="zoo model (default: gpt)")
    mb.add_argument("--size", choices=SIZES + ("medium",), default=None,
                    help="model size (default: medium for gpt, the speed benchmark's GPT medium; small otherwise)")
    mb.add_argument("--budget", required=True, type=_absolute_budget_arg,
                    help="memory budget: bytes ('1500000000') or a size ('2GiB', '800MB')")
    mb.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw",
                    help="optimizer whose state counts in the budget (default: adamw; none: gradients only)")
    mb.add_argument("--no-eager", action="store_true", help="skip eager PyTorch's search")
    mb.add_argument("--limit", type=_positive_int, default=4096, help="largest batch tried (default: 4096)")
    mb.add_argument("--no-progress", action="store_true", help="do not print each candidate")

    pl = sub.add_parser(
        "plan", help="plan a transformers model's training step for a device, without running it",
        description="Build a transformers causal language model from a local config.json on the meta device "
                    "(nothing downloaded, nothing of its size allocated), plan its training step with "
                    "remat.compile(..., dry_run=True) for a device, and print the report: predicted peak by kind, "
                    "the minimum feasible budget, the plan and its predicted recomputation time. With --curve, "
                    "the trade-off of budgets from the minimum to the unconstrained peak. Exit 2 if the budget is "
                    "below the minimum (the message gives it).")
    pl.add_argument("--config", required=True, help="a transformers config.json (or a folder holding one)")
    pl.add_argument("--seq", type=_positive_int, default=2048, help="tokens per sequence (default: 2048)")
    pl.add_argument("--batch", type=_positive_int, default=1, help="sequences per step (default: 1)")
    pl.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: torch.autocast in bfloat16 (the default); fp32: compute in the weights' dtype")
    pl.add_argument("--weights", choices=("fp32", "bf16"), default="fp32",
                    help="the parameters' dtype (default: fp32 master weights; bf16: pure bf16 training)")
    pl.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "none"), default="adamw",
                    help="optimizer whose state counts (default: adamw; none: gradients only)")
    pl.add_argument("--lora", type=_positive_int, default=None, metavar="R",
                    help="LoRA adapters of rank R on the attention and MLP projections (peft); the base frozen")
    pl.add_argument("--device", default="h100-80gb",
                    help="device to plan for: a built-in name (remat.DEVICES: cpu, h100-80gb, a100-80gb, a100-40gb, "
                         "rtx4090-24gb, l4-24gb) or a JSON file of a remat.DeviceSpec's fields (default: h100-80gb)")
    pl.add_argument("--budget", type=_budget_arg, default=None,
                    help="memory budget (default: the device's memory): a size ('80GiB'), bytes, or a percentage "
                         "of the unconstrained peak")
    pl.add_argument("--layers", type=_positive_int, default=None,
                    help="override num_hidden_layers (plan a shallower model of the same width)")
    pl.add_argument("--curve", action="store_true", help="also plan budgets from the minimum to the unconstrained peak")
    pl.add_argument("--points", type=_positive_int, default=6, help="budgets of --curve (default: 6)")
    pl.add_argument("--solver", choices=("auto", "greedy", "milp"), default="auto", help="planner (default: auto)")
    pl.add_argument("--json", default=None, metavar="FILE", help="also write the report's numbers as JSON")

    sub.add_parser("opt", add_help=False, help="parse, verify and transform IR (see 'remat opt --help')",
                   description="The IR driver; all arguments go to remat.opt.")
    return ap


# ---------------------------------------------------------------- train
def _synthetic_batch(model, example, loss_fn, batch_size: int | None, seed: int):
    """The zoo's example batch, or a random one of ``batch_size`` with the same trailing shapes:
    inputs from N(0, 1), integer class targets drawn below the model's number of output classes."""
    import torch

    if batch_size is None or batch_size == example[0].shape[0]:
        return example
    x, y = example
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        classes = model(x[:1]).shape[1]  # logits are [N, C, ...]
    x2 = torch.randn((batch_size, *x.shape[1:]), generator=g, dtype=x.dtype)
    y2 = torch.randint(0, classes, (batch_size, *y.shape[1:]), generator=g)
    return x2, y2


def _torchrun_world() -> int:
    """The number of ranks when this process is one rank started by torchrun, else 0."""
    return int(os.environ["WORLD_SIZE"]) if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ else 0


def _launch(argv: list[str], nproc: int) -> int:
    """``remat train --nproc N``: run ``remat train`` as N ranks with torchrun (``torch.distributed.run``,
    rendezvous on this machine); the ranks find their place in torchrun's environment."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    rest, skip = [], False
    for a in argv[1:]:  # the ranks' arguments: without --nproc (torchrun's own parser would claim it)
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    print(f"remat train: launching {nproc} ranks with torchrun (torch.distributed.run) on this machine", flush=True)
    targs = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(nproc), "--module", "remat.cli",
                                          "train", *rest])
    try:
        run(targs)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        print(f"remat train: rank(s) {sorted(f.local_rank for f in e.failures.values())} exited with {codes}",
              file=sys.stderr)
        return EXIT_USAGE if codes == [EXIT_USAGE] else EXIT_FAILED
    return EXIT_OK


class _MeanLoss:
    """A data-parallel step whose call returns the loss averaged over the ranks (the whole batch's)."""

    def __init__(self, step, world: int) -> None:
        self.step, self.world = step, world

    def __call__(self, *batch):
        import torch.distributed as dist

        loss = self.step(*batch).detach().clone()
        dist.all_reduce(loss)
        return loss / self.world

    @property
    def last_stats(self):
        return self.step.last_stats


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    world = _torchrun_world()
    if args.nproc > 1 and not world:
        return _launch(argv, args.nproc)
    if args.nproc > 1 and args.nproc != world:
        raise UsageError(f"--nproc {args.nproc} under torchrun with WORLD_SIZE={world}; leave --nproc out under torchrun")
    if args.data_parallel is not None and world < 2:
        raise UsageError(f"--data-parallel {args.data_parallel} needs several ranks: pass --nproc 2 (or more)")
    if world < 2:
        return _train_one(args, 0, 1)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        code = _train_one(args, dist.get_rank(), world)
        dist.barrier()  # no rank tears the group down while a peer still talks to it (gloo: closed by peer)
        return code
    finally:
        dist.destroy_process_group()


def _train_one(args: argparse.Namespace, rank: int, world: int) -> int:
    """Train in this process: alone (``world`` 1), or as ``rank`` of ``world`` on its 1/world of
    every batch; only rank 0 writes, and every rank returns the same exit code."""
    import torch

    from . import demo, zoo

    say = print if rank == 0 else (lambda *a, **k: None)
    lr = args.lr if args.lr is not None else (3e-3 if args.optimizer == "adamw" else 0.05)
    t0 = time.perf_counter()
    if args.model == "gpt":
        from .data import CharCorpus

        cfg = demo.GPT_SIZES[args.size]
        batch = args.batch_size or cfg.batch
        corpus = CharCorpus()
        model = demo.build_gpt(corpus.vocab_size, cfg, seed=args.seed)
        loss_fn = zoo.lm_loss
        gen = torch.Generator().manual_seed(args.seed + 1)
        batches = [corpus.batch(batch, cfg.seq_len, gen) for _ in range(args.steps)]
        what = (f"GPT ({cfg.layers} layers, width {cfg.width}) on the shipped corpus, {batch}x{cfg.seq_len} "
                f"characters per step")
    else:
        model, example, loss_fn = zoo.make(args.model, args.size, seed=args.seed)
        fixed = _synthetic_batch(model, example, loss_fn, args.batch_size, args.seed)
        batches = [fixed] * args.steps
        what = f"{args.model} ({args.size}) on one fixed synthetic batch of {fixed[0].shape[0]}"
    n_params = sum(p.numel() for p in model.parameters())
    options = {"precision": args.precision}
    if world > 1:
        n = batches[0][0].shape[0]
        if n % world:
            raise UsageError(f"a batch of {n} does not split into {world} equal shards; pass --batch-size a "
                             f"multiple of {world}")
        part = n // world  # this rank's rows: views into the whole batch (the step counts its copy)
        batches = [tuple(t[rank * part:(rank + 1) * part] for t in b) for b in batches]
        options["data_parallel"] = args.data_parallel or "zero2"
        what += f"; {world} ranks ({options['data_parallel']}), {part} examples each"
    say(f"remat train: {what}; {n_params:,} parameters; {args.optimizer}, lr {lr:g}; {args.precision}; "
        f"{args.steps} steps")
    opt_cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
    optimizer = opt_cls(model.parameters(), lr=lr)
    try:
        given = getattr(args, "budget", DEFAULT_TRAIN_BUDGET)  # (no --budget: the default, else the minimum)
        step, note = demo.compile_step(model, batches[0], loss_fn, optimizer, given,
                                       fallback=args.fit_minimum or not hasattr(args, "budget"), seed=args.seed,
                                       write=say, **options)
    except BudgetTooSmall as e:
        if rank == 0:
            print(f"error: {e}\nhint: pass --budget {int(e.minimum)} (or --fit-minimum) to train at the minimum",
                  file=sys.stderr)
        return EXIT_USAGE
    if note:
        say(f"note: {note}")
    run = step if world == 1 else _MeanLoss(step, world)
    res = demo.train_loop(run, lambda i: batches[i - 1], args.steps, args.log_every or max(1, args.steps // 10),
                          write=say, progress=not args.no_progress and rank == 0)
    say(step.report())
    max_peak = max(res.peaks)
    ok_loss = res.loss_decreased()  # with several ranks, the whole batch's loss: the same on every rank
    ok_peak = step.budget is None or max_peak <= step.budget
    if world > 1:
        import torch.distributed as dist

        flag = torch.tensor(int(ok_peak))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank within its budget
        ok_peak = bool(flag)
    budget = "no budget" if step.budget is None else f"budget {format_bytes(step.budget)}"
    each = " (rank 0's; every rank within its budget)" if world > 1 and ok_peak else ""
    say(f"{'OK' if ok_loss and ok_peak else 'FAILED'}: loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f}"
        f"{'' if ok_loss else ' (did not decrease)'}; measured peak {format_bytes(max_peak)} "
        f"({max_peak / step.unconstrained_peak:.1%} of unconstrained), {budget}"
        f"{'' if ok_peak else ' (EXCEEDED)'}{each}; {time.perf_counter() - t0:.1f} s")
    return EXIT_OK if ok_loss and ok_peak else EXIT_FAILED


# ---------------------------------------------------------------- curve
def _chain_costs(args: argparse.Namespace):
    """ChainCosts of the requested chain and a one-line description of it."""
    from .plan.chain import ChainCosts

    if args.random is not None:
        return ChainCosts.random(args.random, seed=args.seed), f"random heterogeneous chain, N={args.random}, seed {args.seed}"
    if args.model != "mlp":
        why = {"gpt": "its blocks hold a causal-mask buffer and dropout",
               "resnet": "it has batch norm (running statistics are state) and residual branches",
               "unet": "it has batch norm and long skip connections"}[args.model]
        raise UsageError(f"--chain needs a chain of stateless layers; --model {args.model} is not one ({why}). "
                         "Use --chain --model mlp (with --depth for a longer chain) or --random N; "
                         f"'remat curve --model {args.model}' (without --chain) sweeps its whole training step")
    import torch

    from .plan.chain import SequentialCheckpointer
    from .zoo import MLP

    tiny = args.size == "tiny"
    batch = args.batch_size or (8 if tiny else 256)
    fin, hidden, classes = (32, 64, 10) if tiny else (784, 1024, 10)
    depth = args.depth or (2 if tiny else 4)
    torch.manual_seed(args.seed)
    model = MLP(fin, hidden, depth, classes)
    layers = [*model.body.children(), model.head]
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(batch, fin, generator=g)
    upstream = torch.randn(batch, classes, generator=g)
    print(f"profiling {len(layers)} stages of an MLP ({fin} -> {hidden} x {depth} -> {classes}, batch {batch}) "
          "on the VM ...", flush=True)
    chk = SequentialCheckpointer(layers)
    chk.profile_sequence(x, upstream)
    return chk.costs(), f"MLP, {len(layers)} stages, batch {batch}"


def _model_curve(args: argparse.Namespace) -> int:
    """The budget sweep of a zoo model's training step (``remat.train.curve``)."""
    import remat

    from . import zoo
    from .train.curve import budget_sweep, default_budgets, format_table, write_sweep

    if args.depth is not None:
        raise UsageError("--depth sizes the --chain mlp; give --chain, or --size for a model's step")
    t0 = time.perf_counter()
    model, example, loss_fn = zoo.make(args.model, args.size, seed=args.seed, batch=args.batch_size)
    step = remat.compile(model, example, loss_fn)
    budgets = default_budgets(step, args.points or 10)
    print(f"{args.model} ({args.size}), no optimizer: unconstrained peak {format_bytes(step.unconstrained_peak)} "
          f"({step.unconstrained_peak:,} B), minimum budget {format_bytes(budgets[0])} ({budgets[0]:,} B); "
          f"planning {len(budgets)} budgets", flush=True)
    show = None if args.no_progress else (lambda k, n: print(f"  budget {k + 1}/{n} ...", flush=True))
    rows = budget_sweep(step, budgets, progress=show)
    os.makedirs(args.out, exist_ok=True)
    png, csv_path = os.path.join(args.out, "curve.png"), os.path.join(args.out, "curve.csv")
    write_sweep(rows, png, csv_path, f"remat: {args.model} ({args.size}) training step over budgets")
    print(format_table(rows))
    bad = [r for r in rows if not r.measured_peak == r.predicted_peak <= r.budget]
    rising = [b for a, b in zip(rows, rows[1:]) if b.predicted_overhead > a.predicted_overhead]
    print(f"wrote {png} and {csv_path} ({len(rows)} rows) in {time.perf_counter() - t0:.1f} s; "
          f"{len(bad)} budget(s) with measured != predicted or over budget, "
          f"{len(rising)} rise(s) of the predicted overhead")
    return EXIT_FAILED if bad or rising else EXIT_OK


def _curve(args: argparse.Namespace) -> int:
    from .plan.chain import curve_main
    from .plan.chain.solvers import minimum_budget, no_recompute_peak

    if args.random is not None and args.model != "mlp":
        raise UsageError("give either --random N or --model, not both")
    if args.points is not None and args.points < 2:
        raise UsageError(f"--points must be at least 2, got {args.points}")
    if args.random is None and not args.chain:
        return _model_curve(args)
    t0 = time.perf_counter()
    costs, what = _chain_costs(args)
    lo, hi = minimum_budget(costs, 1), no_recompute_peak(costs)
    print(f"chain: {what}; no-recompute peak {format_bytes(hi)} ({hi:,} B), minimum budget "
          f"{format_bytes(lo)} ({lo:,} B)")
    png, csv_path = curve_main(costs, args.out, args.points or 40, progress=not args.no_progress)
    import csv

    with open(csv_path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    budgets = sorted({int(r["budget"]) for r in rows})
    for label, b in (("smallest", budgets[0]), ("middle", budgets[len(budgets) // 2])):
        parts = []
        for m in dict.fromkeys(r["method"] for r in rows):
            r = next(r for r in rows if r["method"] == m and int(r["budget"]) == b)
            if r["overhead"] == "nan":
                parts.append(f"{m} infeasible")
            else:
                over = "" if r["feasible"] == "True" else " (over budget)"
                parts.append(f"{m} {float(r['overhead']):.3f}{over}")
        print(f"  at the {label} budget ({format_bytes(b)}): " + ", ".join(parts))
    print(f"wrote {png} and {csv_path} ({len(rows)} rows) in {time.perf_counter() - t0:.1f} s")
    return EXIT_OK


# ---------------------------------------------------------------- max-batch
def _max_batch(args: argparse.Namespace) -> int:
    """``remat max-batch``: remat's and eager PyTorch's largest batch under one cap."""
    import torch

    from . import zoo
    from .train.max_batch import eager_max_batch, max_batch

    size = args.size or ("medium" if args.model == "gpt" else "small")
    if size == "medium" and args.model != "gpt":
        raise UsageError(f"--size medium is the GPT medium; {args.model} has sizes {', '.join(SIZES)}")
    model, example, loss_fn = zoo.make(args.model, size)
    opt = {"adamw": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3),
           "sgd": lambda: torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9),
           "none": lambda: None}[args.optimizer]()

    def make_batch(n: int):
        return zoo.make(args.model, size, batch=n)[1]

    say = None if args.no_progress else (lambda msg: print(f"  {msg}", flush=True))
    t0 = time.perf_counter()
    print(f"remat max-batch: {args.model} ({size}), {args.optimizer}, budget {args.budget}", flush=True)
    res = max_batch(model, make_batch, loss_fn, optimizer=opt, budget=args.budget, limit=args.limit, progress=say)
    t_remat = time.perf_counter() - t0
    if res.batch == 0:  # the budget is below batch 1's minimum: a budget below the feasible minimum
        print(f"remat: not even batch 1 fits {format_bytes(res.budget)} (needs {format_bytes(res.probes[0].bytes)})")
        return EXIT_USAGE
    eager = None
    if not args.no_eager:
        t1 = time.perf_counter()
        eager, _ = eager_max_batch(model, make_batch, loss_fn, optimizer=opt, budget=args.budget, limit=args.limit,
                                   progress=say)
        t_eager = time.perf_counter() - t1
    res.step(*make_batch(res.batch))
    measured = res.step.last_stats.peak_bytes
    ok = measured == res.step.predicted_peak <= res.budget
    print(f"remat: largest batch {res.batch} (peak {format_bytes(measured)} measured, "
          f"{format_bytes(res.step.predicted_peak)} predicted; {len(res.probes)} candidates compiled, none run, "
          f"in {t_remat:.1f} s)")
    if eager is not None:
        ratio = f"{res.batch / eager:.2f}x eager's" if eager else "eager fits no batch"
        print(f"eager PyTorch: largest batch {eager} (allocator peak by torch.profiler, measured per candidate "
              f"in {t_eager:.1f} s); remat's is {ratio}")
    print(f"{'OK' if ok else 'FAILED'}: one step at batch {res.batch}: measured peak "
          f"{'==' if measured == res.step.predicted_peak else '!='} predicted, "
          f"{'within' if measured <= res.budget else 'OVER'} the budget of {format_bytes(res.budget)}")
    return EXIT_OK if ok else EXIT_FAILED


# ---------------------------------------------------------------- main
# ---------------------------------------------------------------- plan
def _device_arg(text: str):
    """A built-in device name, or a JSON file of a DeviceSpec's fields."""
    import json

    from .plan.device import device_spec

    if text.endswith(".json") or os.path.isfile(text):
        try:
            with open(text) as f:
                return device_spec(json.load(f))
        except (OSError, ValueError) as e:
            raise UsageError(f"--device {text}: {e}") from None
    try:
        return device_spec(text)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _plan(args: argparse.Namespace) -> int:
    """``remat plan``: a transformers config planned by a dry run, its report (and curve) printed."""
    import json

    from .integrations.hf_config import load_config, plan_config

    device = _device_arg(args.device)
    try:
        config = load_config(args.config, **({} if args.layers is None else {"num_hidden_layers": args.layers}))
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    t0 = time.perf_counter()
    try:
        step, m = plan_config(config, args.batch, args.seq, precision=args.precision, weights=args.weights,
                              optimizer=args.optimizer, lora=args.lora, device=device, budget=args.budget,
                              solver=args.solver)
    except BudgetTooSmall as e:
        print(f"remat plan: {e}", file=sys.stderr)
        print(f"unconstrained peak: {format_bytes(e.unconstrained_peak)}" if e.unconstrained_peak else "",
              file=sys.stderr)
        return EXIT_USAGE
    seconds = time.perf_counter() - t0
    r = step.report()
    print(f"{type(m.model).__name__}: {m.parameters:,} parameters ({m.trainable:,} trainable), batch {args.batch} x "
          f"{args.seq} tokens, precision {args.precision}, weights {args.weights}, optimizer {args.optimizer}"
          + (f", LoRA r={args.lora}" if args.lora else "") + f"; planned in {seconds:.1f} s")
    print(device.summary())
    print(r)
    rows = []
    if args.curve:
        print("\nbudget curve (planned, not run):")
        print(f"{'budget':>14} {'peak':>14} {'overhead':>9} {'step ms':>9}  solver")
        for p in step.curve(n_points=args.points):
            rows.append(p)
            print(f"{format_bytes(p.budget):>14} {format_bytes(p.predicted_peak) if p.fits else '-':>14} "
                  f"{'' if p.predicted_overhead is None else f'{p.predicted_overhead:+.1%}':>9} "
                  f"{'' if p.predicted_seconds is None else f'{p.predicted_seconds * 1e3:.1f}':>9}  {p.solver}")
    if args.json:
        out = {"config": args.config, "seq": args.seq, "batch": args.batch, "precision": args.precision,
               "weights": args.weights, "optimizer": args.optimizer, "lora": args.lora, "device": device.name,
               "parameters": m.parameters, "trainable": m.trainable, "plan_seconds": seconds,
               "budget": r.budget, "predicted_peak": r.predicted_peak, "unconstrained_peak": r.unconstrained_peak,
               "minimum_budget": r.minimum_budget, "memory": r.memory, "solver": r.solver,
               "predicted_overhead": r.predicted_overhead, "predicted_step_seconds": r.predicted_step_seconds,
               "predicted_recompute_seconds": r.predicted_recompute_seconds,
               "curve": [p.__dict__ for p in rows]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``remat`` with ``argv`` (without the program name); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "opt":
        from . import opt

        try:
            return opt.run(argv[1:])
        except SystemExit as e:  # its argparse: --help (0) or bad arguments (2)
            return int(e.code or 0)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.command == "curve":
            return _curve(args)
        if args.command == "max-batch":
            return _max_batch(args)
        if args.command == "plan":
            return _plan(args)
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            return _train(args, argv)
        finally:
            torch.set_num_threads(threads)
    except UsageError as e:
        print(f"remat {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """``python -m remat`` and ``python -m remat.cli``: run :func:`main` on ``sys.argv`` and exit with its code."""
    code = main()
    if _torchrun_world():
        # A rank leaves without C++ static destructors: its work is done and its process group
        # destroyed, yet now and then (about 1 exit in 10 on a loaded 2-core machine) a thread is still
        # joinable at static destruction and the rank aborts ("terminate called without an active
        # exception", exit -6) with no Python frame left, failing the whole torchrun.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    run()
