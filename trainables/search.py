"""Searchers for trainables whose objective arrives with the trial's final result.

A trainable reports ``train_loss``/``test_acc`` (and the mechanism's own training statistics)
after every epoch and every other metric (``acc_clean``, ``acc_<attack>_<size>``,
``cert_acc_<size>``, ``epsilon``, ...) once, in its last result (docs/metrics.md, "When each
metric is reported"). Ray's single-objective ``OptunaSearch`` hands every intermediate result to
Optuna (``result[metric]``), so a final-only objective raised ``KeyError`` inside Ray and failed
every trial. ``FinalMetricOptunaSearch`` skips the results that lack the objective; Optuna is
told the trial's value from the final result at completion. No pruner reads intermediate values
here, so nothing is lost.
"""

from __future__ import annotations

from ray.tune.search.optuna import OptunaSearch


class FinalMetricOptunaSearch(OptunaSearch):
    """``OptunaSearch`` that reads a single objective only from the results that carry it (use it
    in place of ``OptunaSearch`` with a final metric such as ``acc_clean``)."""

    def on_trial_result(self, trial_id: str, result: dict):
        if isinstance(self.metric, str) and self.metric not in result:
            return
        super().on_trial_result(trial_id, result)
