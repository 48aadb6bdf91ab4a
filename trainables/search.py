"""Searchers for trainables whose objective arrives with the trial's final result, and the names
of their trials' directories.

A trainable reports ``train_loss``/``test_acc`` (and the mechanism's own training statistics)
after every epoch and every other metric (``acc_clean``, ``acc_<attack>_<size>``,
``cert_acc_<size>``, ``epsilon``, ...) once, in its last result (docs/metrics.md, "When each
metric is reported"). Ray's single-objective ``OptunaSearch`` hands every intermediate result to
Optuna (``result[metric]``), so a final-only objective raised ``KeyError`` inside Ray and failed
every trial. ``FinalMetricOptunaSearch`` skips the results that lack the objective; Optuna is
told the trial's value from the final result at completion. No pruner reads intermediate values
here, so nothing is lost.

With a searcher, Ray names a trial's directory after its whole config (``format_vars`` of every
key, sorted), so the constant ``_mlflow`` mapping (tracking URI, experiment and parent run ids)
came first and filled the name's 130 characters. ``trial_dirname`` (``tune.TuneConfig(
trial_dirname_creator=trial_dirname)``) names it after the trainable, the trial id and the values
the searcher drew for it, and nothing else.
"""

from __future__ import annotations

import re

from ray.tune.search.optuna import OptunaSearch

MAX_DIRNAME = 130   # Ray's own limit on the generated part of a trial directory name (TUNE_MAX_LEN_IDENTIFIER)


class FinalMetricOptunaSearch(OptunaSearch):
    """``OptunaSearch`` that reads a single objective only from the results that carry it (use it
    in place of ``OptunaSearch`` with a final metric such as ``acc_clean``)."""

    def on_trial_result(self, trial_id: str, result: dict):
        if isinstance(self.metric, str) and self.metric not in result:
            return
        super().on_trial_result(trial_id, result)


def _clean(value) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def trial_dirname(trial) -> str:
    """``<trainable>_<trial id>_<key>=<value>,...``: the values the searcher drew for this trial
    (``trial.evaluated_params``: Optuna's suggestions, a grid's resolved values) without the
    private entries (keys starting with ``_``, such as ``_mlflow``) or mappings; at most 130
    characters, never a ``/``."""
    drawn = [(str(k).rsplit("/", 1)[-1], v) for k, v in sorted((trial.evaluated_params or {}).items())
             if not any(part.startswith("_") for part in str(k).split("/")) and not isinstance(v, (dict, list))]
    name = f"{_clean(trial.trainable_name)}_{trial.trial_id}"
    if drawn:
        name += "_" + ",".join(f"{_clean(k)}={_clean(v)}" for k, v in drawn)
    return name[:MAX_DIRNAME]
