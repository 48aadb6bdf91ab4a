"""The non-private baseline named and shown as a reference, and the comparisons a study asks for
(issue 51, points 1, 2 and 3): a configuration with ``epsilon: null`` is "non-private" (not "dpsgd
max_grad_norm=1", an unused default), the best is the best *private* configuration with the
baseline's score beside it (what privacy costs, with its interval), ``selection.compare`` makes its
comparisons with a paired test, an effect size, an interval and Holm's correction, ties are said, and
importances are computed over the private trials."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

# (epsilon, C) -> acc_clean per seed; the baseline is the most accurate, (8, 0.5) and (8, 1) tie as runners-up
SCORES = {(1.0, 0.5): [0.80, 0.82, 0.81], (1.0, 1.0): [0.70, 0.74, 0.72],
          (8.0, 0.5): [0.90, 0.92, 0.91], (8.0, 1.0): [0.86, 0.87, 0.86],
          (3.0, 0.5): [0.85, 0.86, 0.87], (3.0, 1.0): [0.88, 0.85, 0.86]}
BASELINE = [0.97, 0.98, 0.975]


def log_study(tmp_path, params=None, baseline=BASELINE, scores=SCORES):
    from mlflow.tracking import MlflowClient

    from trainables.tracking import TAG_PARENT, TAG_TRAINABLE

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("study", artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(exp, run_name="study-1", tags={"dpsweep.kind": "sweep"}).info.run_id
    for k, v in {"search.metric": "acc_clean", "search.mode": "max", **(params or {})}.items():
        client.log_param(parent, k, v)
    configs = dict(scores)
    if baseline:
        configs[(None, 1.0)] = baseline   # epsilon: null, max_grad_norm the unused default
    for (eps, c), values in configs.items():
        for s, v in enumerate(values):
            run = client.create_run(exp, run_name=f"dpsgd-eps{eps}-C{c:g}-s{s}",
                                    tags={TAG_PARENT: parent, TAG_TRAINABLE: "dpsgd"}).info.run_id
            for k, p in {"epsilon": eps, "max_grad_norm": c, "seed": s, "repeat": s, "delta": 1e-5}.items():
                client.log_param(run, k, p)
            for k, m in {"acc_clean": v, "epsilon": math.inf if eps is None else eps}.items():
                client.log_metric(run, k, m)
            client.set_terminated(run, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return uri


def _section(text, title):
    return text[text.index(f"## {title}"):].split("\n## ")[0]


def test_the_baseline_is_named_non_private_and_shown_as_a_reference(tmp_path):
    from sweeps.report import make_report

    text = make_report("study", log_study(tmp_path), tmp_path / "r").read_text()
    best = _section(text, "Best configuration")
    # the best is the best private configuration, not the baseline
    assert "**dpsgd epsilon=8 max_grad_norm=0.5**: acc_clean = 0.91" in best, best
    # the baseline is named by what applies: no unused clipping norm
    assert "Non-private baseline (dpsgd non-private): acc_clean = 0.975" in best, best
    assert "max_grad_norm=1 non" not in text and "dpsgd max_grad_norm=1**" not in best
    # what privacy costs, with its interval and test
    assert "what privacy costs, best private minus baseline: acc_clean difference -0.065 [95% CI" in best, best
    assert "paired t-test on 3 matching seeds" in best
    # a key that does not apply to the baseline is missing in the tables, not the unused default
    rows = pd.read_csv(tmp_path / "r" / "trials.csv")
    base = rows[rows["param.epsilon"].isna()]
    assert len(base) == 3 and base["param.max_grad_norm"].isna().all() and base["param.delta"].isna().all()
    trials = _section(text, "Trials")
    assert "dpsgd non-private" in text and "| dpsgd max_grad_norm=1 |" not in trials


def test_best_of_all_lets_the_baseline_compete(tmp_path):
    from sweeps.report import make_report

    text = make_report("study", log_study(tmp_path, {"selection.best_of": "all"}), tmp_path / "r").read_text()
    assert "**dpsgd non-private**: acc_clean = 0.975" in _section(text, "Best configuration")


def test_ties_are_said_and_comparisons_are_holm_corrected(tmp_path):
    from sweeps.report import make_report

    scores = dict(SCORES)
    scores[(3.0, 1.0)] = [0.85, 0.88, 0.87]          # mean 0.8667 = the (3, 0.5) and (8, 1) means
    scores[(8.0, 1.0)] = [0.87, 0.86, 0.87]
    params = {"selection.compare.0": "runner_up", "selection.compare.1": "baseline",
              "selection.compare.2.a.epsilon": "1.0", "selection.compare.2.a.max_grad_norm": "0.5",
              "selection.compare.2.b.epsilon": "1.0", "selection.compare.2.b.max_grad_norm": "1.0"}
    text = make_report("study", log_study(tmp_path, params, scores=scores), tmp_path / "r").read_text()
    best = _section(text, "Best configuration")
    assert "Ties: 1 other configuration ties with the runner-up at mean 0.8667" in best, best
    assert "Holm-adjusted p = " in best and "over 3 comparisons" in best
    assert "* epsilon=1.0, max_grad_norm=0.5 vs epsilon=1.0, max_grad_norm=1.0 (dpsgd epsilon=1 max_grad_norm=0.5 vs " \
           "dpsgd epsilon=1 max_grad_norm=1): acc_clean difference +0.09 [95% CI" in best, best
    assert "effect size d_z = " in best


def test_holm_and_the_interval_match_their_definitions():
    from scipy import stats

    from sweeps.report.best import ConfigScore, compare_scores, holm

    def score(vals):
        return ConfigScore(("k", tuple(vals)), [], list(vals), [0, 1, 2, 3], float(np.mean(vals)), float(np.mean(vals)),
                           float(np.std(vals, ddof=1)))

    a, b, c = score([0.9, 0.92, 0.91, 0.93]), score([0.85, 0.9, 0.86, 0.9]), score([0.5, 0.52, 0.49, 0.5])
    one, two = compare_scores(a, b, "x"), compare_scores(a, c, "y")
    d = np.array(a.values) - np.array(b.values)
    assert one.p_value == pytest.approx(stats.ttest_rel(a.values, b.values).pvalue)
    lo, hi = stats.t.interval(0.95, 3, loc=d.mean(), scale=d.std(ddof=1) / 2)
    assert one.ci == (pytest.approx(lo), pytest.approx(hi)) and one.effect == pytest.approx(d.mean() / d.std(ddof=1))
    holm([one, two])
    small, large = sorted([one, two], key=lambda x: x.p_value)
    assert small.p_holm == pytest.approx(min(1, 2 * small.p_value))
    assert large.p_holm == pytest.approx(max(small.p_holm, large.p_value))


def _console_rows():
    rows = []
    for (eps, c), values in {**SCORES, (None, 1.0): BASELINE}.items():
        for s, v in enumerate(values):
            rows.append({"trial_id": f"t{len(rows)}", "trainable": "dpsgd", "status": "DONE", "acc_clean": v,
                         "epsilon": math.inf if eps is None else eps, "cfg.epsilon": eps, "cfg.max_grad_norm": c,
                         "cfg.seed": s, "cfg.repeat": s})
    return rows


def test_the_console_names_the_best_private_configuration_and_the_baseline_beside_it():
    from types import SimpleNamespace

    from sweeps.report.best import Best, choose, describe_best

    spec = SimpleNamespace(search=SimpleNamespace(metric="acc_clean", mode="max"), tuning_privacy=None,
                           selection=SimpleNamespace(statistic="mean", best_of="private", compare=[]))
    rows = _console_rows()
    row, sel = choose(spec, rows)
    assert (row["cfg.epsilon"], row["cfg.max_grad_norm"]) == (8.0, 0.5)
    line = describe_best(Best("acc_clean", "max", row, None, "", 0, False, True, sel),
                         ["cfg.epsilon", "cfg.max_grad_norm", "cfg.seed"], len(rows))
    assert line.startswith("best:     configuration (epsilon=8, max_grad_norm=0.5): acc_clean = 0.91"), line
    assert "non-private baseline: acc_clean = 0.975 ± 0.005 (mean ± sd over n = 3 seeds); what privacy costs, " \
           "best private minus baseline: acc_clean difference -0.065 [95% CI" in line, line
    # best_of: all: the baseline competes, and is named by what applies
    spec.selection.best_of = "all"
    row, sel = choose(spec, rows)
    line = describe_best(Best("acc_clean", "max", row, None, "", 0, False, True, sel),
                         ["cfg.epsilon", "cfg.max_grad_norm"], len(rows))
    assert row["cfg.epsilon"] is None and line.startswith("best:     configuration (non-private): acc_clean = 0.975"), line


def test_importances_are_over_the_private_trials_and_the_baseline_epsilon_is_not_nan(tmp_path, monkeypatch):
    """Among private configurations C drives the metric here; with the baseline counted as a fourth
    epsilon value (and its unused C as a third) epsilon took it all."""
    import matplotlib.pyplot as plt

    from sweeps.report import make_report
    from sweeps.report.importance import parameter_importances

    scores = {(e, c): [0.6 + (0.2 if c == 0.5 else 0.0) + 0.01 * e / 8 + 0.002 * s for s in range(3)]
              for e in (1.0, 3.0, 8.0) for c in (0.5, 1.0)}
    labels = {}
    saved = plt.Figure.savefig

    def grab(fig, path, *a, **k):
        if str(path).endswith("parallel_coordinates.png"):
            labels["texts"] = [t.get_text() for t in fig.axes[0].texts]
        return saved(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", grab)
    uri = log_study(tmp_path, scores=scores, baseline=[0.99, 0.99, 0.99])
    text = make_report("study", uri, tmp_path / "r").read_text()
    imp = _section(text, "Which swept key matters")
    assert "over the 18 finished private trials (the 3 non-private baseline trials left out" in imp, imp
    rows = dict(map(str.strip, line.strip("|").replace("`", "").split("|")[:2]) for line in imp.splitlines()
                if line.startswith("| `"))
    assert float(rows["max_grad_norm"]) > 0.8, rows
    # the negative control: with the baseline counted, epsilon takes most of it
    from sweeps.report.data import load_sweep

    trials = load_sweep("study", uri).trials
    trials["param.max_grad_norm"] = trials["param.max_grad_norm"].fillna(1.0)   # the unused default, as before
    everything, n = parameter_importances(trials, "acc_clean", "max", private=False)
    assert n == 21 and everything["epsilon"] > everything["max_grad_norm"], everything
    assert "nan" not in labels["texts"] and "non-private" in labels["texts"], labels


def test_a_sweep_without_privacy_epsilons_does_not_speak_of_the_per_trial_epsilons_above():
    """issue 51.7: the demo's (PixelDP-only) report said "the per-trial epsilons above do not bound ..."."""
    from types import SimpleNamespace

    from sweeps.report.page import _privacy_section

    def sweep(trainable, eps):
        trials = pd.DataFrame({"trainable": [trainable] * 2, "epsilon": [eps] * 2, "status": ["FINISHED"] * 2})
        parent = SimpleNamespace(data=SimpleNamespace(metrics={}, tags={}, params={}))
        return SimpleNamespace(parent_metrics={}, parent_tags={}, trials=trials, parent=parent)

    text = "\n".join(_privacy_section(sweep("pixeldp", math.nan)))
    assert "per-trial epsilons above" not in text and "No trial of these 2 reports a privacy epsilon" in text
    assert "per-trial epsilons above" in "\n".join(_privacy_section(sweep("dpsgd", 1.0)))   # the control


def test_the_parent_run_records_each_comparison_and_the_baseline(tmp_path):
    """Issue 51.2: what the console and the report say about the comparisons is on the parent run too
    (tags dpsweep.compare.<name> and dpsweep.baseline, metrics compare.<name>.diff / .p / .p_holm / ...),
    so sweeps can be searched and compared on them in MLflow; a comparison the spec did not ask for is
    not recorded (the control)."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from sweeps.report.best import record_best
    from trainables.tracking import TAG_PARENT, TAG_TRIAL

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("cmp")
    rows = _console_rows()

    def run(compare):
        parent = client.create_run(exp, tags={"dpsweep.kind": "sweep"}).info.run_id
        for r in rows:
            client.create_run(exp, tags={TAG_PARENT: parent, TAG_TRIAL: r["trial_id"]})
        spec = SimpleNamespace(search=SimpleNamespace(metric="acc_clean", mode="max"), tuning_privacy=None,
                               selection=SimpleNamespace(statistic="mean", best_of="private", compare=compare,
                                                         split="none"))
        record_best({"tracking_uri": uri, "experiment_id": exp, "parent_run_id": parent}, spec, rows)
        return client.get_run(parent).data

    data = run(["runner_up", "baseline"])
    assert data.tags["dpsweep.compare.best_vs_runner_up"].startswith("best vs runner-up: acc_clean difference")
    assert "what privacy costs" in data.tags["dpsweep.baseline"]
    m = data.metrics
    assert m["compare.best_vs_non_private_baseline.diff"] == pytest.approx(0.91 - 0.975)
    assert m["compare.best_vs_non_private_baseline.ci_low"] < m["compare.best_vs_non_private_baseline.diff"] \
        < m["compare.best_vs_non_private_baseline.ci_high"]
    # two tests made together: Holm's adjustment is recorded beside the raw p-value, never below it
    assert m["compare.best_vs_runner_up.p_holm"] >= m["compare.best_vs_runner_up.p"]
    control = run(["runner_up"])          # only the runner-up asked for: no baseline comparison recorded
    assert "compare.best_vs_runner_up.diff" in control.metrics
    assert not any(k.startswith("compare.best_vs_non_private") for k in control.metrics)
    assert not any(k.startswith("dpsweep.compare.best_vs_non_private") for k in control.tags)
