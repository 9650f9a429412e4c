"""Setup time of ``remat.compile`` (issue 8, "≤ 3 s on the second compile"; issue 14's stage split):
the first compile, a second one of the same model in the same process, and one in a fresh process
with remat's on-disk caches warm, each with its stages (``report().stage_seconds``).

Model: ``zoo.make("gpt", "medium")`` (the issue's "GPT medium", as ``bench/speed.py`` runs it: no
optimizer, ``budget=None``, static cost model); ``--model gpt16`` takes ``zoo.GPT(64, 32, 16, 2, 64)``
at batch 16 (``bench/plan_scale.py``'s 16-layer model) instead.

Every compile runs in a subprocess with its own ``$REMAT_CACHE_DIR`` (a fresh folder of this run):

* ``first``: empty caches (the capture, Numba kernels and workspaces all made), then a second
  ``remat.compile`` of the same model in that process (``second_in_process``);
* then ``--rounds`` rounds (default 3) alternate, in turn, a fresh process with the caches warm
  (``fresh_cached``) and one with the capture cache off (``fresh_uncached``: ``REMAT_CAPTURE_CACHE=0``,
  Numba kernels still cached, as before the capture cache existed), so both see the same load.

Python's bytecode cache is on in the subprocesses (``PYTHONPYCACHEPREFIX`` in the run's folder), as
for an installed package, also where the environment sets ``PYTHONDONTWRITEBYTECODE``.
Times are wall seconds of ``remat.compile`` alone (imports of torch and remat are timed separately:
``import_s``); medians over rounds, the ratio of the medians. Targets are reported, never asserted.

Run:  PYTHONPATH=src .venv/bin/python bench/setup_time.py [--rounds 3] [--model gpt-medium|gpt16] [--out DIR]
Writes bench/results/setup_time.json (setup_time_gpt16.json for gpt16) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from _measure import machine  # noqa: E402  (bench/ is on the path: run as a script)

SRC = Path(__file__).resolve().parents[1] / "src"
TARGET_SECOND_S = 3.0

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import remat
from remat import zoo
compile_ = remat.compile  # remat.train: imported on first use
import_s = time.perf_counter() - t0
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
if spec["model"] == "gpt16":
    torch.manual_seed(0)
    model = zoo.GPT(64, 32, 16, 2, 64)
    inputs, loss_fn = (torch.randint(0, 64, (16, 32)), torch.randint(0, 64, (16, 32))), zoo.lm_loss
else:
    model, inputs, loss_fn = zoo.make("gpt", "medium")
model.train()
out = {"import_s": import_s, "compiles": []}
for _ in range(spec["compiles"]):
    t = time.perf_counter()
    step = compile_(model, inputs, loss_fn, optimizer=None, budget=None)
    wall = time.perf_counter() - t
    rep = step.report()
    out["compiles"].append({"setup_s": wall, "stage_seconds": rep.stage_seconds, "capture_cached": rep.capture_cached,
                            "instructions": rep.instructions})
print(json.dumps(out))
"""


def child(model: str, cache_dir: str, compiles: int, capture_cache: bool, threads: int) -> dict:
    """One fresh process: ``compiles`` compiles of the model; its JSON line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["REMAT_CACHE_DIR"] = cache_dir
    env["REMAT_CAPTURE_CACHE"] = "1" if capture_cache else "0"
    env.pop("REMAT_VERIFY_EACH_PASS", None)
    # Python's bytecode cache, as an installed package has it (this machine sets PYTHONDONTWRITEBYTECODE,
    # which recompiles every module of remat in every process): kept in the run's cache folder.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(cache_dir, "pycache")
    p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps({"model": model, "compiles": compiles,
                                                                   "threads": threads})],
                       capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"compile subprocess failed (exit {p.returncode}): {p.stderr.strip()[-800:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def median_stages(runs: list[dict]) -> dict[str, float]:
    """Per stage, the median seconds over runs."""
    names = list(dict.fromkeys(k for r in runs for k in r["stage_seconds"]))
    return {k: statistics.median(r["stage_seconds"].get(k, 0.0) for r in runs) for k in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("gpt-medium", "gpt16"), default="gpt-medium")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="remat-setup-") as cache:
        first = child(args.model, cache, 2, True, args.threads)
        print(f"first compile (empty caches) {first['compiles'][0]['setup_s']:.2f} s, second in the same process "
              f"{first['compiles'][1]['setup_s']:.2f} s", flush=True)
        cached, uncached = [], []
        for r in range(args.rounds):
            for kind in (("cached", "uncached") if r % 2 == 0 else ("uncached", "cached")):
                run = child(args.model, cache, 1, kind == "cached", args.threads)
                (cached if kind == "cached" else uncached).append({"import_s": run["import_s"], **run["compiles"][0]})
                print(f"round {r}: fresh process, capture cache {'on ' if kind == 'cached' else 'off'} "
                      f"{run['compiles'][0]['setup_s']:.2f} s (imports {run['import_s']:.2f} s)", flush=True)
    med = {k: statistics.median(x["setup_s"] for x in runs) for k, runs in (("cached", cached), ("uncached", uncached))}
    res = {
        "config": {"model": args.model, "rounds": args.rounds, "threads": args.threads, "optimizer": None,
                   "budget": None, "cost_model": "static", "bytecode_cache": "on (PYTHONPYCACHEPREFIX in the run's folder)",
                   "wall_s": time.perf_counter() - t0},
        "machine": {**machine(), "load_avg": os.getloadavg()},
        "first": first["compiles"][0], "second_in_process": first["compiles"][1], "first_import_s": first["import_s"],
        "fresh_cached": {"median_s": med["cached"], "stages": median_stages(cached), "runs": cached,
                         "import_median_s": statistics.median(x["import_s"] for x in cached)},
        "fresh_uncached": {"median_s": med["uncached"], "stages": median_stages(uncached), "runs": uncached,
                           "import_median_s": statistics.median(x["import_s"] for x in uncached)},
        "cached_over_uncached": med["cached"] / med["uncached"],
        "targets": [{"target": f"second compile in a fresh process <= {TARGET_SECOND_S:g} s", "value": med["cached"],
                     "met": med["cached"] <= TARGET_SECOND_S},
                    {"target": f"second compile in the same process <= {TARGET_SECOND_S:g} s",
                     "value": first["compiles"][1]["setup_s"], "met": first["compiles"][1]["setup_s"] <= TARGET_SECOND_S}],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("setup_time.json" if args.model == "gpt-medium" else f"setup_time_{args.model}.json")
    path.write_text(json.dumps(res, indent=1))

    def stages(st: dict) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in st.items() if v >= 0.005)

    print(f"\n{args.model}: remat.compile wall seconds (medians over {args.rounds} rounds; load {os.getloadavg()[0]:.1f})")
    print(f"  first (empty caches)      {first['compiles'][0]['setup_s']:6.2f}  {stages(first['compiles'][0]['stage_seconds'])}")
    print(f"  second, same process      {first['compiles'][1]['setup_s']:6.2f}  {stages(first['compiles'][1]['stage_seconds'])}")
    print(f"  fresh process, cached     {med['cached']:6.2f}  {stages(res['fresh_cached']['stages'])}")
    print(f"  fresh process, uncached   {med['uncached']:6.2f}  {stages(res['fresh_uncached']['stages'])}")
    print(f"  cached / uncached         {res['cached_over_uncached']:6.2f}")
    for t in res["targets"]:
        print(f"  {'PASS' if t['met'] else 'FAIL'}  {t['target']}: {t['value']:.2f} s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
