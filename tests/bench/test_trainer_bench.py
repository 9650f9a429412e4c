"""The Trainer-recipe benchmark (bench/trainer.py): a --quick run on tiny GPT-2 checked for structure and
internal consistency (never for timings), its arguments, and its target on hand-made rows."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import trainer as tb  # noqa: E402


def test_parse_args_defaults_and_validation() -> None:
    a = tb.parse_args([])
    assert (a.rounds, a.steps, a.models, a.budgets) == (5, 5, ["llama", "gemma3", "gpt2", "llama-lora"],
                                                         ("90%", "80%", "70%", "60%", "50%", "40%"))
    a = tb.parse_args(["--quick", "--models", "gpt2", "--budgets", "80%,50%"])
    assert (a.rounds, a.steps, a.models, a.budgets) == (2, 2, ["gpt2"], ("80%", "50%"))
    for bad in (["--models", "bert"], ["--budgets", "0.5"], ["--rounds", "0"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            tb.parse_args(bad)


def test_target_on_hand_made_rows() -> None:
    rows = [tb.Row("a", "eager"), tb.Row("a", "checkpointing"),
            tb.Row("a", "remat@60%", budget="60%", x_checkpointing=0.85, peak_le_checkpointing=True),
            tb.Row("b", "eager"), tb.Row("b", "checkpointing"),
            tb.Row("b", "remat@40%", budget="40%", x_checkpointing=0.85, peak_le_checkpointing=False),
            tb.Row("c", "eager"), tb.Row("c", "checkpointing", status="error")]
    met = {c["model"]: c["met"] for c in tb.targets(rows)}
    assert met == {"a": True, "b": False, "c": None}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One real --quick run on tiny GPT-2: eager, checkpointing and RematTrainer (two candidate budgets)."""
    out = tmp_path_factory.mktemp("trainer")
    threads = torch.get_num_threads()
    try:
        tb.main(["--quick", "--models", "gpt2", "--budgets", "90%,50%", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "trainer_quick.json").read_text()), out


def test_quick_run_fields(quick_run: tuple[dict, Path]) -> None:
    doc, out = quick_run
    assert doc["config"]["quick"] and doc["config"]["models"] == ["gpt2"] and doc["config"]["rounds"] == 2
    rows = {r["method"]: r for r in doc["rows"]}
    remat = [m for m in rows if m.startswith("remat@")]
    assert list(rows)[:2] == ["eager", "checkpointing"] and len(remat) == 1
    r = rows[remat[0]]
    assert r["budget"] in ("90%", "50%") and r["budget_bytes"] > 0
    for row in rows.values():
        assert row["status"] == "ok", row["error"]
        assert row["peak_bytes"] >= row["resident_bytes"] > 0
        assert row["rounds"] == 2 and len(row["extra"]["step_s_rounds"]) == 2 and row["step_s"] > 0
        assert row["x_eager"] > 0 and row["x_checkpointing"] > 0 and row["peak_x_eager"] > 0
        assert row["loss_rel_diff"] < 1e-3  # every method trains the same model on the same data
    assert rows["eager"]["x_eager"] == rows["checkpointing"]["x_checkpointing"] == 1.0
    # the search keeps the first candidate that fits under checkpointing's peak, or the last that compiled
    search = r["extra"]["budget_search"]
    assert [s["budget"] for s in search] == ["90%", "50%"][:len(search)]
    assert r["peak_le_checkpointing"] == (r["peak_bytes"] <= rows["checkpointing"]["peak_bytes"])
    if r["peak_le_checkpointing"]:
        assert search[-1]["fits"] and all(not s.get("fits") for s in search[:-1])
    (c,) = doc["comparisons"]
    assert c["model"] == "gpt2" and c["budget"] == r["budget"] and c["value"] == r["x_checkpointing"]
    assert c["met"] == (r["peak_le_checkpointing"] and r["x_checkpointing"] <= tb.TARGET_TIME)
    with (out / "trainer_quick.csv").open() as f:
        assert [row["method"] for row in csv.DictReader(f)] == list(rows)
