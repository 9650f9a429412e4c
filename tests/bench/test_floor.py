"""The floor benchmark (bench/floor.py): ``--merge`` keeps the parts it does not run from the existing
results file and records each part's revision; the targets are judged on the merged parts.
(The parts themselves compile GPT medium many times: minutes, so they are not run here.)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import floor  # noqa: E402


def _gpt_part(fraction: float, ratio: float) -> dict:
    return {"minimum": {"fraction": fraction, "measured_eq_predicted": True},
            "at_25": {"feasible": True, "time_ratio_median": ratio}}


def test_merge_keeps_the_parts_not_run(tmp_path: Path) -> None:
    old = {"gpt": _gpt_part(0.35, 0.0), "gpt_sgd": _gpt_part(0.21, 1.3),
           "config": {"measured_at": {"gpt_sgd": "abc1234"}}, "targets": []}
    (tmp_path / "floor.json").write_text(json.dumps(old))
    res = floor.main(["--parts", "", "--merge", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "floor.json").read_text())
    assert written["gpt"] == old["gpt"] and written["gpt_sgd"] == old["gpt_sgd"]
    at = written["config"]["measured_at"]
    assert at["gpt_sgd"] == "abc1234"            # recorded by the run that measured it
    assert at["gpt"].startswith("before ")      # older file: the commit that wrote it (or unknown)
    met = {t["target"]: t["met"] for t in res["targets"]}
    assert met["GPT medium with SGD: minimum feasible budget <= 25% of the unconstrained peak"] is True
    assert met["GPT medium: minimum feasible budget <= 25% of the unconstrained peak"] is False


def test_without_merge_the_file_holds_only_the_parts_run(tmp_path: Path) -> None:
    (tmp_path / "floor.json").write_text(json.dumps({"gpt": _gpt_part(0.35, 0.0)}))
    floor.main(["--parts", "", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "floor.json").read_text())
    assert "gpt" not in written and written["config"]["measured_at"] == {}
