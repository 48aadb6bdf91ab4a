"""Repeats of a trial (issue 13 point 9): each ``search.num_samples`` repeat gets its own seed,
derived deterministically from the configured seed and the repeat index, and the report
aggregates repeats by their configured parameters (mean, standard deviation and n)."""

from __future__ import annotations

import copy
import math

import pytest

from sweeps.spec import expand_trials, validate_spec
from sweeps.spec.space import REPEAT_SEED_STRIDE, repeat_seed

BASE = {
    "name": "t",
    "common": {"train_size": 100, "test_size": 50},
    "trainables": [{"name": "pixeldp", "search": {"epsilon": [0.5, 1.0]}}],
}


def trials_of(search=None, seed=None, **spec_search):
    raw = copy.deepcopy(BASE)
    raw["trainables"][0]["search"].update(search or {})
    if seed is not None:
        raw["common"]["seed"] = seed
    raw["search"] = spec_search
    return expand_trials(validate_spec(raw))


def test_single_repeat_sweeps_are_unchanged():
    trials = trials_of()
    assert [t["seed"] for t in trials] == [0, 0]
    assert all("repeat" not in t for t in trials)


def test_each_repeat_has_its_own_reproducible_seed():
    trials = trials_of(num_samples=3, seed=7)
    assert [(t["epsilon"], t["repeat"], t["seed"]) for t in trials] == [
        (0.5, 0, 7), (1.0, 0, 7),
        (0.5, 1, 7 + REPEAT_SEED_STRIDE), (1.0, 1, 7 + REPEAT_SEED_STRIDE),
        (0.5, 2, 7 + 2 * REPEAT_SEED_STRIDE), (1.0, 2, 7 + 2 * REPEAT_SEED_STRIDE)]
    assert trials == trials_of(num_samples=3, seed=7)  # deterministic
    # the seeds of one configuration differ across repeats
    assert len({t["seed"] for t in trials if t["epsilon"] == 0.5}) == 3
    assert repeat_seed(7, 0) == 7


def test_random_search_samples_get_their_own_seeds_too():
    trials = trials_of({"lr": {"loguniform": [1e-4, 1e-2]}}, algorithm="random", num_samples=2)
    assert [t["seed"] for t in trials] == [0, 0, REPEAT_SEED_STRIDE, REPEAT_SEED_STRIDE]


def test_an_explicitly_swept_seed_is_left_alone():
    trials = trials_of({"seed": [3, 4]}, num_samples=2)
    assert [t["seed"] for t in trials] == [3, 4, 3, 4] * 2
    assert [t["repeat"] for t in trials] == [0] * 4 + [1] * 4


# --------------------------------------------------------------------------- aggregation in the report


def _trials_frame():
    import pandas as pd

    rows = []
    # dpsgd at two configured epsilons, three repeats each (seeds differ), one failed repeat
    for eps, accs in ((1.0, [0.80, 0.82, 0.87]), (2.0, [0.90, 0.91, 0.95])):
        for r, acc in enumerate(accs):
            rows.append({"run_id": f"d{eps}{r}", "run": f"dpsgd-{eps}-{r}", "trainable": "dpsgd", "status": "FINISHED",
                         "param.epsilon": eps, "param.lr": 0.1, "param.seed": 7 + REPEAT_SEED_STRIDE * r,
                         "param.repeat": r, "epsilon": eps * (1 + 0.001 * r), "acc_clean": acc})
    rows.append({"run_id": "dfail", "run": "dpsgd-2.0-3", "trainable": "dpsgd", "status": "FAILED",
                 "param.epsilon": 2.0, "param.lr": 0.1, "param.seed": 7 + 3 * REPEAT_SEED_STRIDE, "param.repeat": 3,
                 "acc_clean": 0.1})
    # pixeldp: one trial, its robustness parameter configured
    rows.append({"run_id": "p0", "run": "pixeldp-0", "trainable": "pixeldp", "status": "FINISHED",
                 "param.epsilon": 1.0, "param.attack_bound": 0.2, "param.seed": 0,
                 "robustness_epsilon": 0.24, "robustness_epsilon_config": 1.0, "acc_clean": 0.97})
    return pd.DataFrame(rows)


def test_aggregation_groups_by_configured_parameters_not_measured_values():
    from sweeps.report.data import aggregate

    agg = aggregate(_trials_frame()).set_index("label")
    assert sorted(agg.index) == ["dpsgd epsilon=1 lr=0.1", "dpsgd epsilon=2 lr=0.1",
                                 "pixeldp epsilon=1 attack_bound=0.2"]
    one = agg.loc["dpsgd epsilon=1 lr=0.1"]
    # the measured epsilon differs across repeats (1.0, 1.001, 1.002): still one group
    assert one["n"] == 3 and one["acc_clean.n"] == 3
    assert one["acc_clean"] == pytest.approx((0.80 + 0.82 + 0.87) / 3)
    assert one["acc_clean.sd"] == pytest.approx(math.sqrt(((0.80 - 0.83) ** 2 + (0.82 - 0.83) ** 2 + (0.87 - 0.83) ** 2) / 2))
    two = agg.loc["dpsgd epsilon=2 lr=0.1"]
    assert two["n"] == 3 and two["acc_clean"] == pytest.approx(0.92)  # the failed repeat is not averaged
    pix = agg.loc["pixeldp epsilon=1 attack_bound=0.2"]
    assert pix["n"] == 1 and math.isnan(pix["acc_clean.sd"])


def test_formatting_of_mean_sd_and_n():
    from sweeps.report.data import fmt_stat

    assert fmt_stat(0.83, 0.036056, 3) == "0.83 ± 0.036"
    assert fmt_stat(0.97, math.nan, 1) == "0.97"
    assert fmt_stat(0.9, 0.01, 2, of=3) == "0.9 ± 0.01 (2)"
    assert fmt_stat(math.nan, math.nan, 0) == ""


@pytest.fixture(scope="module")
def synthetic_sweep(tmp_path_factory):
    """A sweep in a fresh MLflow store: a parent run holding the spec's params (with a reference
    block) and the child runs of _trials_frame."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from sweeps.spec import spec_to_flat_params
    from trainables.tracking import TAG_PARENT, TAG_TRAINABLE

    raw = {"name": "rep", "common": {"train_size": 500, "test_size": 50},
           "trainables": [{"name": "dpsgd", "search": {"epsilon": [1.0, 2.0], "lr": 0.1}}],
           "search": {"num_samples": 3},
           "reference": {"citation": "A paper, Fig. 1", "note": "same units",
                         "points": [{"label": "eps 2", "where": {"trainable": "dpsgd", "epsilon": 2.0},
                                     "metrics": {"acc_clean": 0.95}},
                                    {"where": {"trainable": "dpsgd", "epsilon": 1.0}, "metrics": {"acc_clean": 0.8}}]}}
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("rep")
    parent = client.create_run(exp, tags={"dpsweep.kind": "sweep"}, run_name="sweep")
    client.log_batch(parent.info.run_id, params=[Param(k, v) for k, v in spec_to_flat_params(validate_spec(raw)).items()])
    for row in _trials_frame().to_dict("records"):
        run = client.create_run(exp, run_name=row["run"], tags={TAG_PARENT: parent.info.run_id,
                                                                 TAG_TRAINABLE: row["trainable"]})
        present = {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
        client.log_batch(run.info.run_id,
                         params=[Param(k[len("param."):], str(v)) for k, v in present.items() if k.startswith("param.")],
                         metrics=[Metric(k, float(v), 0, 0) for k, v in present.items()
                                  if not k.startswith("param.") and k not in ("run_id", "run", "trainable", "status")])
        client.set_terminated(run.info.run_id, row["status"])
    client.set_terminated(parent.info.run_id, "FINISHED")
    return uri


def test_report_shows_mean_sd_n_and_published_vs_measured(synthetic_sweep, tmp_path):
    from sweeps.report import make_report

    out = tmp_path / "report"
    text = make_report("rep", synthetic_sweep, out).read_text()
    # the trials table: one row per configuration, mean ± sd with n
    assert "| configuration | trainable | cfg.epsilon | n |" in text
    assert "| 3 repeats: dpsgd-1.0-0, dpsgd-1.0-1, dpsgd-1.0-2 | dpsgd | 1 | 3 |" in text
    assert "0.83 ± 0.036" in text and "0.92 ± 0.026" in text
    # published vs measured
    assert "## Published vs measured" in text and "A paper, Fig. 1" in text and "Units: same units." in text
    assert "| eps 2 | acc_clean | 0.95 | 0.92 ± 0.026 (n=3) | -0.03 |" in text
    assert "| trainable=dpsgd, epsilon=1.0 | acc_clean | 0.8 | 0.83 ± 0.036 (n=3) | 0.03 |" in text
    # PixelDP is no privacy mechanism: not in the privacy range, plotted against its configured parameter
    assert "Per-trial epsilon: 1 to 2.004" in text and "`pixeldp` reports no privacy epsilon" in text
    assert (out / "robustness_accuracy.png").exists() and (out / "pareto_accuracy.png").exists()
    agg = (out / "trials_aggregated.csv").read_text().splitlines()
    assert agg[0].startswith("group,trainable") and "acc_clean.sd" in agg[0] and len(agg) == 4


def test_published_points_are_drawn_on_the_matching_plot(synthetic_sweep, tmp_path, monkeypatch):
    from sweeps.report import plots as rp
    from sweeps.report import make_report

    drawn = []
    real = rp._stars
    monkeypatch.setattr(rp, "_stars", lambda ax, points, done: (drawn.extend(points), real(ax, points, done)))
    make_report("rep", synthetic_sweep, tmp_path / "report")
    # on the privacy Pareto plot, at the matched trials' mean epsilon
    assert ((1.0 + 1.001 + 1.002) / 3, 0.8, "trainable=dpsgd, epsilon=1.0") in [(pytest.approx(x), y, t) for x, y, t in drawn]
    assert any(t == "eps 2" and y == 0.95 for _, y, t in drawn)


def test_published_points_stay_off_figures_without_their_trials(synthetic_sweep, tmp_path, monkeypatch):
    from sweeps.report import plots as rp

    drawn = []
    real = rp._stars
    monkeypatch.setattr(rp, "_stars", lambda ax, points, done: (drawn.append(list(points)), real(ax, points, done)))
    from sweeps.report.data import load_sweep, reference_rows

    sweep = load_sweep("rep", synthetic_sweep)
    refs = reference_rows(sweep.trials, sweep.reference)
    assert rp.plot_robustness(sweep.trials, "acc_clean", tmp_path / "r.png", "acc", refs)
    # the dpsgd points are not drawn on PixelDP's figure (drawn with x NaN are skipped by _stars)
    assert all(not math.isfinite(x) for x, _, _ in drawn[-1])
