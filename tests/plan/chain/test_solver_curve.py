"""Trade-off curve (remat.plan.chain.curve) smoke/consistency tests."""

import csv
import math

from remat.plan.chain.costs import ChainCosts
from remat.plan.chain.curve import curve_main, tradeoff_curve


def test_curve_rows_and_files(tmp_path):
    c = ChainCosts.random(12, seed=4, max_bytes=300, extended=True)
    png, csv_path = curve_main(c, str(tmp_path), n_points=8, progress=False)
    assert (tmp_path / "curve.png").stat().st_size > 1000
    rows = list(csv.DictReader(open(csv_path)))
    assert {r["method"] for r in rows} == {"uniform", "precise", "extended", "sqrt"}
    by = {}
    for r in rows:
        by[(r["method"], float(r["budget"]))] = r
    for (m, b), r in by.items():
        if m == "precise" and r["feasible"] == "True":
            assert float(r["peak"]) <= b
            ext = by[("extended", b)]
            assert ext["feasible"] == "True" and float(ext["cost"]) <= float(r["cost"]) + 1e-9


def test_curve_monotone_precise():
    c = ChainCosts.random(15, seed=9, max_bytes=1000)
    rows = tradeoff_curve(c, range(3000, 20000, 1500), methods=("precise",), units=10**9, progress=False)
    costs = [r["cost"] for r in rows if not math.isnan(r["cost"])]
    assert costs and all(a >= b - 1e-9 for a, b in zip(costs, costs[1:]))
