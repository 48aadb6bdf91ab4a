"""The report's audit table states the level of each lower bound (issue 18, point 10)."""

from types import SimpleNamespace

import pandas as pd

from sweeps.report.page import _privacy_section
from sweeps.report.data import Sweep


def _sweep(trials: pd.DataFrame) -> Sweep:
    parent = SimpleNamespace(data=SimpleNamespace(metrics={}, tags={}, params={}))
    return Sweep(client=None, experiment="e", tracking_uri="sqlite://", parent=parent, trials=trials)


def test_audit_table_says_each_bound_is_at_its_own_trials_level():
    trials = pd.DataFrame([
        {"run": "a", "trainable": "dpsgd", "epsilon": 2.0, "epsilon_lower_bound": 0.4},
        {"run": "b", "trainable": "dpsgd", "epsilon": 1.0, "epsilon_lower_bound": 1.5},
    ])
    text = "\n".join(_privacy_section(_sweep(trials)))
    assert "### Empirical privacy audits" in text
    assert "not corrected for the 2 trials audited here" in text and "0.05 / k" in text
    # the inconsistent trial is flagged, the consistent one is not
    assert text.count("**NO**") == 1
