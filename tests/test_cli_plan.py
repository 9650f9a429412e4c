"""``remat plan``: a transformers config planned on meta for a device (nothing run)."""
from __future__ import annotations

import json

import pytest

from remat.cli import main

CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def test_plan_prints_the_report_and_curve(config, tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--config", str(config), "--seq", "64", "--device", "l4-24gb", "--budget", "75%",
                 "--solver", "greedy", "--curve", "--points", "3", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "dry run" in text and "minimum feasible budget" in text and "budget curve" in text
    data = json.loads(out.read_text())
    assert data["device"] == "l4-24gb" and data["minimum_budget"] <= data["predicted_peak"] <= data["budget"]
    assert len(data["curve"]) == 3 and data["memory"]["optimizer state"] > 0


def test_plan_refuses_a_budget_below_the_minimum(config, capsys):
    assert main(["plan", "--config", str(config), "--seq", "64", "--budget", "1KiB", "--solver", "greedy"]) == 2
    assert "minimum feasible budget" in capsys.readouterr().err


def test_plan_names_the_valid_devices(config, capsys):
    assert main(["plan", "--config", str(config), "--device", "tpu"]) == 2
    assert "h100-80gb" in capsys.readouterr().err
