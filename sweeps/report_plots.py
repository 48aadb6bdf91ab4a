"""The figures of ``dpsweep report`` (matplotlib, Agg). Each function returns False when the sweep
has no data for its figure, so the report shows only what it can draw.

* ``plot_pareto``: epsilon against a utility metric, per mechanism, with each mechanism's front;
* ``plot_certified_curves``: certified accuracy against attack size from the per-example tables;
* ``plot_accuracy_vs_epsilon_per_attack``: the layout of the DPAL paper's Fig. 2 (one panel per
  attack at one attack size, conventional accuracy against epsilon, one line per mechanism);
* ``plot_accuracy_vs_size_per_attack``: Fig. 4's layout (one panel per attack, accuracy against
  the attack size, one line per mechanism and epsilon);
* ``plot_certified_vs_size_by_mechanism``: Fig. 6's layout (certified accuracy against the attack
  size, one line per mechanism and epsilon, averaged over the trials that share them).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from sweeps.pareto import pareto_front
from sweeps.report_data import TABLES, Sweep, certified_accuracy_at, size_grid

ACC = re.compile(r"^acc_(fgsm|ifgsm|mim|pgd)_([0-9.eE+-]+)$")
ATTACK_LABEL = {"fgsm": "FGSM", "ifgsm": "I-FGSM", "mim": "MIM", "pgd": "MadryEtAl (PGD)"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(df, col):
    return df[np.isfinite(df[col].astype(float))] if col in df else df.iloc[0:0]


def plot_pareto(trials, metric: str, path: Path, ylabel: str) -> bool:
    """Every trial as a point (epsilon, ``metric``), one colour per mechanism, its front as a step line."""
    if trials.empty or "epsilon" not in trials or metric not in trials:
        return False
    df = _finite(_finite(trials, "epsilon"), metric)
    if df.empty:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    for i, (mech, g) in enumerate(sorted(df.groupby("trainable"), key=lambda kv: kv[0])):
        color = plt.cm.tab10(i % 10)
        e, a = g["epsilon"].to_numpy(float), g[metric].to_numpy(float)
        ax.scatter(e, a, color=color, alpha=0.35, s=18)
        front = pareto_front(e, a)
        ax.step(e[front], a[front], where="post", color=color, lw=2, marker="o", label=f"{mech} (front)")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon (per trial)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _label(row) -> str:
    eps = row.get("epsilon", math.nan)
    return f"{row['trainable']} eps={eps:.3g}" if isinstance(eps, float) and math.isfinite(eps) else row["trainable"]


def plot_certified_curves(sweep: Sweep, kind: str, path: Path) -> bool:
    """One curve per trial from its per-example table (any attack size, not only configured ones)."""
    tables = {rid: t for (rid, k), t in sweep.tables.items() if k == kind}
    if not tables:
        return False
    plt = _plt()
    grid = size_grid(sweep, kind)
    by_id = sweep.trials.set_index("run_id")
    mechs = sorted({by_id.loc[r, "trainable"] for r in tables})
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    for i, (rid, table) in enumerate(tables.items()):
        row = by_id.loc[rid]
        ls = ("-", "--", ":", "-.")[mechs.index(row["trainable"]) % 4]
        ax.plot(grid, certified_accuracy_at(table, kind, grid), ls=ls, color=plt.cm.tab10(i % 10),
                label=f"{_label(row.to_dict())} ({row['run']})", alpha=0.85)
    what = "l2 radius, randomized smoothing" if kind == "smoothing" else "the mechanism's certified size"
    ax.set_xlabel(f"attack size ([-1, 1] domain; {what})")
    ax.set_ylabel("certified accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _attack_columns(trials) -> dict[str, dict[float, str]]:
    """attack -> {size: column} of the conventional-accuracy metrics present."""
    out: dict[str, dict[float, str]] = {}
    for col in trials.columns:
        m = ACC.match(str(col))
        if m:
            out.setdefault(m.group(1), {})[float(m.group(2))] = col
    return out


def plot_accuracy_vs_epsilon_per_attack(trials, size: float, path: Path) -> bool:
    """Fig. 2's layout: a panel per attack at ``size``; accuracy against epsilon, a line per
    mechanism (mean over the trials at each epsilon)."""
    cols = {a: s[size] for a, s in _attack_columns(trials).items() if size in s}
    df = _finite(trials, "epsilon")
    if not cols or df.empty or df.groupby("trainable")["epsilon"].nunique().max() < 2:
        return False
    plt = _plt()
    attacks = [a for a in ATTACK_LABEL if a in cols]
    fig, axes = plt.subplots(1, len(attacks), figsize=(3.2 * len(attacks), 3.3), dpi=120, squeeze=False, sharey=True)
    for ax, attack in zip(axes[0], attacks):
        for i, (mech, g) in enumerate(sorted(df.groupby("trainable"), key=lambda kv: kv[0])):
            mean = g.groupby("epsilon")[cols[attack]].mean().sort_index()
            ax.plot(mean.index, mean.to_numpy(), marker="o", color=plt.cm.tab10(i % 10), label=mech)
        ax.set_title(f"{ATTACK_LABEL[attack]}, size {size:g}", fontsize=9)
        ax.set_xlabel("epsilon")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("conventional accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_accuracy_vs_size_per_attack(trials, path: Path) -> bool:
    """Fig. 4's layout: a panel per attack; accuracy against the attack size, a line per
    (mechanism, epsilon), mean over trials that share them."""
    cols = {a: s for a, s in _attack_columns(trials).items() if len(s) >= 2}
    if not cols or trials.empty:
        return False
    plt = _plt()
    df = trials.copy()
    df["_eps"] = df["epsilon"].round(6) if "epsilon" in df else math.nan
    attacks = [a for a in ATTACK_LABEL if a in cols]
    fig, axes = plt.subplots(1, len(attacks), figsize=(3.2 * len(attacks), 3.3), dpi=120, squeeze=False, sharey=True)
    for ax, attack in zip(axes[0], attacks):
        sizes = sorted(cols[attack])
        for i, ((mech, eps), g) in enumerate(sorted(df.groupby(["trainable", "_eps"], dropna=False),
                                                    key=lambda kv: (kv[0][0], kv[0][1]))):
            acc = [g[cols[attack][s]].mean() for s in sizes]
            ax.plot(sizes, acc, marker="o", color=plt.cm.tab10(i % 10), label=f"{mech} eps={eps:.3g}")
        ax.set_title(ATTACK_LABEL[attack], fontsize=9)
        ax.set_xlabel("attack size mu_a")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("conventional accuracy")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_certified_vs_size_by_mechanism(sweep: Sweep, path: Path) -> bool:
    """Fig. 6's layout: certified accuracy against the attack size, a line per (mechanism,
    epsilon, certifier), the mean of the per-trial curves computed from the per-example tables."""
    if not sweep.tables:
        return False
    plt = _plt()
    by_id = sweep.trials.set_index("run_id")
    groups: dict[tuple, list] = {}
    for (rid, kind), table in sweep.tables.items():
        row = by_id.loc[rid]
        eps = float(row.get("epsilon", math.nan))
        groups.setdefault((row["trainable"], round(eps, 6), kind), []).append(table)
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    for i, ((mech, eps, kind), tables) in enumerate(sorted(groups.items(), key=lambda kv: kv[0])):
        grid = size_grid(sweep, kind)
        curve = np.mean([certified_accuracy_at(t, kind, grid) for t in tables], axis=0)
        ax.plot(grid, curve, color=plt.cm.tab10(i % 10), ls="-" if kind == "native" else "--",
                label=f"{mech} eps={eps:.3g}" + (" (smoothing)" if kind == "smoothing" else ""))
    ax.set_xlabel("attack size mu_a ([-1, 1] domain)")
    ax.set_ylabel("certified accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def certified_table(sweep: Sweep, sizes) -> list[dict]:
    """Certified accuracy of every trial at the asked sizes, from its per-example tables."""
    by_id = sweep.trials.set_index("run_id")
    rows = []
    for (rid, kind), table in sorted(sweep.tables.items()):
        row = by_id.loc[rid]
        out = {"run": row["run"], "trainable": row["trainable"], "certifier": kind,
               "epsilon": float(row.get("epsilon", math.nan))}
        for s, v in zip(sizes, certified_accuracy_at(table, kind, sizes)):
            out[f"cert_acc_{s:.6g}" if kind == "native" else f"smooth_cert_acc_{s:.6g}"] = float(v)
        rows.append(out)
    return rows


__all__ = ["TABLES", "certified_table", "plot_accuracy_vs_epsilon_per_attack", "plot_accuracy_vs_size_per_attack",
           "plot_certified_curves", "plot_certified_vs_size_by_mechanism", "plot_pareto"]
