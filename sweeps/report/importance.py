"""Which swept key matters (issue 34, point 3): the importance of each swept key for the search
metric over the sweep's finished trials, by Optuna's fANOVA evaluator
(``optuna.importance.FanovaImportanceEvaluator``; Hutter, Hoos & Leyton-Brown, ICML 2014: the share
of the metric's variance, over the space the trials cover, that each key's main effect explains, from
a random forest fitted to the trials).

Optuna's evaluators take a study; any set of finished trials can be one: each trial is added with
``optuna.trial.create_trial`` (its swept values and its metric), whatever searcher ran it (grid,
random or Optuna). A swept key's distribution is the range its trials cover (log-scaled when its
values are positive and span more than a factor of 10) or, for a non-numeric key, its categories.
Seeds and repeat indices are not swept keys (``data.config_columns``). With few trials the forest
has little to fit: the section says over how many trials the importances were computed.
"""

from __future__ import annotations

import math

from sweeps.report.data import finished, key_name, nonprivate_mask, private_only, varying_columns
from sweeps.words import counted

MIN_TRIALS = 4   # below this the forest has nothing to fit: no importances


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def parameter_importances(trials, metric: str, mode: str = "max", seed: int = 0, *,
                          private: bool = True) -> tuple[dict[str, float], int]:
    """({swept key: importance}, trials used), importances summing to 1, most important first;
    ({}, n) with fewer than ``MIN_TRIALS`` finished trials with a finite metric or no swept key.
    ``private``: over the private trials only when the sweep has some (issue 51.3: a non-private
    baseline adds an epsilon and a clipping norm it does not use, confounding both)."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    df = finished(trials)
    if private and not df.empty:
        own = private_only(df)
        df = own if len(own) else df
    if df.empty or metric not in df:
        return {}, 0
    df = df[df[metric].map(_number)]
    keys = [c for c in varying_columns(df) if c != "sweep"] if len(df) else []
    if len(df) < MIN_TRIALS or not keys:
        return {}, len(df)
    dists = {}
    for c in keys:
        values = list(df[c])
        if all(_number(v) for v in values):
            lo, hi = float(min(values)), float(max(values))
            dists[c] = FloatDistribution(lo, hi, log=bool(lo > 0 and hi / lo > 10))
        else:
            dists[c] = CategoricalDistribution(sorted({str(v) for v in values}))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize" if mode == "max" else "minimize")
    for row in df.to_dict("records"):
        params = {key_name(c): (float(row[c]) if isinstance(dists[c], FloatDistribution) else str(row[c]))
                  for c in keys}
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={key_name(c): d for c, d in dists.items()}, value=float(row[metric])))
    out = get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=seed), normalize=True)
    return {k: float(v) for k, v in out.items()}, len(df)


def importance_section(sweep) -> list[str]:
    """The report's section (empty without a single ``search.metric`` or with nothing to rank)."""
    params = dict(sweep.parent.data.params)
    metric, mode = params.get("search.metric"), params.get("search.mode") or "max"
    if metric in (None, "", "null"):
        return []
    try:
        imp, n = parameter_importances(sweep.trials, metric, mode)
    except Exception as exc:  # noqa: BLE001 - a figure of speech, not the sweep's result: say why it is missing
        return ["## Which swept key matters", "", f"Parameter importances could not be computed: {exc}.", ""]
    if not imp:
        return []
    rows = [f"| `{k}` | {v:.2f} |" for k, v in imp.items()]
    fin = finished(sweep.trials)
    base = int(nonprivate_mask(fin).sum()) if not fin.empty else 0
    which = "finished trials"
    if base and base < len(fin):
        which = (f"finished private trials (the {counted(base, 'non-private baseline trial')} left out: the keys that "
                 "do not apply to a non-private trial are missing there, not values)")
    top = [k for k, v in imp.items() if v >= 0.1][:3] or list(imp)[:1]
    return ["## Which swept key matters", "",
            f"Importance of each swept key for `{metric}` (`search.metric`) over the {n} {which}: Optuna's "
            "fANOVA evaluator (the share of the metric's variance each key's main effect explains; they sum to 1). "
            f"Most of the result is driven by {', '.join(f'`{k}`' for k in top)}. Seeds are not swept keys; with few "
            "trials the estimate is rough.", "", "| swept key | importance |", "|---|---|", *rows, ""]
