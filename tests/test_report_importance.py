"""The report of a sweep with repeats and a selection split (issue 34, points 1, 2, 3 and 7): the best
configuration with mean ± sd and n, the runner-up and the significance statement, the held-out
headline, which swept key matters (Optuna's fANOVA importances) and the parallel-coordinates figure
of the swept keys against the search metric."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def _trials(effect: str, n_seeds: int = 2, seed: int = 0) -> pd.DataFrame:
    """A 3 x 3 grid over lr and max_grad_norm with ``n_seeds`` repeats; acc_clean depends on one key."""
    rng = np.random.default_rng(seed)
    rows = []
    for lr in (0.01, 0.1, 1.0):
        for c in (0.1, 1.0, 10.0):
            for s in range(n_seeds):
                x = np.log10(lr) if effect == "lr" else np.log10(c)
                rows.append({"status": "FINISHED", "trainable": "dpsgd", "run": f"r{len(rows)}", "param.lr": lr,
                             "param.max_grad_norm": c, "param.seed": s, "acc_clean": 0.8 + 0.05 * x
                             + 0.002 * rng.normal()})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("effect, other", [("lr", "max_grad_norm"), ("max_grad_norm", "lr")])
def test_importance_names_the_key_that_drives_the_metric(effect, other):
    from sweeps.report.importance import parameter_importances

    imp, n = parameter_importances(_trials(effect), "acc_clean", "max")
    assert n == 18 and set(imp) == {"lr", "max_grad_norm"}      # seed is not a swept key
    assert imp[effect] > 0.8 and imp[other] < 0.2, imp          # and the other way round: the negative control
    assert sum(imp.values()) == pytest.approx(1.0)
    assert parameter_importances(_trials(effect).head(3), "acc_clean", "max") == ({}, 3)  # too few trials


# --------------------------------------------------------------------------- the whole report


@pytest.fixture()
def sweep_with_repeats(tmp_path):
    """A finished sweep in MLflow: epsilon {1, 8} x max_grad_norm {0.5, 1} x 3 seeds, with a
    test_half selection split; (epsilon 8, C 1) has the luckiest seed, (epsilon 8, C 0.5) the best mean."""
    from mlflow.tracking import MlflowClient

    from trainables.tracking import TAG_PARENT, TAG_TRAINABLE

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("study", artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(exp, run_name="study-1", tags={"dpsweep.kind": "sweep"}).info.run_id
    for k, v in {"search.metric": "acc_clean", "search.mode": "max", "selection.split": "test_half",
                 "selection.statistic": "mean"}.items():
        client.log_param(parent, k, v)
    scores = {(8.0, 1.0): [0.9555, 0.9421, 0.9488], (8.0, 0.5): [0.9530, 0.9520, 0.9525],
              (1.0, 1.0): [0.90, 0.91, 0.905], (1.0, 0.5): [0.89, 0.90, 0.895]}
    for (eps, c), values in scores.items():
        for s, v in enumerate(values):
            run = client.create_run(exp, run_name=f"dpsgd-eps{eps:g}-C{c:g}-s{s}",
                                    tags={TAG_PARENT: parent, TAG_TRAINABLE: "dpsgd"}).info.run_id
            for k, p in {"epsilon": eps, "max_grad_norm": c, "seed": s, "repeat": s}.items():
                client.log_param(run, k, p)
            for k, m in {"acc_clean": v, "heldout_acc_clean": v - 0.003, "epsilon": eps, "delta": 1e-5}.items():
                client.log_metric(run, k, m)
            client.set_terminated(run, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return uri


def test_report_names_the_best_configuration_with_its_spread_and_held_out_score(sweep_with_repeats, tmp_path):
    from sweeps.report import make_report

    text = make_report("study", sweep_with_repeats, tmp_path / "r").read_text()
    best = text[text.index("## Best configuration"):].split("\n## ")[0]
    assert "**dpsgd epsilon=8 max_grad_norm=0.5**: acc_clean = 0.9525 ± 0.0005 (mean ± sd over n = 3 seeds)" in best
    assert "Runner-up: dpsgd epsilon=8 max_grad_norm=1: acc_clean = 0.9488 ± 0.0067" in best
    assert "not significantly different over the seeds (paired t-test on 3 matching seeds" in best
    assert "**Headline: held-out acc_clean = 0.9495 ± 0.0005 (n = 3) on the test images selection did not read**" in best
    imp = text[text.index("## Which swept key matters"):].split("\n## ")[0]
    assert "| `epsilon` |" in imp and "| `max_grad_norm` |" in imp and "over the 12 finished trials" in imp
    assert (tmp_path / "r" / "parallel_coordinates.png").is_file() and (tmp_path / "r" / "parallel_coordinates.pdf").is_file()
    assert "![Swept keys against the search metric](parallel_coordinates.png)" in text


def test_parallel_figure_axes_are_the_swept_keys_and_the_search_metric(tmp_path, monkeypatch):
    from sweeps.report import parallel

    seen = {}
    real = parallel.plot_parallel

    def spy(trials, metric, path, best_group=None):
        import matplotlib.pyplot as plt

        saved = plt.Figure.savefig

        def grab(fig, *a, **k):
            seen["labels"] = [t.get_text() for t in fig.axes[0].get_xticklabels()]
            return saved(fig, *a, **k)

        monkeypatch.setattr(plt.Figure, "savefig", grab)
        return real(trials, metric, path, best_group)

    df = _trials("lr")
    df["run_id"] = df["run"]
    assert spy(df, "acc_clean", tmp_path / "p.png")
    assert seen["labels"] == ["lr", "max_grad_norm", "acc_clean\n(search.metric)"]
    assert not real(df.drop(columns=["param.lr", "param.max_grad_norm"]), "acc_clean", tmp_path / "q.png")
