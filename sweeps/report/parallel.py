"""The report's parallel-coordinates figure: every swept key against the search metric (issue 34,
point 7).

MLflow's compare view draws parallel coordinates too, but opens them on the first metric the runs
share in the order MLflow lists them (``selectedMetricKeys: sharedMetricKeys.slice(0, 1)`` in MLflow
3.17's UI), which is the per-epoch ``train_loss`` (a non-private diagnostic) for most trainables, and
its address has no parameter that picks the metric. This figure always draws ``search.metric``:
one axis per swept key (log-scaled when its values are positive and span more than a factor of 10;
categories at even spacing), the search metric as the last axis, one line per finished trial
coloured by the metric, the best configuration's trials drawn in black.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from sweeps.report.data import finished, key_name, varying_columns, with_groups


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v == ""


def _axis(values: list, missing_label: str = "n/a") -> tuple[np.ndarray, list[float], list[str]]:
    """Positions in [0, 1] of a column's values, and the ticks (positions, labels) of its axis. A
    missing value (a key that does not apply to a trial: a non-private baseline's epsilon) is not a
    number of the axis: it sits at the bottom, labelled ``missing_label`` (never "nan"), and the
    numbers keep their scale above it (issue 51.3)."""
    gone = [_missing(v) for v in values]
    if any(gone) and not all(gone):
        rest = [v for v, g in zip(values, gone) if not g]
        pos, tpos, tlab = _axis(rest)
        out, it = np.zeros(len(values)), iter(0.18 + 0.82 * pos)
        for i, g in enumerate(gone):
            out[i] = 0.0 if g else next(it)
        return out, [0.0] + [0.18 + 0.82 * p for p in tpos], [missing_label] + tlab
    nums = []
    for v in values:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
        nums.append(float(v) if ok else None)
    if all(n is not None for n in nums):
        arr = np.array(nums, dtype=np.float64)
        uniq = np.unique(arr)
        log = bool(arr.min() > 0 and arr.max() / arr.min() > 10)
        t = np.log10(arr) if log else arr
        tu = np.log10(uniq) if log else uniq
        lo, hi = float(t.min()), float(t.max())
        scale = (lambda z: (z - lo) / (hi - lo)) if hi > lo else (lambda z: np.full_like(z, 0.5))
        ticks = uniq if len(uniq) <= 8 else np.unique(np.quantile(uniq, np.linspace(0, 1, 6), method="nearest"))
        tt = np.log10(ticks) if log else ticks
        return scale(t), list(scale(np.asarray(tt, dtype=np.float64))), [f"{x:.4g}" for x in ticks]
    labels = sorted({str(v) for v in values})
    pos = {lab: (i / (len(labels) - 1) if len(labels) > 1 else 0.5) for i, lab in enumerate(labels)}
    return np.array([pos[str(v)] for v in values]), list(pos.values()), labels


def plot_parallel(trials, metric: str, path: Path, best_group=None) -> bool:
    """Write the figure (PNG and PDF) when at least one swept key and the metric exist; True if
    written. ``best_group``: the ``group`` (``data.with_groups``) of the best configuration."""
    from sweeps.report import plots as rp

    df = finished(with_groups(trials)) if not trials.empty else trials
    if df.empty or not metric or metric not in df:
        return False
    df = df[df[metric].map(lambda v: isinstance(v, (int, float)) and math.isfinite(float(v)))]
    keys = [c for c in varying_columns(df)] if not df.empty else []
    if df.empty or not keys:
        return False
    plt = rp._plt()
    cols = keys + [metric]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(cols)), 3.9))
    positions, ticks = [], []
    for c in cols:
        pos, tpos, tlab = _axis(list(df[c]), "non-private" if key_name(c) == "epsilon" else "n/a")
        positions.append(pos)
        ticks.append((tpos, tlab))
    ys = np.vstack(positions).T  # one row per trial
    vals = df[metric].astype(float).to_numpy()
    norm = plt.Normalize(vals.min(), vals.max() if vals.max() > vals.min() else vals.min() + 1e-9)
    cmap = plt.get_cmap("viridis")
    xs = np.arange(len(cols))
    groups = df["group"].to_numpy()
    for y, v, g in zip(ys, vals, groups):
        if best_group is not None and g == best_group:
            continue
        ax.plot(xs, y, color=cmap(norm(v)), alpha=0.8, lw=1.2)
    best_label = True
    for y, g in zip(ys, groups):
        if best_group is not None and g == best_group:
            ax.plot(xs, y, color="black", lw=2.4, label="best configuration" if best_label else None)
            best_label = False
    for i, (tpos, tlab) in enumerate(ticks):
        ax.axvline(i, color="0.6", lw=0.8)
        for p, lab in zip(tpos, tlab):
            ax.text(i + 0.04, p, lab, fontsize=7, va="center", bbox=dict(facecolor="white", edgecolor="none", pad=0.5,
                                                                          alpha=0.8))
    ax.set_xticks(xs)
    ax.set_xticklabels([key_name(c) for c in keys] + [f"{metric}\n(search.metric)"], fontsize=8)
    ax.set_yticks([])
    ax.set_ylim(-0.06, 1.06)
    ax.set_xlim(-0.2, len(cols) - 0.6)
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=ax, label=metric, pad=0.02)
    if not best_label:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    ax.set_title(f"Swept keys against {metric}: one line per trial", fontsize=9)
    rp._save(fig, ax, path)
    return True


def parallel_figure(sweep, out: Path) -> tuple[str, str, str] | None:
    """(title, file, caption) of the figure for the report of one sweep (``make_report``), or None
    when the spec names no single ``search.metric`` or nothing is swept."""
    from sweeps.report.best import select_configuration

    params = dict(sweep.parent.data.params)
    metric, mode = params.get("search.metric"), params.get("search.mode") or "max"
    if metric in (None, "", "null") or sweep.trials.empty or metric not in sweep.trials:
        return None
    rows = finished(with_groups(sweep.trials)).to_dict("records")
    from sweeps.report.data import is_nonprivate

    sel = select_configuration(rows, metric, mode, params.get("selection.statistic") or "mean",
                               config_of=lambda r: r["group"], seed_of=lambda r: r.get("param.seed"),
                               baseline_of=is_nonprivate, best_among=params.get("selection.best_of") or "private")
    fname = "parallel_coordinates.png"
    if not plot_parallel(sweep.trials, metric, out / fname, sel.best.key if sel.best is not None else None):
        return None
    return ("Swept keys against the search metric", fname,
            f"Parallel coordinates of every swept key against `{metric}` (`search.metric`), one line per finished "
            "trial coloured by it, the best configuration's trials in black. MLflow's compare view draws the same "
            "kind of plot but opens it on the first metric it lists (often `train_loss`); pick "
            f"`{metric}` in its Metrics box there.")
