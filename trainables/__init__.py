"""Ray Tune function trainables: config -> dpmech -> ``ray.tune.report`` + MLflow.

Importing any trainable (this package) in the Tune driver also:

* sets ``TUNE_DISABLE_STRICT_METRIC_CHECKING=1`` unless it is set: each trial's per-epoch results
  carry ``train_loss``/``test_acc`` only and its final result every metric (docs/metrics.md), so
  ``tune.TuneConfig(metric="acc_clean")`` would otherwise stop the sweep at the first epoch's
  result (Ray checks every result for the metric). Ray reads the variable when it checks a
  result, so the import can come any time before ``Tuner.fit``. Best results are read from the
  final result (``results.get_best_result(metric="acc_clean", mode="max")``, scope ``last``).
* drops dp-accounting's ``_compute_log_a_frac failed to converge`` warnings (``quiet_accounting_logs``):
  the RDP accountant logs one per fractional order it cannot evaluate, excludes that order and
  still returns a valid epsilon; the lines said nothing a user can act on and buried the useful ones.
  The filter lives in ``dpmech.privacy.quiet``; dpmech installs it too, when its accounting is imported.

``FinalMetricOptunaSearch`` (``trainables.search``): ``OptunaSearch`` for final-only metrics.
"""

from __future__ import annotations

import os

from dpmech.privacy.quiet import quiet_accounting_logs

__all__ = ["FinalMetricOptunaSearch", "quiet_accounting_logs"]

os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")


quiet_accounting_logs()


def __getattr__(name: str):
    if name == "FinalMetricOptunaSearch":  # imports Optuna: only when asked for
        from trainables.search import FinalMetricOptunaSearch

        return FinalMetricOptunaSearch
    raise AttributeError(f"module 'trainables' has no attribute {name!r}")
