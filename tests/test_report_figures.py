"""Report figures a reviewer accepts (issue 34, point 6): an epsilon axis ticked at the swept values
(epsilon 1, 3, 8 used to be ticked 1, 2, 5), the y range fitted to the data with a margin (not 0..1),
neutral labels outside a DPAL study with every attack size naming its norm and domain, the same
conventions in every figure, the best configuration marked, and no near-duplicate figure in a
one-mechanism sweep."""

from __future__ import annotations

import re

import pandas as pd
import pytest

EPS = (1.0, 3.0, 8.0)


def _acc(eps, mgn):
    return 0.62 + 0.03 * eps - (0.05 if mgn == 1.0 else 0.0)


def _trials(trainable="dpsgd"):
    rows = []
    for eps in EPS:
        for mgn in (0.1, 1.0):
            a = _acc(eps, mgn)
            rows.append({"run_id": f"r{eps}{mgn}", "run": f"r{eps}-{mgn}", "trainable": trainable, "status": "FINISHED",
                         "param.epsilon": eps, "param.max_grad_norm": mgn, "param.attack_norm": "linf",
                         "acc_clean": a, "epsilon": eps, "acc_pgd_0.1": a - 0.2, "acc_fgsm_0.1": a - 0.1,
                         "acc_pgd_0.2": a - 0.4, "acc_fgsm_0.2": a - 0.3})
    return pd.DataFrame(rows)


def _capture(monkeypatch):
    from sweeps.report import plots as rp

    figs = {}
    real = rp._save

    def save(fig, axes, path, **kw):
        real(fig, axes, path, **kw)
        figs[path.name] = fig

    monkeypatch.setattr(rp, "_save", save)
    return figs


def _ticks(ax, minor=False):
    return [t.get_text() for t in (ax.get_xticklabels(minor=minor)) if t.get_text()]


def test_epsilon_ticks_at_the_swept_values_and_a_fitted_y_range(tmp_path, monkeypatch):
    from sweeps.report import plots as rp

    figs = _capture(monkeypatch)
    assert rp.plot_accuracy_vs_epsilon(_trials(), "acc_clean", tmp_path / "a.png", "clean accuracy")
    ax = figs["a.png"].axes[0]
    assert ax.get_xscale() == "log"
    assert _ticks(ax) == ["1", "3", "8"] and _ticks(ax, minor=True) == []
    lo, hi = ax.get_ylim()
    top, bottom = _acc(8.0, 0.1), _acc(1.0, 1.0)           # 0.86 and 0.60
    assert bottom - 0.05 < lo < bottom and top < hi < top + 0.05, (lo, hi)


def test_epsilon_ticks_negative_control():
    """Decade ticks (matplotlib's, and the report's before) miss the swept 3 and 8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sweeps.report.plots import epsilon_axis, plain_log_axis

    fig, ax = plt.subplots()
    ax.plot(EPS, [0.6, 0.7, 0.8])
    ax.set_xscale("log")
    plain_log_axis(ax.xaxis)
    fig.canvas.draw()
    shown = _ticks(ax) + _ticks(ax, minor=True)
    assert "3" not in shown and "8" not in shown and "2" in shown
    epsilon_axis(ax, EPS, "epsilon (configured)")
    fig.canvas.draw()
    assert _ticks(ax) == ["1", "3", "8"]
    plt.close(fig)


def test_neutral_labels_with_norm_and_domain_outside_a_dpal_study(tmp_path, monkeypatch):
    from sweeps.report import plots as rp

    figs = _capture(monkeypatch)
    assert rp.plot_accuracy_vs_epsilon_per_attack(_trials(), 0.1, tmp_path / "f2.png")
    assert rp.plot_accuracy_vs_size_per_attack(_trials(), tmp_path / "f4.png")
    f2, f4 = figs["f2.png"].axes, figs["f4.png"].axes
    titles = [ax.get_title() for ax in f2]
    assert titles == ["FGSM, l-inf size 0.1 ([-1, 1] domain)", "PGD, l-inf size 0.1 ([-1, 1] domain)"]
    assert f2[0].get_ylabel() == "accuracy under attack (mean ± sd)"
    assert f4[0].get_xlabel() == "attack size (l-inf, [-1, 1] domain)"
    for ax in (*f2, *f4):
        words = " ".join([ax.get_title(), ax.get_xlabel(), ax.get_ylabel()])
        assert "conventional" not in words and "MadryEtAl" not in words and "mu_a" not in words
        assert ax.get_ylim() != (0.0, 1.02)
    assert _ticks(f2[0]) == ["1", "3", "8"]
    # control: a study of the DPAL paper keeps the paper's words
    assert rp.plot_accuracy_vs_epsilon_per_attack(_trials("dpal_sound"), 0.1, tmp_path / "d2.png")
    d2 = figs["d2.png"].axes
    assert d2[1].get_title().startswith("MadryEtAl (PGD)") and d2[0].get_ylabel().startswith("conventional accuracy")


def test_the_best_configuration_is_marked(tmp_path, monkeypatch):
    from sweeps.report import plots as rp

    figs = _capture(monkeypatch)
    trials = _trials()
    best = rp.best_configuration(trials, "acc_clean", "max")
    assert best["param.epsilon"] == 8.0 and best["param.max_grad_norm"] == 0.1
    assert rp.plot_pareto(trials, "acc_clean", tmp_path / "p.png", "clean accuracy", best=best)
    ax = figs["p.png"].axes[0]
    rings = [c for c in ax.collections if c.get_label().startswith("best configuration by acc_clean")]
    assert len(rings) == 1 and rings[0].get_offsets().tolist() == [[8.0, pytest.approx(_acc(8.0, 0.1))]]
    # min: the worst of these is the best
    low = rp.best_configuration(trials, "acc_clean", "min")
    assert (low["param.epsilon"], low["param.max_grad_norm"]) == (1.0, 1.0)


def _log_sweep(tmp_path, trials, trainable="dpsgd"):
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from trainables.tracking import TAG_PARENT, TAG_TRAINABLE

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("fig", artifact_location=str(tmp_path / "art"))
    parent = client.create_run(exp, tags={"dpsweep.kind": "sweep"}, run_name="s").info.run_id
    client.log_batch(parent, params=[Param("search.metric", "acc_clean"), Param("search.mode", "max")])
    for r in trials.to_dict("records"):
        run = client.create_run(exp, run_name=r["run"], tags={TAG_PARENT: parent, TAG_TRAINABLE: trainable}).info.run_id
        client.log_batch(run, params=[Param(k[len("param."):], str(v)) for k, v in r.items() if k.startswith("param.")],
                         metrics=[Metric(k, float(v), 0, 0) for k, v in r.items()
                                  if not k.startswith("param.") and isinstance(v, float)])
        client.set_terminated(run, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return uri


def test_a_one_mechanism_sweep_has_the_same_conventions_in_every_figure_and_no_duplicates(tmp_path, monkeypatch):
    from sweeps.report import make_report

    figs = _capture(monkeypatch)
    uri = _log_sweep(tmp_path, _trials())
    text = make_report("fig", uri, tmp_path / "r").read_text()
    assert "pareto_accuracy.png" in figs and "fig2_accuracy_vs_epsilon.png" in figs
    assert "accuracy_vs_epsilon.png" not in figs  # the Pareto figure already draws it for one mechanism
    for name, fig in figs.items():
        for ax in fig.axes:
            if "epsilon" in ax.get_xlabel():
                assert _ticks(ax) == ["1", "3", "8"], (name, _ticks(ax))
            if "accuracy" in ax.get_ylabel():  # (not the parallel coordinates, whose axes are normalised)
                assert 0.0 < ax.get_ylim()[0] and ax.get_ylim()[1] < 1.0, (name, ax.get_ylim())  # data 0.18..0.86
            words = " ".join([ax.get_title(), ax.get_xlabel(), ax.get_ylabel()])
            assert "conventional" not in words and "MadryEtAl" not in words, (name, words)
    assert "best configuration by acc_clean (mean over repeats)" in [c.get_label() for c in figs["pareto_accuracy.png"].axes[0].collections]
    titles = re.findall(r"^## (.*)$", text, re.M)
    assert not any("DPAL paper" in t or "onventional" in t for t in titles), titles
    assert any(t.startswith("Accuracy against epsilon under each attack (size 0.2, l-inf, [-1, 1] domain)")
               for t in titles), titles


def test_a_legend_names_a_series_by_what_varies_within_its_trainable():
    """Two trainables whose defaults differ (lr 0.5 against 0.05, norm linf against l2) but which each sweep
    only max_grad_norm / attack_bound: the legend's series say the trainable and its own swept key, not the
    keys that only tell the trainables apart (those made a multi-mechanism sweep's legends overflow the
    figure)."""
    from sweeps.report.data import aggregate
    from sweeps.report.plots import _series

    a = _trials("dpsgd").assign(**{"param.lr": 0.5})
    b = _trials("dpal_sound").assign(**{"param.lr": 0.05, "param.attack_norm": "l2"})
    df = pd.concat([a, b], ignore_index=True)
    names = set(_series(df, aggregate(df, ["epsilon", "acc_clean"]))["_series"])
    assert names == {f"{t} max_grad_norm={m:g}" for t in ("dpsgd", "dpal_sound") for m in (0.1, 1.0)}
    # the table keeps every swept key a row has (its label is the configuration, not a legend entry)
    assert "lr=0.5" in aggregate(df)["label"].iloc[0]


def test_pareto_draws_the_non_private_baseline_as_a_labelled_reference_line(tmp_path, monkeypatch):
    """Issue 51.4: the baseline (infinite epsilon) has no place on the epsilon axis and used to be
    dropped; it is a horizontal line at its mean score, labelled, inside the fitted y range."""
    from sweeps.report import plots as rp

    figs = _capture(monkeypatch)
    base = pd.DataFrame([{"run_id": f"b{s}", "run": f"b{s}", "trainable": "dpsgd", "status": "FINISHED",
                          "param.seed": s, "param.attack_norm": "linf", "acc_clean": v, "epsilon": float("inf")}
                         for s, v in enumerate((0.97, 0.98, 0.99))])
    trials = pd.concat([_trials(), base], ignore_index=True)
    assert rp.plot_pareto(trials, "acc_clean", tmp_path / "p.png", "clean accuracy")
    ax = figs["p.png"].axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    line = [t for t in legend if t.startswith("non-private baseline")]
    assert line == ["non-private baseline: 0.98 ± 0.01 (n=3)"], legend
    ref = [ln for ln in ax.get_lines() if ln.get_label().startswith("non-private baseline")]
    assert len(ref) == 1 and ref[0].get_ydata()[0] == pytest.approx(0.98)
    lo, hi = ax.get_ylim()
    assert lo < 0.98 < hi and hi < 1.02
    assert _ticks(ax) == ["1", "3", "8"]              # the baseline adds no epsilon tick


def test_a_constant_is_its_value_not_a_rounding_spread():
    from sweeps.report.data import fmt_stat

    assert fmt_stat(1.0, 1.4e-16, 3) == "1" and fmt_stat(0.0, 1e-20, 3) == "0"
    assert fmt_stat(0.5, 0.01, 3) == "0.5 ± 0.01" and fmt_stat(0.5, 0.01, 3, of=4) == "0.5 ± 0.01 (3)"
