"""Under tuning_privacy, search.metric must be computed without the private training data
(issue 25): Papernot & Steinke's theorem covers selecting among private trials by a function of
their outputs, not by noise-free statistics of the training set (not_learned is a function of
train_loss)."""

from __future__ import annotations

import pytest

from sweeps.spec import SpecError, validate_spec
from sweeps.spec.tuning import private_selection_metric
from tests.test_tuning_spec import raw, stand_in  # noqa: F401  (stand_in: the DP stand-in trainable)


@pytest.mark.parametrize("metric", ["train_loss", "train_acc", "not_learned", "batch_size_mean",
                                    "clipped_fraction", "wasserstein"])
def test_training_data_metrics_are_refused(metric):
    with pytest.raises(SpecError) as info:
        validate_spec(raw(**{"search.metric": metric}))
    msg = str(info.value)
    assert msg.startswith(f"search.metric: {metric} is computed on the private training data"), msg
    assert "\n" not in msg


@pytest.mark.parametrize("metric", ["acc_clean", "cert_acc_0.5"])
def test_held_out_metrics_are_accepted(metric):
    spec = validate_spec(raw(**{"search.metric": metric}))
    assert spec.search.metric == metric


@pytest.mark.parametrize("metric, ok", [("test_acc", True), ("acc_pgd_0.2", True), ("tstr_acc", True),
                                        ("sample_quality", True), ("train_loss", False), ("not_learned", False),
                                        ("epsilon_lower_bound", False)])
def test_the_rule_itself(metric, ok):
    """(The stand-in trainable reports only some metrics; the rule is checked on its own here.)"""
    assert private_selection_metric(metric) is ok
