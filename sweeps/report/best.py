"""The sweep's best trial by ``search.metric`` and the MLflow compare view of its trials (issue 24,
points 5 and 9).

* The best trial is the finished trial with the best ``search.metric`` (``search.mode``), the
  rule ``sweeps.spec.tuning.best_row`` applies to a tuning-private sweep's released trial. Choosing it
  is not private unless the sweep ran with ``tuning_privacy`` (then it *is* the released trial
  and the end-to-end epsilon covers it): ``selection_caveat`` says which, and every place that
  shows the best trial shows the caveat with it.
* ``record_best`` tags the parent run: ``dpsweep.best_trial_id``, ``dpsweep.best_run_id``,
  ``dpsweep.best_metric`` (``<metric> (<mode>)``), metric ``best_<metric>``, and
  ``dpsweep.compare_url``, the address of MLflow's compare view of the sweep's child runs (its
  parallel-coordinates plot draws the params that differ between them against a metric).
* ``compare_url`` builds that address: ``<ui>/#/compare-runs?runs=<JSON list>&experiments=<JSON
  list>``, the route of MLflow's UI (``Routes.getCompareRunPageRoute``), each value URL-encoded.

No Ray here; MLflow is imported inside the functions that talk to the tracking store.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from urllib.parse import quote

import numpy as np

from sweeps.words import best_of, counted
from trainables.tracking import TAG_PARENT, TAG_TRIAL, retry

LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` listens by default
MAX_TAG = 8000  # MLflow's limit on a tag value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)


@dataclass
class Best:
    """The best trial of a finished sweep, and the compare view of all its trials."""

    metric: str
    mode: str
    row: dict | None          # the console row of the best trial (None: no finished trial has the metric)
    run_id: str | None        # its MLflow child run
    compare_url: str          # the compare view of every child run ("" without any)
    n_runs: int               # child runs in that view
    private: bool             # tuning_privacy: the best trial is the released one
    claims_privacy: bool = True  # some trial's epsilon is a guarantee for its training data
    selection: Selection | None = None  # the best configuration over its repeats and its runner-up
    split: str = "none"       # the spec's selection.split (where the held-out score comes from)


def best_trial(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The finished trial with the best finite ``metric`` (``mode`` max or min); ties keep the
    first. The same rule as a tuning-private sweep's released trial (``sweeps.spec.tuning.best_row``)."""
    from sweeps.spec.tuning import best_row

    return best_row(rows, metric, mode)


# --------------------------------------------------------------------------- the best configuration

HELD_OUT = "heldout_"   # trainables.runtime.HELD_OUT: the metric on images selection never saw
ALPHA = 0.05            # level of the significance statement


@dataclass
class ConfigScore:
    """One configuration's repeats: the statistic selection compares, and mean, spread and n."""

    key: tuple                 # the configured values that define it (all but seed / repeat)
    rows: list[dict]           # its finished trials with a finite metric
    values: list[float]        # their metric, in the rows' order
    seeds: list                # their seeds (pairing key of the paired test)
    statistic: float           # what selection compared (mean, median or worst)
    mean: float
    sd: float                  # sample standard deviation (ddof 1); NaN for one trial
    held_out: tuple[float, float, int] | None = None   # mean, sd, n of heldout_<metric>, when the trials have it

    @property
    def n(self) -> int:
        return len(self.values)


@dataclass
class Comparison:
    """Two configurations compared over their seeds (issue 51.2): the paired t-test on matching seeds
    (else Welch's), the difference of their means with its 95% t-interval, an effect size (Cohen's
    d_z of the paired differences, or d with the pooled sd) and, when several comparisons are made,
    the Holm-adjusted p-value."""

    name: str                  # "best vs runner-up", "best vs non-private baseline", "A vs B"
    a: ConfigScore
    b: ConfigScore
    test: str                  # "paired t-test", "Welch's t-test" or "" (one trial on a side)
    p_value: float             # NaN: not testable, or no spread at all
    pairs: int
    diff: float                # mean(a) - mean(b) (paired: the mean of the per-seed differences)
    ci: tuple[float, float]    # its 95% interval (NaN without a test)
    effect: float              # Cohen's d_z (paired) or d (pooled sd); NaN without spread
    p_holm: float = math.nan   # Holm-adjusted over the comparisons made together

    def summary(self, metric: str, label=lambda s: "") -> str:
        """One sentence: the difference with its interval, the test, p (and Holm's), the effect size."""
        what = f"{metric} difference {self.diff:+.4g}"
        if not self.test:
            return (f"{what} (not tested: {self.a.n} and {self.b.n} trial(s); one trial per configuration cannot "
                    "tell seed-to-seed spread from a real difference)")
        how = f"{self.test} on {self.pairs} matching seeds" if self.test.startswith("paired") else \
            f"{self.test}, {self.a.n} and {self.b.n} seeds"
        if not math.isfinite(self.p_value):
            return f"{what} on every seed ({how}: no spread, not testable)"
        holm = f", Holm-adjusted p = {self.p_holm:.2g}" if math.isfinite(self.p_holm) else ""
        sig = self.p_holm if math.isfinite(self.p_holm) else self.p_value
        verdict = "significant" if sig < ALPHA else "not significant"
        eff = f", effect size {'d_z' if self.pairs else 'd'} = {self.effect:.2g}" if math.isfinite(self.effect) else ""
        return (f"{what} [95% CI {self.ci[0]:+.4g}, {self.ci[1]:+.4g}] ({how}, p = {self.p_value:.2g}{holm}{eff}): "
                f"{verdict} at {ALPHA:g}")


def compare_scores(a: ConfigScore, b: ConfigScore, name: str = "") -> Comparison:
    """``a`` against ``b`` over the seeds: a paired t-test (scipy.stats.ttest_rel) when both ran the
    same seeds (at least two), else Welch's unequal-variance t-test; one trial on either side is not
    testable. The difference's 95% interval is the t-interval of the test used."""
    from scipy import stats

    diff = float(np.mean(a.values) - np.mean(b.values))
    nan2 = (math.nan, math.nan)
    if a.n < 2 or b.n < 2:
        return Comparison(name, a, b, "", math.nan, 0, diff, nan2, math.nan)
    da, db = dict(zip(a.seeds, a.values)), dict(zip(b.seeds, b.values))
    common = [s for s in da if s is not None and s in db]
    if len(common) >= 2 and len(da) == a.n and len(db) == b.n and set(da) == set(db):
        d = np.array([da[s] - db[s] for s in common])
        mean, n = float(d.mean()), len(d)
        sd = float(d.std(ddof=1))
        if not d.any():
            return Comparison(name, a, b, "paired t-test", math.nan, n, mean, (mean, mean), math.nan)
        p = float(stats.ttest_rel([da[s] for s in common], [db[s] for s in common]).pvalue)
        half = float(stats.t.ppf(1 - ALPHA / 2, n - 1)) * sd / math.sqrt(n)
        return Comparison(name, a, b, "paired t-test", p, n, mean, (mean - half, mean + half),
                          mean / sd if sd > 0 else math.nan)
    va, vb = float(np.var(a.values, ddof=1)), float(np.var(b.values, ddof=1))
    if va == 0 and vb == 0:
        return Comparison(name, a, b, "Welch's t-test", math.nan, 0, diff, (diff, diff), math.nan)
    p = float(stats.ttest_ind(a.values, b.values, equal_var=False).pvalue)
    se2 = va / a.n + vb / b.n
    df = se2 ** 2 / ((va / a.n) ** 2 / (a.n - 1) + (vb / b.n) ** 2 / (b.n - 1))
    half = float(stats.t.ppf(1 - ALPHA / 2, df)) * math.sqrt(se2)
    pooled = math.sqrt(((a.n - 1) * va + (b.n - 1) * vb) / (a.n + b.n - 2))
    return Comparison(name, a, b, "Welch's t-test", p, 0, diff, (diff - half, diff + half),
                      diff / pooled if pooled > 0 else math.nan)


def holm(comparisons: list[Comparison]) -> None:
    """Holm's step-down adjustment of the comparisons' p-values (set ``p_holm``) when more than one
    has a p-value; a single test keeps its own."""
    tested = sorted((c for c in comparisons if math.isfinite(c.p_value)), key=lambda c: c.p_value)
    m = len(tested)
    if m < 2:
        return
    running = 0.0
    for j, c in enumerate(tested):
        running = max(running, min(1.0, (m - j) * c.p_value))
        c.p_holm = running


@dataclass
class Selection:
    """The best configuration, its runner-up, and whether the lead is significant over the seeds."""

    metric: str
    mode: str
    statistic: str
    best: ConfigScore | None
    runner_up: ConfigScore | None
    test: str                  # "paired t-test", "Welch's t-test" or "" (not testable)
    p_value: float             # NaN when not testable
    pairs: int                 # matching seeds of the paired test
    configurations: int        # configurations compared
    baseline: ConfigScore | None = None    # the best non-private configuration: a reference, not a contender
    ties: list[ConfigScore] = field(default_factory=list)  # others at the runner-up's selection score
    best_ties: list[ConfigScore] = field(default_factory=list)  # others at the best's selection score
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def significant(self) -> bool | None:
        return None if not self.test or not math.isfinite(self.p_value) else self.p_value < ALPHA

    def comparison(self, name: str) -> Comparison | None:
        return next((c for c in self.comparisons if c.name == name), None)

    def tie_statement(self) -> str:
        """Ties said, not broken silently (issue 51.2): configurations at the best's or the runner-up's
        selection score."""
        out = []
        if self.best_ties:
            out.append(f"{counted(len(self.best_ties), 'other configuration')} tie{'s' if len(self.best_ties) == 1 else ''} "
                       f"with the best at {self.statistic} {_fmt(self.best.statistic)}: the first is shown, the "
                       "choice between them is arbitrary")
        if self.ties:
            out.append(f"{counted(len(self.ties), 'other configuration')} tie{'s' if len(self.ties) == 1 else ''} "
                       f"with the runner-up at {self.statistic} {_fmt(self.runner_up.statistic)}: the runner-up "
                       "shown is the first of them")
        return "; ".join(out)

    def statement(self) -> str:
        """The significance statement, one sentence (docs/report.md)."""
        if self.best is None:
            return ""
        if self.runner_up is None:
            return "only one configuration: nothing to compare"
        if not self.test:
            return (f"not tested: the best and the runner-up have {self.best.n} and {self.runner_up.n} trial(s); with "
                    "one trial per configuration seed-to-seed spread cannot be told from a real difference (repeat "
                    "them with search.num_samples)")
        how = (f"{self.test} on {self.pairs} matching seeds" if self.test.startswith("paired") else
               f"{self.test}, {self.best.n} and {self.runner_up.n} seeds")
        c = self.comparison("best vs runner-up")
        if c is not None and math.isfinite(c.p_holm):
            how += f", Holm-adjusted p = {c.p_holm:.2g} over {len([x for x in self.comparisons if math.isfinite(x.p_value)])} comparisons"
        if not math.isfinite(self.p_value):
            return f"the best and the runner-up score the same on every seed ({how}): not significantly different"
        if self.significant:
            return f"the best is significantly {'above' if self.mode == 'max' else 'below'} the runner-up ({how}, " \
                   f"p = {self.p_value:.2g} < {ALPHA:g})"
        return (f"the best and the runner-up are not significantly different over the seeds ({how}, p = "
                f"{self.p_value:.2g} >= {ALPHA:g}): the choice between them is within seed-to-seed spread")

    def baseline_statement(self, label: str = "") -> str:
        """The non-private baseline beside the best private configuration: its score and what privacy
        costs (best - baseline, with its interval and test)."""
        if self.baseline is None:
            return ""
        who = f" ({label})" if label else ""
        text = f"non-private baseline{who}: {describe_stats(self.baseline, self.metric)}"
        c = self.comparison("best vs non-private baseline")
        if c is not None and self.best is not None and self.best is not self.baseline:
            text += f"; what privacy costs, best private minus baseline: {c.summary(self.metric)}"
        return text


def _stat(values: list[float], statistic: str, mode: str) -> float:
    arr = np.asarray(values, dtype=np.float64)
    if statistic == "median":
        return float(np.median(arr))
    if statistic == "worst":
        return float(arr.min() if mode == "max" else arr.max())
    return float(arr.mean())


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def select_configuration(rows: list[dict], metric: str, mode: str = "max", statistic: str = "mean", *,
                         config_of, seed_of=lambda r: None, done=lambda r: True, baseline_of=None,
                         best_among: str = "private", compare=None, matches=None) -> Selection:
    """The best configuration by ``statistic`` (mean, median or worst) of ``metric`` over its repeats
    (issue 34, point 1): ``config_of(row)`` gives a row's configuration (hashable; every configured
    value but seed and repeat), ``seed_of(row)`` its seed, ``done(row)`` whether it finished. Ties
    keep the configuration seen first, and are said (``Selection.ties``). The runner-up is the next
    best; their difference is tested over the seeds (``compare_scores``).

    ``baseline_of(row)``: whether a row is a non-private baseline (issue 51.1); with ``best_among``
    ``private`` (the default) the best and the runner-up are private configurations and the best
    baseline is ``Selection.baseline``, a reference (``all``: the baseline competes). ``compare``:
    the comparisons to make (``runner_up``, ``baseline``, or ``{"a": where, "b": where}`` with
    ``matches(where, row)``); default the runner-up and, when there is one, the baseline; Holm-adjusted
    when several are tested."""
    groups: dict = {}
    for r in rows:
        if done(r) and _finite(r.get(metric)):
            groups.setdefault(config_of(r), []).append(r)
    scored = []
    for key, members in groups.items():
        vals = [float(r[metric]) for r in members]
        held = [float(r[HELD_OUT + metric]) for r in members if _finite(r.get(HELD_OUT + metric))]
        scored.append(ConfigScore(
            key, members, vals, [seed_of(r) for r in members], _stat(vals, statistic, mode), float(np.mean(vals)),
            float(np.std(vals, ddof=1)) if len(vals) > 1 else math.nan,
            (float(np.mean(held)), float(np.std(held, ddof=1)) if len(held) > 1 else math.nan, len(held))
            if held else None))
    sign = 1.0 if mode == "max" else -1.0
    order = sorted(range(len(scored)), key=lambda i: (-sign * scored[i].statistic, i))
    baseline = None
    if baseline_of is not None:
        base = [i for i in order if baseline_of(scored[i].rows[0])]
        baseline = scored[base[0]] if base else None
        if best_among != "all" and len(base) < len(order):
            order = [i for i in order if i not in base]
    best = scored[order[0]] if order else None
    runner = scored[order[1]] if len(order) > 1 else None
    def tied(x: float, y: float) -> bool:   # equal up to the rounding of a mean (0.8667 from different seeds)
        return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)

    best_ties = [scored[i] for i in order[1:] if tied(scored[i].statistic, best.statistic)] if best else []
    ties = [scored[i] for i in order[2:] if runner is not None and tied(scored[i].statistic, runner.statistic)]
    test, p, pairs = "", math.nan, 0
    comparisons: list[Comparison] = []
    items = list(compare) if compare else ["runner_up", "baseline"]
    for item in items:
        if item in ("runner_up", "runner-up") and best is not None and runner is not None:
            comparisons.append(compare_scores(best, runner, "best vs runner-up"))
        elif item == "baseline" and best is not None and baseline is not None and baseline is not best:
            comparisons.append(compare_scores(best, baseline, "best vs non-private baseline"))
        elif isinstance(item, dict) and matches is not None:
            pick = [next((s for s in scored if matches(item.get(side) or {}, s.rows[0])), None) for side in ("a", "b")]
            name = " vs ".join(item.get(f"{side}_label") or ", ".join(f"{k}={v}" for k, v in (item.get(side) or {}).items())
                               for side in ("a", "b"))
            if pick[0] is not None and pick[1] is not None:
                comparisons.append(compare_scores(pick[0], pick[1], name))
    holm(comparisons)
    first = next((c for c in comparisons if c.name == "best vs runner-up"), None)
    if first is None and best is not None and runner is not None:
        first = compare_scores(best, runner, "best vs runner-up")
    if first is not None:
        test, p, pairs = first.test, first.p_value, first.pairs
    return Selection(metric, mode, statistic, best, runner, test, p, pairs, len(scored), baseline, ties, best_ties,
                     comparisons)


def compare_from_params(params: dict) -> list | None:
    """The spec's ``selection.compare`` read back from the parent run's flattened params
    (``sweeps.spec.spec_to_flat_params``): ``selection.compare`` as a JSON list of names, or indexed
    items ``selection.compare.<j>`` / ``selection.compare.<j>.a.<key>``; None when the spec wrote none."""
    from sweeps.report.data import _typed

    if "selection.compare" in params:
        value = _typed(params["selection.compare"])
        return list(value) if isinstance(value, list) else None
    items: dict[int, object] = {}
    for key, value in params.items():
        parts = key.split(".", 4)
        if len(parts) < 3 or parts[:2] != ["selection", "compare"] or not parts[2].isdigit():
            continue
        j = int(parts[2])
        if len(parts) == 3:
            items[j] = value
        elif len(parts) >= 5 and parts[3] in ("a", "b"):
            item = items.setdefault(j, {})
            if isinstance(item, dict):
                item.setdefault(parts[3], {})[parts[4]] = _typed(value)
    return [items[j] for j in sorted(items)] or None


def cfg_nonprivate(row: dict) -> bool:
    """Whether a console row (``cfg.<key>`` values) is a non-private baseline: ``epsilon: null`` of a
    trainable whose epsilon is a privacy guarantee (``sweeps.report.data.is_nonprivate``)."""
    from sweeps.report.data import is_nonprivate

    probe = {"trainable": row.get("trainable"), "epsilon": row.get("epsilon")}
    if "cfg.epsilon" in row:
        probe["param.epsilon"] = row["cfg.epsilon"]
    return is_nonprivate(probe)


def applicable(row: dict, keys) -> list:
    """``keys`` (``cfg.<key>`` or ``param.<key>``) but those a non-private row does not use (its
    epsilon and ``NONPRIVATE_UNUSED``: it never clips, draws noise nor accounts)."""
    from sweeps.report.data import NONPRIVATE_UNUSED

    if not cfg_nonprivate(row):
        return list(keys)
    return [k for k in keys if k.split(".", 1)[-1] not in NONPRIVATE_UNUSED + ("epsilon",)]


def config_key_from_cfg(row: dict) -> tuple:
    """A console row's configuration: its trainable and every ``cfg.<key>`` but seed and repeat (and,
    for a non-private baseline, but the keys that do not apply to it)."""
    keys = applicable(row, [k for k in row if k.startswith("cfg.") and k not in ("cfg.seed", "cfg.repeat")])
    return (row.get("trainable"),) + tuple(sorted((k, json.dumps(row[k], sort_keys=True, default=str)) for k in keys)) \
        + ((("non-private", True),) if cfg_nonprivate(row) else ())


def describe_stats(score: ConfigScore, metric: str) -> str:
    """``mean ± sd (n = k)``, or the value alone for one trial."""
    if score.n == 1:
        return f"{metric} = {_fmt(score.mean)} (one trial)"
    return f"{metric} = {_fmt(score.mean)} ± {score.sd:.2g} (mean ± sd over n = {score.n} seeds)"


# the images a trial's own metrics (and every figure drawn from them) are measured on, under a selection split;
# the other images' scores are its heldout_<metric> (issue 51.4: figures say which)
SELECTION_IMAGES = {"test_half": "the selection half of the test images (the half selection read)",
                    "validation": "the validation images selection read (a split of the training images)"}


def describe_held_out(score: ConfigScore | None, metric: str, split: str = "") -> str:
    """The chosen configuration's score on images selection never saw (``heldout_<metric>``)."""
    if score is None or score.held_out is None:
        return ""
    mean, sd, n = score.held_out
    spread = f" ± {sd:.2g} (n = {n})" if n > 1 else ""
    where = {"validation": "the test images (selection read the validation images)",
             "test_half": "the test images selection did not read"}.get(split, "images selection never saw")
    return f"held-out {metric} = {_fmt(mean)}{spread} on {where}"


# --------------------------------------------------------------------------- the closing lines of `dpsweep run`


def console_metrics(spec) -> list[str]:
    """Metrics the console's results table adds to the accuracies and epsilon: the search metric,
    its held-out score (``heldout_<metric>``, with a selection split) and, for an audited trial, its
    claim and bounds (``sweeps.runner.summarize`` keeps the ``audit_*`` ones it finds)."""
    metric = spec.search.metric
    return [metric, HELD_OUT + metric] if metric else []


def label_candidates(rows: list[dict], spec) -> list[dict]:
    """A tuning-private sweep's trials are candidates (each drawn independently, K of them), not
    repeats of one configuration: the console says ``candidate`` where a repeat index would be."""
    if spec.tuning_privacy is None:
        return rows
    out = []
    for r in rows:
        r = dict(r)
        if "cfg.repeat" in r:
            r = {("candidate" if k == "cfg.repeat" else k): v for k, v in r.items()}
        out.append(r)
    return out


def describe_released(spec, released: dict) -> str:
    """The console's ``released:`` line: its selection score and, with a selection split, its
    held-out score, the headline (images the selection never read)."""
    metric = spec.search.metric
    line = (f"released: trial {released.get('trial_id', '?')} with {metric} = {released[metric]:.4g} "
            "(the only output covered by the end-to-end guarantee)")
    held = released.get(HELD_OUT + metric)
    if _finite(held):
        line += (f"\nheadline: held-out {metric} = {held:.4g} on the test images the selection never read "
                 f"({HELD_OUT}{metric}; its selection score counts the selection's luck)")
    return line


def closing_lines(spec, tuning: dict | None, best: "Best | None", tracking_uri: str, experiment: str) -> list[str]:
    """What the console says last about privacy and where to look (issue 34, points 7 and 9): a
    tuning-private sweep restates its end-to-end epsilon and points to ``dpsweep release`` (what may
    be published); the compare view's port and the metric to pick in it."""
    out = []
    if best is not None and best.compare_url and best.metric:
        port = "" if tracking_uri.startswith(("http://", "https://")) else (
            " (the address assumes `mlflow ui` on port 5000: start it with --port 5000, or change the port in it)")
        out.append(f"          compare view{port}: MLflow opens its parallel-coordinates plot on the first metric it "
                   f"lists (often train_loss); pick {best.metric} in the plot's Metrics box, or see the report's "
                   "parallel_coordinates.png")
    if spec.tuning_privacy is not None and tuning is not None:
        out.append(f"privacy:  end-to-end epsilon {tuning['tuning_epsilon']:.4g} at delta {tuning['tuning_delta']:.3g} "
                   f"for the released trial (private selection over K ~ {spec.tuning_privacy.distribution}(mean "
                   f"{spec.tuning_privacy.mean:g}) candidates, Papernot & Steinke 2022); the candidates, their scores "
                   f"and K are for the owner only; publish with: dpsweep release {experiment} --tracking-uri "
                   f"{tracking_uri} --out release/")
    return out


def claims_privacy(trainables) -> bool:
    """Whether any of these trainables' epsilon protects its training data (PixelDP's does not: it
    is a robustness parameter; ``TrainableEntry.privacy_epsilon``)."""
    from trainables.registry import REGISTRY

    return any(getattr(REGISTRY.get(str(t)), "privacy_epsilon", True) for t in trainables)


def selection_caveat(private: bool, n: int, claims: bool = True) -> str:
    """What covers choosing the best of ``n`` trials (docs/tuning_privacy.md); ``claims``: whether
    the trials claim any privacy for their training data at all."""
    if not claims:
        if n == 1:
            return "the only trial, which claims no privacy for its training data: nothing was chosen"
        return (f"a tuning choice among {counted(n, 'trial')}, none of which claims privacy for its training data; "
                "the best value is an optimistic estimate of the chosen configuration's (it was chosen on the same "
                "test set)")
    if private:
        return ("the released trial of a tuning_privacy sweep: covered by the end-to-end epsilon "
                "(Papernot & Steinke 2022)")
    if n == 1:
        return ("the only trial: nothing was chosen, so its own epsilon covers it (choosing among trials needs "
                "tuning_privacy for an end-to-end guarantee)")
    return (f"not private: choosing {best_of(n, 'trial')} uses the training data again and no guarantee covers "
            "the choice; each trial's epsilon holds for that trial alone (tuning_privacy gives an end-to-end one)")


def ui_base(tracking_uri: str) -> str:
    """The MLflow UI's address: the tracking server itself, or ``mlflow ui``'s local default."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return LOCAL_UI


def compare_url(base: str, experiment_id, run_ids: list[str]) -> str:
    """The address of MLflow's compare view of ``run_ids``: runs and experiments as JSON lists,
    URL-encoded (``["a","b"]`` -> ``%5B%22a%22%2C%22b%22%5D``)."""
    if not run_ids:
        return ""

    def enc(values) -> str:
        return quote(json.dumps([str(v) for v in values], separators=(",", ":")), safe="")

    return f"{base.rstrip('/')}/#/compare-runs?runs={enc(run_ids)}&experiments={enc([experiment_id])}"


def child_runs(client, info: dict) -> dict[str, str]:
    """Ray trial id -> MLflow run id of every child run of the sweep (one search)."""
    runs = retry(lambda: client.search_runs([str(info["experiment_id"])],
                                            filter_string=f"tags.`{TAG_PARENT}` = '{info['parent_run_id']}'",
                                            max_results=50000), what="search_runs(children)")
    ordered = sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))
    return {r.data.tags.get(TAG_TRIAL, r.info.run_id): r.info.run_id for r in ordered}


def choose(spec, rows: list[dict]) -> tuple[dict | None, Selection | None]:
    """The best of a finished sweep's console rows (issue 34, point 1): without tuning_privacy the
    best *configuration* by ``selection.statistic`` over its repeats, represented by its first trial;
    with it the released trial (each candidate its own configuration). (row, selection)."""
    metric, mode = spec.search.metric, spec.search.mode or "max"
    if not metric:
        return None, None
    private = spec.tuning_privacy is not None
    sel_spec = getattr(spec, "selection", None)
    statistic = getattr(sel_spec, "statistic", "mean")
    selection = select_configuration(
        rows, metric, mode, statistic,
        config_of=(lambda r: r.get("trial_id")) if private else config_key_from_cfg,
        seed_of=lambda r: r.get("cfg.seed"), done=lambda r: r.get("status") == "DONE",
        baseline_of=None if private else cfg_nonprivate, best_among=getattr(sel_spec, "best_of", "private"),
        compare=[c if isinstance(c, str) else {"a": c.a, "b": c.b} for c in getattr(sel_spec, "compare", None) or []]
        or None, matches=_cfg_matches)
    if private:
        return best_trial(rows, metric, mode), selection
    return (selection.best.rows[0] if selection.best is not None else None), selection


def _cfg_matches(where: dict, row: dict) -> bool:
    """A console row matches ``where`` (a ``selection.compare`` side) by its ``cfg.<key>`` values."""
    from sweeps.spec.sweep_spec import reference_matches

    config = {"trainable": row.get("trainable"), **{k[len("cfg."):]: v for k, v in row.items() if k.startswith("cfg.")}}
    return reference_matches(where, config)


def record_best(info: dict, spec, rows: list[dict]) -> Best:
    """Find the best configuration by ``spec.search.metric`` (``choose``), tag it and the compare
    view on the parent run (only the compare view when the spec names no metric): tags
    ``dpsweep.best_trial_id`` / ``dpsweep.best_run_id`` (its first trial), ``dpsweep.best_trial_ids``
    (all its trials), ``dpsweep.best_metric``, ``dpsweep.best_significance``; metrics
    ``best_<metric>`` (the statistic selection compared), ``best_<metric>_mean``, ``_sd``, ``_n`` and
    ``best_heldout_<metric>`` (its mean on the held-out images of a selection split)."""
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(info["tracking_uri"])
    children = child_runs(client, info)
    url = compare_url(ui_base(info["tracking_uri"]), info["experiment_id"], list(children.values()))
    metric, mode = spec.search.metric, spec.search.mode or "max"
    row, selection = choose(spec, rows)
    run_id = children.get(str(row.get("trial_id", ""))) if row else None
    tags, metrics = [], []
    now = int(time.time() * 1000)
    if url:
        tags.append(RunTag("dpsweep.compare_url", url if len(url) <= MAX_TAG else
                           f"{len(children)} runs: too many for one tag; open the experiment's runs view"))
    if row is not None:
        tags += [RunTag("dpsweep.best_trial_id", str(row.get("trial_id", ""))),
                 RunTag("dpsweep.best_metric", f"{metric} ({mode})")]
        if run_id:
            tags.append(RunTag("dpsweep.best_run_id", run_id))
        b = selection.best if selection is not None else None
        private = spec.tuning_privacy is not None
        value = float(row[metric]) if private or b is None else b.statistic
        metrics.append(Metric(f"best_{metric}", value, now, 0))
        if b is not None and not private:
            tags += [RunTag("dpsweep.best_trial_ids", ",".join(str(r.get("trial_id", "")) for r in b.rows)[:MAX_TAG]),
                     RunTag("dpsweep.best_significance", selection.statement()[:MAX_TAG])]
            metrics += [Metric(f"best_{metric}_mean", b.mean, now, 0), Metric(f"best_{metric}_n", float(b.n), now, 0)]
            if math.isfinite(b.sd):
                metrics.append(Metric(f"best_{metric}_sd", b.sd, now, 0))
        if selection is not None and not private:   # the comparisons the spec asked for, on the parent (issue 51.2)
            t, m = comparison_records(selection, metric, now)
            tags += t
            metrics += m
        held = row.get(HELD_OUT + metric) if private else (b.held_out[0] if b is not None and b.held_out else None)
        if _finite(held):
            metrics.append(Metric(f"best_{HELD_OUT}{metric}", float(held), now, 0))
    if tags or metrics:
        retry(lambda: client.log_batch(info["parent_run_id"], metrics=metrics, tags=tags), what="log_batch(best)")
    return Best(metric or "", mode, row, run_id, url, len(children), spec.tuning_privacy is not None,
                claims_privacy([row.get("trainable") for row in rows]) if rows else True, selection,
                getattr(getattr(spec, "selection", None), "split", "none"))


def comparison_slug(name: str) -> str:
    """``best_vs_runner_up`` for "best vs runner-up": a comparison's name in MLflow keys."""
    return "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")[:60]


def comparison_records(selection: "Selection", metric: str, now: int) -> tuple[list, list]:
    """The parent run's record of each comparison (``selection.compare``; issue 51.2): the tag
    ``dpsweep.compare.<name>`` (the sentence the report prints), the metrics ``compare.<name>.diff``,
    ``.ci_low``, ``.ci_high``, ``.p``, ``.p_holm``, ``.effect`` where defined, and the tag
    ``dpsweep.baseline`` (the non-private baseline's score and what privacy costs), so that MLflow's
    search and compare views can filter sweeps on them."""
    from mlflow.entities import Metric, RunTag

    tags, metrics = [], []
    for c in selection.comparisons:
        slug = comparison_slug(c.name)
        tags.append(RunTag(f"dpsweep.compare.{slug}", f"{c.name}: {c.summary(metric)}"[:MAX_TAG]))
        values = {"diff": c.diff, "ci_low": c.ci[0], "ci_high": c.ci[1], "p": c.p_value, "p_holm": c.p_holm,
                  "effect": c.effect}
        metrics += [Metric(f"compare.{slug}.{k}", float(v), now, 0) for k, v in values.items() if _finite(v)]
    if selection.baseline is not None and selection.baseline is not selection.best:
        tags.append(RunTag("dpsweep.baseline", selection.baseline_statement()[:MAX_TAG]))
    return tags, metrics


def varying_within(rows: list[dict], keys, group: str = "trainable") -> list[str]:
    """The ``keys`` that take two or more values among the rows of one ``group`` (trainable) where they
    are set: what a sweep swept. A key that is constant within each trainable and only differs between
    trainables' defaults (a multi-trainable spec's ``attacks``, ``lr``) is not swept (issue 51.5)."""
    def values(k, name):
        return {json.dumps(r[k], sort_keys=True, default=str) for r in rows if r.get(group) == name and k in r}

    names = list(dict.fromkeys(r.get(group) for r in rows))
    return [k for k in keys if k != group and any(len(values(k, name)) > 1 for name in names)]


def describe_best(best: Best, shown_keys: list[str] | None = None, n: int | None = None) -> str:
    """The console's ``best:`` lines: the configuration (its swept values), the statistic with
    mean ± sd and n over its seeds, the runner-up and the significance statement, the held-out score,
    and the caveat."""
    if not best.metric:
        return "best:     no best trial (the spec sets no single search.metric)"
    if best.row is None:
        return f"best:     no finished trial has {best.metric}"
    r = best.row
    where = _where(r, shown_keys)
    run = f", run {best.run_id}" if best.run_id else ""
    caveat = selection_caveat(best.private, n if n is not None else 0, best.claims_privacy)
    sel, pad = best.selection, "\n          "
    if best.private or sel is None or sel.best is None or sel.best.n == 1:
        out = (f"best:     trial {r.get('trial_id', '?')}{where} with {best.metric} = {_fmt(r[best.metric])} "
               f"({best.mode}{run}); {caveat}")
        if sel is not None and not best.private and sel.runner_up is not None:
            out += pad + sel.statement()
    else:
        b = sel.best
        chosen = "" if sel.statistic == "mean" else f"; chosen by its {sel.statistic} {_fmt(b.statistic)}"
        ids = ", ".join(str(x.get("trial_id", "?")) for x in b.rows)
        out = (f"best:     configuration{where or ' ' + str(r.get('trainable', ''))}: "
               f"{describe_stats(b, best.metric)}{chosen} ({best.mode}; trials {ids}{run})")
        if sel.runner_up is not None:
            out += pad + f"runner-up{_where(sel.runner_up.rows[0], shown_keys)} {describe_stats(sel.runner_up, best.metric)}; {sel.statement()}"
        out += pad + caveat
    if sel is not None and not best.private:
        if sel.tie_statement():
            out += pad + "ties: " + sel.tie_statement()
        if sel.baseline is not None and sel.baseline is not sel.best:   # a reference, not a contender (issue 51.1)
            out += pad + sel.baseline_statement()
        out += "".join(pad + f"{c.name}: {c.summary(best.metric)}" for c in sel.comparisons
                       if c.name not in ("best vs runner-up", "best vs non-private baseline"))
    if best.private:
        held = r.get(HELD_OUT + best.metric)
        if _finite(held):
            out += pad + (f"held-out {best.metric} of the released trial = {_fmt(held)} (the headline: images "
                          "selection never saw)")
    else:
        text = describe_held_out(sel.best if sel is not None else None, best.metric, best.split)
        if text:
            out += pad + text + " (the score to quote: selection never read them)"
    return out


def _where(row: dict, shown_keys) -> str:
    """`` (key=value, ...)`` of the shown keys that apply to the row; a non-private baseline is named
    ``non-private`` and its unused keys (its clipping norm, its delta) are not shown (issue 51.1)."""
    keys = applicable(row, [k for k in (shown_keys or []) if k in row and k not in ("cfg.seed", "cfg.repeat")])
    values = ", ".join(f"{k[len('cfg.'):] if k.startswith('cfg.') else k}={_fmt(row[k])}" for k in keys)
    if cfg_nonprivate(row):
        values = "non-private" + (", " + values if values else "")
    return f" ({values})" if values else ""


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)
