"""benchmarks/audit_mnist.py's generated docs/audit.md tables: targets marked met or missed from
the measured means, each seed's values shown, and a missing acc_without said plainly."""

from __future__ import annotations

from benchmarks import audit_mnist as bench


def _seed(fdp, steinke, acc, without):
    return {"fdp_lb": fdp, "steinke_lb": steinke, "acc_with_canaries": acc, "acc_without": without}


def _unit(fdp, steinke, seeds, without=0.98, cost=None):
    e = {"claim": 3.0, "fdp_lb": fdp, "steinke_lb": steinke, "gdp_estimate": 2.5, "noise_multiplier": 1.126,
         "recipe": {"epochs": 40}, "real_coordinates": {"fdp": 1.0, "steinke": 0.8}, "seeds": seeds,
         "acc_with_canaries": 0.981, "acc_without": without, "targets": {"fdp_lb": 1.5, "steinke_lb": 1.2},
         "met": {"fdp_lb": fdp >= 1.5, "steinke_lb": steinke >= 1.2}}
    if cost is not None:
        e["acc_cost"] = cost
    return e


def test_whitebox_table_marks_targets_and_lists_seeds():
    seeds = {"0": _seed(1.4, 1.3, 0.981, 0.98), "1": _seed(1.5, 1.2, 0.982, 0.979)}
    payload = {"whitebox": {"eps_3": _unit(1.45, 1.25, seeds, cost=0.004)},
               "whitebox_ceiling": {"eps_3": {"fdp_lb": 1.9, "steinke_lb": 1.6}}}
    table = bench.doc_tables(payload)["audit_mnist_whitebox"]
    row = next(line for line in table.splitlines() if line.startswith("| eps_3"))
    assert "**1.45** (>= 1.5: missed)" in row and "**1.25** (>= 1.2: met)" in row
    assert "0: 1.40 / 1.30; 1: 1.50 / 1.20" in row and "1.90 / 1.60" in row
    assert "+0.40 points" in table and "missed" in table.splitlines()[-1]


def test_whitebox_table_says_when_acc_without_was_not_measured():
    seeds = {"0": _seed(4.5, 3.2, 0.984, None)}
    table = bench.doc_tables({"whitebox": {"eps_8": _unit(4.5, 3.2, seeds, without=None)}})["audit_mnist_whitebox"]
    assert "not measured" in table
