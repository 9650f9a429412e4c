"""``examples/finetune_lora_trainer.py --quick`` runs: both loops train within their budgets."""
import importlib.util
import pathlib

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "finetune_lora_trainer.py"


def test_finetune_lora_example_quick(capsys):
    spec = importlib.util.spec_from_file_location("finetune_lora_trainer", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(["--quick", "--budget", "95%"])
    assert len(out["trainer_losses"]) == len(out["loop_losses"]) == 4
    for r in (out["trainer_report"], out["loop_report"]):
        assert r.measured_peak == r.predicted_peak <= r.budget
    printed = capsys.readouterr().out
    assert "RematTrainer losses:" in printed and "plain loop losses:" in printed
