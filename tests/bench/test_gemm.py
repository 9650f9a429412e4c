"""The GEMM benchmark (bench/gemm.py) on the zoo MLP, one round: checked for structure and for what
it can check without timings: the products it lists are the step's (their counts add up), the
checker's choice is recorded per product (never a transposed left operand), and with --steps the
two compiled steps really differ in their kernels (oneDNN products in one, none in the other)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gemm  # noqa: E402
from remat.backends import torch_kernels as tk  # noqa: E402


@pytest.mark.skipif(not tk._onednn_gemm_on(), reason="PyTorch without oneDNN here")
def test_one_round_on_the_mlp(tmp_path: Path) -> None:
    out = tmp_path / "gemm.json"
    rows = gemm.main(["--models", "mlp", "--rounds", "1", "--steps", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["rows"] == json.loads(json.dumps(rows))
    (row,) = doc["rows"]
    products = row["products"]
    # the zoo MLP small: 5 linears (4 hidden, the head), 5 weight gradients, 4 input gradients
    assert sum(p["count"] for p in products if p["op"] == "linear") == 5
    assert sum(p["count"] for p in products if p["op"] == "matmul") == 9
    chosen = [p for p in products if p["onednn_chosen"]]
    assert chosen and all(not p["transpose_a"] and p["macs"] >= tk.ONEDNN_MIN_MACS for p in chosen)
    assert all(p["macs"] < tk.ONEDNN_MIN_MACS or p["transpose_a"] for p in products if not p["onednn_chosen"])
    assert row["onednn_kernels"]["mkl"] == 0
    assert row["onednn_kernels"]["chosen"] == sum(p["count"] for p in chosen)
    assert row["step_x_mkl"] > 0 and row["step_gemm_x_mkl"]["mkl"] == 1.0
