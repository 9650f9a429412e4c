"""The buffer-reuse A/B benchmark (bench/buffer_reuse.py): a --quick run checked for structure and
for what it can check without timings: reuse writes over operands (and off, none), lowers or
keeps the unconstrained peak, and every
remat step's VM-measured peak equals its prediction with reuse on and off."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import buffer_reuse  # noqa: E402


def test_quick_run(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    try:
        doc = buffer_reuse.main(["--quick", "--models", "unet", "--budgets", "none,65%", "--rounds", "1",
                                 "--threads", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "buffer_reuse_quick.json").read_text()) == json.loads(json.dumps(doc))
    unconstrained, budgeted = doc["rows"]
    assert (unconstrained["budget"], budgeted["budget"]) == ("none", "65%")
    for row in doc["rows"]:
        assert row["status"] == "ok", row
        for k in ("reuse", "no reuse"):
            assert row[k]["measured_eq_predicted"], (row["budget"], k)
        assert row["reuse_over_no_reuse"] > 0
        assert row["reuse"]["reused_buffers"] > 0 == row["no reuse"]["reused_buffers"]
    assert unconstrained["reuse"]["predicted_peak"] <= unconstrained["no reuse"]["predicted_peak"]
    assert unconstrained["reuse"]["recomputed"] == unconstrained["no reuse"]["recomputed"] == 0
