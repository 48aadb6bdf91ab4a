"""The report as a paper can use it (issue 24, points 5 and 7): the best trial with its caveat,
privacy parameters in the table, a series per value of the other swept keys in every figure with
plain decimal log ticks and a vector copy, several sweeps compared in one report, and what else
the experiment holds."""

from __future__ import annotations

import re

import pytest

PRIV = {"noise_multiplier": 1.1, "sampling_rate": 0.004, "steps": 1500.0}


def _log_sweep(client, exp, name, trials, start):
    """A parent run (spec params search.metric/mode, metric trials) and its finished child runs."""
    from mlflow.entities import Metric, Param

    from trainables.tracking import TAG_PARENT, TAG_TRAINABLE, TAG_TRIAL

    parent = client.create_run(exp, tags={"dpsweep.kind": "sweep"}, run_name=name, start_time=start).info.run_id
    client.log_batch(parent, params=[Param("search.metric", "acc_clean"), Param("search.mode", "max")],
                     metrics=[Metric("trials", float(len(trials)), 0, 0)])
    for i, (params, metrics) in enumerate(trials):
        run = client.create_run(exp, run_name=f"{name}-{i}", start_time=start + i + 1,
                                tags={TAG_PARENT: parent, TAG_TRAINABLE: "dpsgd", TAG_TRIAL: f"{name}{i}"}).info.run_id
        client.log_batch(run, params=[Param(k, str(v)) for k, v in params.items()],
                         metrics=[Metric(k, float(v), 0, 0) for k, v in metrics.items()])
        client.set_terminated(run, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return parent


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('paper')}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("paper")
    grid = []
    for eps in (0.5, 2.0, 8.0):
        for mgn in (0.1, 1.0):
            acc = 0.6 + 0.04 * eps - (0.1 if mgn == 1.0 else 0.0)
            grid.append(({"epsilon": eps, "max_grad_norm": mgn, "lr": 0.5, "seed": 0},
                         {"acc_clean": acc, "epsilon": eps, "epsilon_pld": eps * 0.9, "delta": 1e-5,
                          "not_learned": 0.0, **PRIV}))
    a = _log_sweep(client, exp, "gridA", grid, 1_000_000)
    b = _log_sweep(client, exp, "newB", [({"epsilon": e, "max_grad_norm": 1.0, "lr": 2.0, "seed": 0},
                                          {"acc_clean": 0.5 + 0.02 * e, "epsilon": e, "delta": 1e-5, **PRIV})
                                         for e in (1.0, 4.0)], 2_000_000)
    return uri, a, b


def test_latest_sweep_report_says_what_else_the_experiment_holds(store, tmp_path, capsys):
    from sweeps.report import make_report

    uri, a, _ = store
    text = make_report("paper", uri, tmp_path / "r").read_text()
    assert "newB" in text.splitlines()[2]  # the latest sweep is reported
    note = re.search(r"This experiment also holds 1 other sweep: (.*)", text).group(1)
    assert f"gridA ({a}, 6 trials, " in note and "add --run ID" in note
    assert "also holds 1 other sweep" in capsys.readouterr().err


def test_best_trial_is_named_with_its_caveat_and_the_compare_view(store, tmp_path):
    from sweeps.report import make_report

    uri, a, _ = store
    text = make_report("paper", uri, tmp_path / "r", parent_run_id=a).read_text()
    best = text[text.index("## Best trial"):].split("\n## ")[0]
    # the best acc_clean: epsilon 8, max_grad_norm 0.1 (0.92)
    assert "`search.metric` = `acc_clean` (max): **`gridA-4`** (dpsgd epsilon=8 max_grad_norm=0.1)" in best
    assert "acc_clean = 0.92" in best and "not private" in best and "best of 6 trials" in best
    assert "#/compare-runs?runs=%5B%22" in best


def test_trials_table_carries_the_privacy_parameters_and_the_swept_keys(store, tmp_path):
    from sweeps.report import make_report

    uri, a, _ = store
    text = make_report("paper", uri, tmp_path / "r", parent_run_id=a).read_text()
    header = next(line for line in text.splitlines() if line.startswith("| configuration |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[:6] == ["configuration", "trainable", "cfg.epsilon", "cfg.max_grad_norm", "n", "epsilon (RDP)"]
    for name in ("epsilon_pld", "delta", "sigma", "q", "steps", "acc_clean"):
        assert name in cols, (name, cols)
    row = next(line for line in text.splitlines() if line.startswith("| gridA-0 |"))
    assert "| 1.1 | 0.004 | 1500 |" in row


def _capture(monkeypatch):
    from sweeps.report import plots as rp

    figs = {}
    real = rp._save

    def save(fig, axes, path, **kw):
        real(fig, axes, path, **kw)  # draws the figure (tick labels) and writes PNG + PDF
        figs[path.name] = fig

    monkeypatch.setattr(rp, "_save", save)
    return figs


def _labels(ax):
    return [t.get_text() for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True) if t.get_text()]


def test_figures_draw_a_series_per_other_swept_key_with_plain_ticks_and_a_pdf(store, tmp_path, monkeypatch):
    from sweeps.report import make_report

    figs = _capture(monkeypatch)
    uri, a, _ = store
    out = tmp_path / "r"
    text = make_report("paper", uri, out, parent_run_id=a).read_text()
    # one mechanism: accuracy against configured epsilon would repeat the Pareto figure (issue 34.6)
    assert "accuracy_vs_epsilon.png" not in figs and not (out / "accuracy_vs_epsilon.png").exists()
    for name in ("pareto_accuracy",):
        ax = figs[f"{name}.png"].axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any("max_grad_norm=0.1" in t for t in legend) and any("max_grad_norm=1" in t for t in legend), legend
        markers = {line.get_marker() for line in ax.get_lines() if line.get_marker() not in (None, "None", "")}
        assert len(markers) >= 2  # colour and marker per series
        assert ax.get_xscale() == "log"
        ticks = _labels(ax)
        assert ticks and all(re.fullmatch(r"[0-9.]+", t) for t in ticks), ticks  # no 2x10^0
        assert (out / f"{name}.pdf").read_bytes()[:5] == b"%PDF-"
        assert f"[{name}.pdf]({name}.pdf)" in text


def test_plain_log_ticks_negative_control():
    """matplotlib's default on a log axis under two decades writes minor ticks as 2x10^0; the report's
    axis helper writes 2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sweeps.report.plots import plain_log_axis

    fig, ax = plt.subplots()
    ax.plot([0.5, 8.0], [0, 1])
    ax.set_xscale("log")
    fig.canvas.draw()
    assert any("times" in t or "^" in t for t in _labels(ax))
    plain_log_axis(ax.xaxis)
    fig.canvas.draw()
    assert "2" in _labels(ax) and "0.5" in _labels(ax) and all(re.fullmatch(r"[0-9.]+", t) for t in _labels(ax))
    plt.close(fig)


@pytest.mark.parametrize("how", ["append", "comma"])
def test_several_sweeps_compare_in_one_report(store, tmp_path, how, monkeypatch):
    from sweeps.cli import main

    figs = _capture(monkeypatch)
    uri, a, b = store
    out = tmp_path / "r"
    runs = ["--run", a, "--run", b] if how == "append" else ["--run", f"{a},{b}"]
    assert main(["report", "paper", "--tracking-uri", uri, "--out", str(out), *runs]) == 0
    text = (out / "report.md").read_text()
    assert "2 sweeps compared" in text and "also holds" not in text
    assert "## Privacy of the sweep `gridA`" in text and "## Privacy of the sweep `newB`" in text
    header = next(line for line in text.splitlines() if line.startswith("| configuration |"))
    assert "| sweep |" in header
    assert text.count("| gridA |") == 6 and text.count("| newB |") == 2
    legend = [t.get_text() for t in figs["pareto_accuracy.png"].axes[0].get_legend().get_texts()]
    assert any("sweep=gridA" in t for t in legend) and any("sweep=newB" in t for t in legend)


def test_loss_near_chance_is_a_hint_in_the_table_not_a_verdict():
    """Issue 24, point 8: an epsilon-1 configuration at 32.5% whose noisy loss sat near ln 10 is
    not marked as not learned; the table carries the hint. Negative control: a chance-level one is."""
    import pandas as pd

    from sweeps.report.page import aggregated_rows

    trials = pd.DataFrame([
        {"run_id": "a", "run": "a", "trainable": "dpsgd", "status": "FINISHED", "param.epsilon": 1.0,
         "acc_clean": 0.325, "not_learned": 0.0, "loss_near_chance": 1.0},
        {"run_id": "b", "run": "b", "trainable": "dpsgd", "status": "FINISHED", "param.epsilon": 0.01,
         "acc_clean": 0.10, "not_learned": 1.0, "loss_near_chance": 1.0},
        {"run_id": "c", "run": "c", "trainable": "dpsgd", "status": "FINISHED", "param.epsilon": 8.0,
         "acc_clean": 0.95, "not_learned": 0.0, "loss_near_chance": 0.0}])
    rows = {r["configuration"]: r for r in aggregated_rows(trials)[0]}
    assert rows["a"]["learned"] == "hint: train loss near ln K in 1/1"
    assert rows["b"]["learned"].startswith("! 1/1 did not learn")
    assert "learned" not in rows["c"]


def test_fig6_layout_keeps_the_other_swept_keys_apart(tmp_path, monkeypatch):
    """Fig. 6's certified-accuracy curves used to average every trial of a (mechanism, epsilon) pair,
    pooling two clipping norms into one line; now a line per value of the other swept keys."""
    import pandas as pd

    from sweeps.report import plots as rp
    from sweeps.report.data import Sweep

    figs = _capture(monkeypatch)
    rows, tables = [], {}
    for i, mgn in enumerate((0.1, 1.0)):
        rows.append({"run_id": f"r{i}", "run": f"r{i}", "trainable": "secure_sgd", "status": "FINISHED",
                     "param.epsilon": 2.0, "param.max_grad_norm": mgn, "epsilon": 2.0, "acc_clean": 0.9})
        tables[(f"r{i}", "native")] = pd.DataFrame({"label": [1, 2, 3], "prediction": [1, 2, 0],
                                                   "certified_size": [0.1 * (i + 1), 0.3, 0.0]})
    sweep = Sweep(None, "e", "sqlite://", None, pd.DataFrame(rows), tables)
    assert rp.plot_certified_vs_size_by_mechanism(sweep, tmp_path / "fig6.png")
    legend = [t.get_text() for t in figs["fig6.png"].axes[0].get_legend().get_texts()]
    assert len(legend) == 2 and any("max_grad_norm=0.1" in t for t in legend) and any("max_grad_norm=1" in t for t in legend)
    assert (tmp_path / "fig6.pdf").exists()


def test_fig6_layout_draws_the_baseline_as_one_series(tmp_path, monkeypatch):
    """Issue 51.4: a non-private baseline's epsilon (inf, NaN when configured) used to key each of its
    repeats apart (NaN != NaN): three n=1 series; now one 'non-private (n=3)' line."""
    import pandas as pd

    from sweeps.report import plots as rp
    from sweeps.report.data import Sweep

    figs = _capture(monkeypatch)
    rows, tables = [], {}
    for i, eps in enumerate((None, None, None, 2.0)):
        rows.append({"run_id": f"r{i}", "run": f"r{i}", "trainable": "dpsgd", "status": "FINISHED",
                     "param.epsilon": eps, "param.seed": i, "epsilon": float("inf") if eps is None else eps,
                     "acc_clean": 0.9})
        tables[(f"r{i}", "native")] = pd.DataFrame({"label": [1, 2, 3], "prediction": [1, 2, 0],
                                                   "certified_size": [0.1 * (i + 1), 0.3, 0.0]})
    sweep = Sweep(None, "e", "sqlite://", None, pd.DataFrame(rows), tables)
    assert rp.plot_certified_vs_size_by_mechanism(sweep, tmp_path / "fig6.png")
    legend = [t.get_text() for t in figs["fig6.png"].axes[0].get_legend().get_texts()]
    assert len(legend) == 2 and sum("non-private" in t and "(n=3)" in t for t in legend) == 1, legend
