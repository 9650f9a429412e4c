"""The ``remat`` command line, run in-process: train, curve, opt, and its error paths (exit code 2)."""
from __future__ import annotations

import csv
import re
import subprocess
import sys

import pytest

from remat.cli import main

IR = """func @f(%x: f32[4, 8], %y: f32[4, 8]) -> (f32[4, 8]) {
  %a = add %x, %y : f32[4, 8]
  %b = add %x, %y : f32[4, 8]
  %c = mul %a, %b : f32[4, 8]
  return %c
}
"""


def _bytes(text: str, label: str) -> int:
    """The exact byte count printed in the report row ``label``: '... (1,234 B)'."""
    m = re.search(rf"^{re.escape(label)}\s.*\(([\d,]+) B\)", text, re.M)
    assert m, f"no {label!r} row in:\n{text}"
    return int(m.group(1).replace(",", ""))


def test_train_gpt_tiny_within_budget(capsys):
    code = main(["train", "--model", "gpt", "--size", "tiny", "--steps", "3", "--batch-size", "8", "--budget", "75%",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "on the shipped corpus" in out and "remat training step" in out and out.rstrip().splitlines()[-1].startswith("OK:")
    budget, measured, unconstrained = (_bytes(out, k) for k in ("budget", "measured peak (last step)", "unconstrained peak"))
    assert measured <= budget == int(0.75 * unconstrained)
    losses = [float(x) for x in re.findall(r"step \d+/3 +loss ([\d.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_train_without_a_budget_trains_at_the_default_or_the_minimum(capsys):
    code = main(["train", "--steps", "2", "--no-progress"])  # tiny GPT with AdamW: its minimum is above 40%
    out = capsys.readouterr().out
    assert code == 0, out
    assert "note: the requested budget 40%" in out and out.rstrip().splitlines()[-1].startswith("OK:")


def test_train_budget_below_minimum_fails_with_the_minimum(capsys):
    code = main(["train", "--model", "mlp", "--steps", "2", "--budget", "1000", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    m = re.search(r"give a budget >= (\d+) bytes", err)
    assert m and int(m.group(1)) > 1000 and f"--budget {m.group(1)}" in err


def test_train_fit_minimum_with_sgd_and_batch_size_in_bf16(capsys):
    code = main(["train", "--model", "mlp", "--steps", "3", "--budget", "10%", "--fit-minimum", "--optimizer", "sgd",
                 "--batch-size", "16", "--precision", "bf16", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fixed synthetic batch of 16" in out and "note: the requested budget 10%" in out and "is infeasible" in out
    assert "; bf16; 3 steps" in out and re.search(r"^precision\s+bf16", out, re.M), out
    assert _bytes(out, "measured peak (last step)") <= _bytes(out, "budget")


def test_curve_random_chain_writes_png_and_csv(tmp_path, capsys):
    code = main(["curve", "--random", "8", "--out", str(tmp_path), "--points", "6", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    png, csv_path = tmp_path / "curve.png", tmp_path / "curve.csv"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(csv_path.open()))
    assert {r["method"] for r in rows} == {"uniform", "precise", "extended", "sqrt"}
    assert len(rows) == 4 * len({r["budget"] for r in rows}) and len(rows) >= 4 * 5
    # The optimal DP never costs more than the uniform baseline where both fit the budget.
    by = {(r["method"], r["budget"]): r for r in rows}
    for (m, b), r in by.items():
        u = by[("uniform", b)]
        if m == "precise" and r["feasible"] == "True" and u["feasible"] == "True":
            assert float(r["cost"]) <= float(u["cost"]) + 1e-9
    assert "random heterogeneous chain, N=8" in out and str(png) in out


def test_curve_profiles_the_mlp_chain(tmp_path, capsys):
    code = main(["curve", "--chain", "--model", "mlp", "--size", "tiny", "--out", str(tmp_path), "--points", "4",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "MLP, 5 stages" in out and (tmp_path / "curve.png").exists()


def test_curve_sweeps_a_models_training_step(tmp_path, capsys):
    code = main(["curve", "--model", "unet", "--size", "tiny", "--out", str(tmp_path), "--points", "3",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    with open(tmp_path / "curve.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3 and (tmp_path / "curve.png").exists() and rows[-1]["solver"] == "none"
    for r in rows:
        assert int(r["measured_peak"]) == int(r["predicted_peak"]) <= int(r["budget"])
    assert "0 rise(s) of the predicted overhead" in out


def test_opt_delegates_to_the_ir_driver(tmp_path, capsys):
    f = tmp_path / "m.ir"
    f.write_text(IR)
    assert main(["opt", str(f), "--passes", "cse"]) == 0
    out = capsys.readouterr().out
    assert out.count("add ") == 1 and "mul " in out
    assert main(["opt", str(f), "--passes", "no-such-pass"]) == 2
    assert "no-such-pass" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["train", "--model", "bert"], "invalid choice: 'bert'"),
    (["train", "--budget", "40 apples"], "memory budget '40 apples' is not valid"),
    (["train", "--budget", "140%"], "must be in (0, 1]"),
    (["train", "--steps", "0"], "positive whole number"),
    (["train", "--data-parallel", "zero2"], "needs several ranks: pass --nproc 2"),
    (["train", "--data-parallel", "zero3"], "invalid choice: 'zero3'"),
    (["curve", "--chain", "--model", "resnet"], "chain of stateless layers"),
    (["curve", "--model", "gpt", "--depth", "3"], "--depth sizes the --chain mlp"),
    (["curve", "--random", "5", "--model", "gpt"], "either --random N or --model"),
    ([], "required: <command>"),
    (["fly"], "invalid choice: 'fly'"),
])
def test_usage_errors_exit_2_with_a_message(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("train", "curve", "opt"))


def test_python_dash_m_remat_is_the_command():
    r = subprocess.run([sys.executable, "-m", "remat", "train", "--budget", "lots"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "usage: remat train" in r.stderr and "'lots' is not valid" in r.stderr


def test_train_two_ranks_with_torchrun(capfd):
    """``--nproc 2`` launches 2 ranks with torchrun; each trains its half of every batch (the loss
    printed is the whole batch's) and rank 0 reports its bytes by kind."""
    code = main(["train", "--model", "mlp", "--nproc", "2", "--data-parallel", "zero1", "--steps", "2",
                 "--batch-size", "16", "--budget", "none", "--no-progress"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "launching 2 ranks with torchrun" in out and "2 ranks (zero1), 8 examples each" in out
    assert re.search(r"^data parallel\s+zero1 \(bytes are per rank\)", out, re.M)
    assert _bytes(out, "at peak: optimizer state") > 0
    assert out.count("remat training step") == 1 and out.rstrip().splitlines()[-1].startswith("OK:")
    assert _bytes(out, "measured peak (last step)") == _bytes(out, "predicted peak")


def test_max_batch_next_to_eager(capsys):
    code = main(["max-batch", "--model", "mlp", "--size", "tiny", "--budget", "120000", "--limit", "64",
                 "--optimizer", "adamw", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    remat_n = int(re.search(r"^remat: largest batch (\d+) ", out, re.M).group(1))
    eager_n = int(re.search(r"^eager PyTorch: largest batch (\d+) ", out, re.M).group(1))
    assert remat_n > eager_n >= 0  # eager AdamW's foreach temporaries alone exceed 120 kB at batch 1
    assert out.rstrip().splitlines()[-1].startswith("OK: one step at batch")


def test_max_batch_refuses_a_relative_budget(capsys):
    for relative in ("40%", "0.5", "1.0"):  # a fraction in any spelling, before any work
        assert main(["max-batch", "--model", "mlp", "--budget", relative]) == 2
        assert "needs an absolute budget" in capsys.readouterr().err
