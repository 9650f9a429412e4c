"""The main demo (``make demo``) in quick mode: it trains, reports, checks itself and exits 0;
and its fallback to the minimum feasible budget when the requested one is too small."""
from __future__ import annotations

import re

import torch

from remat import demo, zoo
from remat.errors import BudgetTooSmall


def test_quick_demo_trains_within_budget(capsys):
    code = demo.main(["--quick", "--steps", "3", "--budget", "70%", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    for section in ("1. Data and model", "2. Compile the training step under a budget of 70%", "3. Reference",
                    "4. Training", "5. Report", "6. Checks"):
        assert section in out
    assert "remat training step" in out and "solver" in out and "note:" not in out.split("== 3.")[0]
    assert out.count("[ok]") == 3 and "FAILED" not in out
    assert out.rstrip().splitlines()[-1].startswith("OK: trained a ")
    # The printed exact bytes: every step's measured peak within the 70% budget.
    m = re.search(r"measured peak over all 3 steps: .*?\(([\d,]+) B\); predicted .*?\(([\d,]+) B\)", out)
    budget = int(re.search(r"^budget\s.*\(([\d,]+) B\)", out, re.M).group(1).replace(",", ""))
    unconstrained = int(re.search(r"^unconstrained peak\s.*\(([\d,]+) B\)", out, re.M).group(1).replace(",", ""))
    measured, predicted = (int(g.replace(",", "")) for g in m.groups())
    assert measured <= budget == int(0.7 * unconstrained) and predicted <= budget
    # The unconstrained twin ran back to back with steps 2 and 3 and measured the full peak.
    ref = int(re.search(r"without a budget: .*?\(([\d,]+) B, measured\)", out).group(1).replace(",", ""))
    assert ref == unconstrained and "over 2 back-to-back pairs" in out


def test_compile_step_falls_back_to_the_minimum_and_says_why():
    model, example, loss_fn = zoo.make("mlp", "tiny")  # parameters dominate: 30% is infeasible
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lines: list[str] = []
    try:
        demo.compile_step(model, example, loss_fn, opt, "30%", fallback=False, write=lines.append)
    except BudgetTooSmall as e:
        minimum = int(e.minimum)
    else:
        raise AssertionError("30% of the tiny MLP's peak should be infeasible")
    step, note = demo.compile_step(model, example, loss_fn, opt, "30%", fallback=True, write=lines.append)
    assert step.budget >= minimum > 0.3 * step.unconstrained_peak
    assert note and "requested budget 30%" in note and "infeasible" in note
    assert any("planning" in ln for ln in lines)
    res = demo.train_loop(step, lambda i: example, 3, 1, write=lines.append, progress=False)
    assert max(res.peaks) <= step.budget and res.loss_decreased()


def test_loss_decreased_compares_the_tail_with_the_first_loss():
    assert demo.TrainResult(losses=[4.0, 3.0, 2.0]).loss_decreased()
    assert not demo.TrainResult(losses=[4.0, 5.0, 4.5]).loss_decreased()
    assert not demo.TrainResult(losses=[4.0]).loss_decreased()


def test_bad_arguments_exit_2(capsys):
    assert demo.main(["--budget", "forty"]) == 2
    assert "--budget" in capsys.readouterr().err
    assert demo.main(["--steps", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_corpus_batches_are_next_character_pairs():
    from remat.data import CharCorpus, load_corpus

    text = load_corpus()
    assert len(text) > 30_000 and text.isascii()
    corpus = CharCorpus(text)
    assert corpus.decode(corpus.encode(text[:500])) == text[:500]
    g = torch.Generator().manual_seed(0)
    x, y = corpus.batch(4, 32, g, "val")
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one character
    val_text = corpus.decode(corpus.splits["val"])
    assert all(corpus.decode(row) in val_text for row in x)  # held-out batches come from the held-out text
    assert len(corpus.splits["train"]) + len(corpus.splits["val"]) == len(text)
