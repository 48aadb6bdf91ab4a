"""What a study reads and runs (issue 34, points 10, 11, 12): ``--dry-run`` puts the swept keys
first and hides unchanged defaults (``--all`` shows everything); ``trials_aggregated.csv`` spells
booleans like ``trials.csv``; counts read as a person writes them; the README's own-Tuner recipe
starts a Ray of its own; with Optuna the ``_mlflow`` mapping stays out of Ray's trial directory
names; dpmech used directly drops dp-accounting's convergence warnings as the CLI does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ point 12: dpmech alone

_LEDGER = ("from dpmech import PrivacyLedger\n"
           "ledger = PrivacyLedger()\n"
           "ledger.record(0.1, 1.0, 50)\n"
           "print('epsilon', ledger.epsilon(1e-5))\n"
           "import logging; logging.getLogger('absl').warning('another absl warning')\n")


def _stderr(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "epsilon" in proc.stdout
    return proc.stderr


def test_dpmech_used_directly_drops_the_convergence_warnings():
    # negative control: the same ledger with the filter taken off again warns for several orders
    loud = _stderr("import logging\nimport dpmech.privacy.accounting\n"
                   "logging.getLogger('absl').filters.clear()\n" + _LEDGER)
    assert loud.count("_compute_log_a_frac failed to converge") >= 3
    quiet = _stderr(_LEDGER)
    assert "failed to converge" not in quiet
    assert "another absl warning" in quiet          # only that message is dropped
    assert "import ray" not in _LEDGER and "trainables" not in _LEDGER
