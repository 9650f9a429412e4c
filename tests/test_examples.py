"""The examples run as their docstrings say (``finetune_lora_trainer.py`` has its own test in
``tests/integrations``)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sequential_checkpointer_runs_each_policy_at_its_predicted_peak(capsys):
    _load("sequential_checkpointer").main()
    rows = re.findall(r"budget +([\d,]+) B +(\w+) +predicted +([\d,]+) B +measured +([\d,]+) B", capsys.readouterr().out)
    assert len(rows) == 6
    for budget, _, predicted, measured in rows:
        assert predicted == measured and int(measured.replace(",", "")) <= int(budget.replace(",", ""))
