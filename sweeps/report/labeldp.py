"""The label-DP figure of ``dpsweep report`` (the source document's trade-off figure, extended).

``labeldp_figures(trials, out)`` draws, when the sweep has ``label_dp`` trials,
``label_dp_accuracy_mse_vs_epsilon.png`` (and its PDF): regression MSE against epsilon (log-log) and
classification accuracy against epsilon (log x), one line per mechanism (Laplace, randomized
response, Laplace with clamp-and-round), each task's non-private baseline as a dashed horizontal
line, and on the accuracy panel the analytic probability that a training label is kept at each
epsilon (dotted; ``dpmech.label_dp.release.analytic_keep_prob``) beside the measured keep rates.

``plot_labeldp(rows, path)`` draws the same figure from plain records (the benchmark uses it);
``rows_from_benchmark(json)`` turns benchmarks/results/labeldp_mnist_full.json into such records, and
``python -m sweeps.report.labeldp RESULT.json OUT.png`` draws it (every method of issue 16: Laplace,
RR, LP-1ST, LP-2ST, with the non-private baselines).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np
from sweeps.report.data import as_number as _num

FIGURE = "label_dp_accuracy_mse_vs_epsilon.png"
# MLflow's SQL store writes +inf as the largest float; anything this large is "no guarantee"
_INF = 1e300
_STYLE = {("laplace", "argmax"): ("tab:blue", "o", "Laplace (one-hot, argmax)"),
          ("laplace", "clamp_round"): ("tab:green", "s", "Laplace (clamp-and-round)"),
          ("rr", "argmax"): ("tab:orange", "^", "randomized response"),
          ("lp1st", "argmax"): ("tab:brown", "v", "LP-1ST (RR with uniform prior)"),
          ("lp2st", "argmax"): ("tab:purple", "D", "LP-2ST (RR with prior, 2 stages)"),
          ("alibi", "argmax"): ("tab:cyan", "P", "ALIBI (Laplace, Bayesian soft labels)")}
# no closed form: LP-2ST's keep probability depends on the stage-1 model (measured keep rates only);
# LP-1ST's is RR's and ALIBI's (of the noisy vector's argmax) Laplace's (the same dotted curves)
_NO_CURVE = {"lp1st", "lp2st", "alibi"}
_REG_STYLE = {"laplace": ("tab:red", "o", "Laplace (clamped to [0, 9])"),
              "rr": ("tab:purple", "^", "randomized response")}




def rows_from_trials(trials) -> list[dict]:
    """One record per finished ``label_dp`` trial of the report's trials table."""
    if trials is None or trials.empty or "trainable" not in trials:
        return []
    df = trials[trials["trainable"] == "label_dp"]
    rows = []
    for _, r in df.iterrows():
        if not math.isfinite(_num(r.get("acc_clean"))):
            continue
        eps = _num(r.get("param.epsilon"))
        mech = r.get("param.mechanism", "laplace")
        rows.append({"task": r.get("param.task", "classification"), "mechanism": mech,
                     "postprocess": r.get("param.postprocess", "argmax") or "argmax",
                     "epsilon": None if mech == "none" or not math.isfinite(eps) or eps >= _INF else eps,
                     "acc_clean": _num(r.get("acc_clean")), "mse": _num(r.get("mse")),
                     "label_keep_rate": _num(r.get("label_keep_rate"))})
    return rows


def labeldp_figures(trials, out: Path) -> list[Path]:
    """The report's label-DP figures (an empty list when the sweep has no label_dp results)."""
    rows = rows_from_trials(trials)
    path = Path(out) / FIGURE
    return [path] if plot_labeldp(rows, path) else []


def _mean_by_epsilon(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Configured epsilons, the mean of ``key`` over the trials at each (its repeats: the rows
    are already one mechanism and post-processing), and the sample sd (0 for one trial)."""
    acc: dict[float, list[float]] = defaultdict(list)
    for r in rows:
        if r["epsilon"] is not None and math.isfinite(r.get(key, math.nan)):
            acc[r["epsilon"]].append(r[key])
    eps = np.array(sorted(acc))
    sd = np.array([np.std(acc[e], ddof=1) if len(acc[e]) > 1 else 0.0 for e in eps])
    return eps, np.array([np.mean(acc[e]) for e in eps]), sd


def _baseline(rows: list[dict], task: str, key: str) -> float:
    vals = [r[key] for r in rows if r["task"] == task and r["epsilon"] is None and math.isfinite(r.get(key, math.nan))]
    return float(np.mean(vals)) if vals else math.nan


def plot_labeldp(rows: list[dict], path: Path, num_classes: int = 10) -> bool:
    """Draw the figure from records {task, mechanism, postprocess, epsilon (None = baseline),
    acc_clean, mse, label_keep_rate}; False when there is nothing to draw."""
    from dpmech.label_dp.release import analytic_keep_prob

    cls = [r for r in rows if r["task"] == "classification"]
    reg = [r for r in rows if r["task"] == "regression" and math.isfinite(r.get("mse", math.nan))]
    private = [r["epsilon"] for r in rows if r["epsilon"] is not None]
    if not cls and not reg:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = (min(private), max(private)) if private else (0.01, 100.0)
    lo, hi = (lo / 1.5, hi * 1.5) if lo < hi else (lo / 10, hi * 10)
    panels = [t for t, rs in (("regression", reg), ("classification", cls)) if rs]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), dpi=120, squeeze=False)
    for ax, task in zip(axes[0], panels):
        if task == "regression":
            for mech, (color, marker, label) in _REG_STYLE.items():
                e, m, sd = _mean_by_epsilon([r for r in reg if r["mechanism"] == mech], "mse")
                if len(e):
                    ax.errorbar(e, m, yerr=sd, marker=marker, color=color, lw=1.8, capsize=2, label=label)
            base = _baseline(reg, "regression", "mse")
            if math.isfinite(base):
                ax.hlines(base, lo, hi, colors="k", linestyles="--", label=f"non-private baseline {base:.4f}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_ylabel("test MSE (regression)")
        else:
            grid = np.logspace(math.log10(lo), math.log10(hi), 80)
            for (mech, post), (color, marker, label) in _STYLE.items():
                sel = [r for r in cls if r["mechanism"] == mech and r["postprocess"] == post]
                e, a, sd = _mean_by_epsilon(sel, "acc_clean")
                if not len(e):
                    continue
                ax.errorbar(e, a, yerr=sd, marker=marker, color=color, lw=1.8, capsize=2,
                            label=f"{label}: test accuracy (mean ± sd)")
                ek, k, _ = _mean_by_epsilon(sel, "label_keep_rate")
                if len(ek):
                    ax.scatter(ek, k, marker="x", color=color, s=22, zorder=3)
                if mech in _NO_CURVE:
                    continue
                curve = [analytic_keep_prob(mech, float(g), num_classes, postprocess=post) for g in grid]
                ax.plot(grid, curve, ls=":", color=color, lw=1.4, label=f"{label}: P(label kept), analytic (x: measured)")
            base = _baseline(cls, "classification", "acc_clean")
            if math.isfinite(base):
                ax.hlines(base, lo, hi, colors="k", linestyles="--", label=f"non-private baseline {base:.4f}")
            ax.axhline(1.0 / num_classes, color="grey", lw=0.8, alpha=0.6)
            ax.set_xscale("log")
            ax.set_ylim(0, 1.02)
            ax.set_ylabel("test accuracy (classification)")
        ax.set_xlim(lo, hi)
        ax.set_xlabel("epsilon (label DP, delta = 0)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("Label DP on the training labels: utility against epsilon (labels released once per trial)", fontsize=10)
    from sweeps.report.plots import VECTOR, plain_log_axis

    for ax in axes[0]:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":
                plain_log_axis(axis)  # 0.5, 2, 10: no 2x10^0
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    fig.savefig(Path(path).with_suffix(VECTOR))  # vector copy for a paper
    plt.close(fig)
    return True


def rows_from_benchmark(result: dict) -> list[dict]:
    """Records for ``plot_labeldp`` from benchmarks/labeldp_mnist_full.py's JSON (its ``runs``)."""
    rows = []
    for r in result.get("runs", {}).values():
        rows.append({"task": r["task"], "mechanism": r["method"], "postprocess": "argmax", "epsilon": r["epsilon"],
                     "acc_clean": _num(r.get("acc")), "mse": _num(r.get("mse")),
                     "label_keep_rate": _num(r.get("label_keep_rate"))})
    return rows


def main(argv=None) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Draw the label-DP figure from a labeldp_mnist_full JSON result")
    ap.add_argument("result", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if not plot_labeldp(rows_from_benchmark(json.loads(args.result.read_text())), args.out):
        raise SystemExit(f"{args.result}: no runs to draw")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
