"""The figures of ``dpsweep report`` (matplotlib, Agg). Each function returns False when the sweep
has no data for its figure, so the report shows only what it can draw.

Repeats of a configuration (``search.num_samples``; trials that differ only in ``seed`` and
``repeat``) are drawn as one point or curve: the mean, with error bars (or a band) of one sample
standard deviation. Every figure draws one series per value of the swept keys it does not put on
an axis (colour and marker, with a legend), writes a PDF beside its PNG, and labels log axes with
plain decimals. Published values of the spec's ``reference`` block are drawn as black stars
on every figure whose axes they belong to (``refs``: ``report_data.reference_rows``).

The same axis conventions hold in every figure (issue 34, point 6): an epsilon axis is
logarithmic when the values span a factor of 4 or more, with its ticks at the swept values
(``epsilon_axis``); the y range is fitted to what is drawn with a margin (``fit_ylim``), not fixed
to 0..1; every attack size names its norm and domain; the best configuration by
``search.metric`` (mean over its repeats, ``best_configuration``) is ringed. Labels are neutral
("clean accuracy", "PGD") except in a study of the DPAL paper (``dpal_study``), whose figures
keep that paper's words ("conventional accuracy", "MadryEtAl (PGD)", "Fig. 2 layout").

* ``plot_pareto``: privacy epsilon against a utility metric, per mechanism, with each mechanism's
  front (trainables whose epsilon is a privacy guarantee only);
* ``plot_robustness``: the same metric against the *configured* robustness epsilon, for the
  trainables whose epsilon is a robustness parameter (PixelDP);
* ``plot_accuracy_vs_epsilon``: clean accuracy against the configured epsilon, a line per value
  of the other swept keys;
* ``plot_certified_curves``: certified accuracy against attack size from the per-example tables;
* ``plot_accuracy_vs_epsilon_per_attack``: the layout of the DPAL paper's Fig. 2 (one panel per
  attack at one attack size, conventional accuracy against the configured epsilon);
* ``plot_accuracy_vs_size_per_attack``: Fig. 4's layout (one panel per attack, accuracy against
  the attack size, one line per configuration);
* ``plot_certified_vs_size_by_mechanism``: Fig. 6's layout (certified accuracy against the attack
  size, one line per mechanism and configured epsilon, averaged over the trials that share them).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from sweeps.report.pareto import pareto_front
from sweeps.report.data import (
    TABLES,
    Sweep,
    aggregate,
    certified_accuracy_at,
    finished,
    fmt_stat,
    group_label,
    label_keys,
    size_grid,
    with_groups,
)
from sweeps.report.data import as_number as _num

ACC = re.compile(r"^acc_(fgsm|ifgsm|mim|pgd)_([0-9.eE+-]+)$")
CERT = re.compile(r"^(smooth_)?cert_acc_([0-9.eE+-]+)$")
ATTACK_LABEL = {"fgsm": "FGSM", "ifgsm": "I-FGSM", "mim": "MIM", "pgd": "PGD"}
DPAL_ATTACK_LABEL = {**ATTACK_LABEL, "pgd": "MadryEtAl (PGD)"}  # the DPAL paper's name, in its studies only
DPAL_TRAINABLES = ("dpal", "dpal_sound")
NORM_LABEL = {"linf": "l-inf", "l2": "l2", "l1": "l1"}
DOMAIN = "[-1, 1] domain"
BEST = dict(s=260, facecolors="none", edgecolors="crimson", linewidths=1.8, zorder=6)
MAX_SWEPT_TICKS = 12  # more swept values than this: decade ticks instead
EPSILON_PARAMS = ("param.epsilon", "param.eps_t")  # the configured epsilon of each trainable
STAR = dict(marker="*", s=140, color="black", edgecolors="white", linewidths=0.6, zorder=5)


def dpal_study(trials) -> bool:
    """A study of the DPAL paper (a ``dpal`` or ``dpal_sound`` trial): its figures keep the paper's
    words; any other sweep gets neutral labels."""
    return bool(len(trials)) and "trainable" in trials and bool(trials["trainable"].isin(DPAL_TRAINABLES).any())


def attack_label(attack: str, dpal: bool = False) -> str:
    return (DPAL_ATTACK_LABEL if dpal else ATTACK_LABEL)[attack]


def norms(trials, keys=("param.attack_norm",), default="l2") -> str:
    """The norm(s) of the trials' attack sizes as a label (``l-inf``, ``l2``, ``l2 / l-inf``); the
    trial default (``attack_norm`` l2) where a trial logs none."""
    seen = []
    for _, row in finished(trials).iterrows():
        value = next((row[k] for k in keys if k in row and isinstance(row[k], str)), default)
        if value not in seen:
            seen.append(value)
    return " / ".join(NORM_LABEL.get(v, v) for v in seen) or NORM_LABEL[default]


def size_label(trials, what: str = "attack size", keys=("param.attack_norm",)) -> str:
    """An attack-size axis or title: its norm and its domain, e.g. ``attack size (l-inf, [-1, 1] domain)``."""
    return f"{what} ({norms(trials, keys)}, {DOMAIN})"


def epsilon_axis(ax, values, label: str) -> None:
    """The epsilon axis of every figure: logarithmic when the values span a factor of 4 or more;
    ticks at the swept values (plain decimals, no minor ticks; decade ticks past
    ``MAX_SWEPT_TICKS`` values); ``label``."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    vals = sorted({float(f"{float(v):.3g}") for v in values if math.isfinite(_num(v)) and float(v) > 0})
    if len(vals) >= 2 and vals[-1] / vals[0] >= 4:
        ax.set_xscale("log")
    if 1 <= len(vals) <= MAX_SWEPT_TICKS:
        ax.xaxis.set_major_locator(FixedLocator(vals))
        ax.xaxis.set_major_formatter(FuncFormatter(_plain))
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(label)


def fit_ylim(axes, lo: float = 0.0, hi: float = 1.0, margin: float = 0.08) -> None:
    """Fit the y range of ``axes`` (one axis or several that share y) to what is drawn on them
    (lines, error bars, bands, published stars), with ``margin`` of the span on each side (at
    least 0.01), never beyond [lo - 0.02, hi + 0.02]."""
    axes = list(np.atleast_1d(axes).ravel())
    y0 = min((float(ax.dataLim.y0) for ax in axes if np.isfinite(ax.dataLim.y0)), default=math.nan)
    y1 = max((float(ax.dataLim.y1) for ax in axes if np.isfinite(ax.dataLim.y1)), default=math.nan)
    if not (math.isfinite(y0) and math.isfinite(y1)):
        return
    pad = max(margin * (y1 - y0), 0.01)
    for ax in axes:
        ax.set_ylim(max(lo - 0.02, y0 - pad), min(hi + 0.02, y1 + pad))


def best_configuration(trials, metric: str | None, mode: str = "max") -> dict | None:
    """The best configuration by ``metric`` (its mean over its repeats; ``mode`` max or min) as
    ``{column: value}`` of its trainable and configured parameters (``data.config_columns``), the
    key ``is_best`` matches; None without the metric."""
    from sweeps.report.data import _key_value, config_columns

    if not metric or trials.empty or metric not in trials:
        return None
    agg = aggregate(trials, [metric])
    if agg.empty:
        return None
    agg = agg[np.isfinite(agg[metric].astype(float))]
    if agg.empty:
        return None
    row = agg.loc[agg[metric].astype(float).idxmin() if mode == "min" else agg[metric].astype(float).idxmax()]
    cols = ["trainable", *[c for c in config_columns(finished(trials)) if c in agg]]
    return {"_metric": metric, **{c: _key_value(row[c]) for c in cols}}


def is_best(row, best: dict | None) -> bool:
    """Whether an aggregated row (one configuration) is the ``best_configuration``."""
    from sweeps.report.data import _key_value

    if not best:
        return False
    return all(_key_value(row.get(c)) == v for c, v in best.items() if not c.startswith("_"))


def mark_best(ax, x, y, best: dict) -> None:
    """Ring the best configuration's point (one legend entry)."""
    if math.isfinite(_num(x)) and math.isfinite(_num(y)):
        ax.scatter([x], [y], label=f"best configuration by {best['_metric']} (mean over repeats)", **BEST)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _privacy(trainable) -> bool:
    from trainables.registry import REGISTRY

    return bool(getattr(REGISTRY.get(trainable), "privacy_epsilon", True))


def _sd(values) -> np.ndarray:
    """Standard deviations for error bars (NaN, one trial, drawn as none)."""
    return np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0)




def _matches_any(trials, where: dict) -> bool:
    """Some finished trial of ``trials`` (those a figure draws) has the point's configured values."""
    from sweeps.report.data import trial_config
    from sweeps.spec.sweep_spec import reference_matches

    return any(reference_matches(where, trial_config(r)) for r in finished(trials).to_dict("records"))


def _ref_x(trials, where: dict, col: str) -> float:
    """The x of a published point: the configured value in ``where``, else the mean of ``col``
    over the finished trials the point matches; NaN (not drawn) when the figure's trials hold no
    trial the point matches."""
    from sweeps.report.data import measured

    if not _matches_any(trials, where):
        return math.nan
    if col.startswith("param.") and col[len("param."):] in where:
        return _num(where[col[len("param."):]])
    if col.startswith("param."):
        from sweeps.report.data import trial_config
        from sweeps.spec.sweep_spec import reference_matches

        vals = [_num(r[col]) for _, r in finished(trials).iterrows()
                if col in r and reference_matches(where, trial_config(r))]
        vals = [v for v in vals if math.isfinite(v)]
        return float(np.mean(vals)) if vals else math.nan
    return measured(trials, where, col)[0]


def _stars(ax, points, label_done: list) -> None:
    """Draw published points [(x, y, text)] as black stars (one legend entry per figure)."""
    for x, y, text in points:
        if not (math.isfinite(x) and math.isfinite(y)):
            continue
        ax.scatter([x], [y], label=None if label_done else "published (spec reference)", **STAR)
        label_done.append(True)
        if text:
            note = ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=6, clip_on=True)
            note.set_in_layout(False)  # a long label must not squeeze the axes


MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "h", "<", ">", "p")
VECTOR = ".pdf"  # every figure is also written as a vector file beside its PNG


def style(i: int) -> dict:
    """Colour and marker of the i-th series: each series differs in both (legible in grey print)."""
    plt = _plt()
    return {"color": plt.cm.tab10(i % 10), "marker": MARKERS[i % len(MARKERS)]}


def _plain(value: float, _pos=None) -> str:
    """A log-axis tick as a plain decimal (0.5, 2, 10, 0.001), never ``2x10^0``."""
    if not math.isfinite(value) or value <= 0:
        return ""
    return f"{value:.6g}"


def plain_log_axis(axis) -> None:
    """Plain decimal labels on a log axis: every decade, and the 2 and 5 between decades when
    the axis spans less than two decades (matplotlib's default writes those as ``2x10^0``)."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    lo, hi = sorted(axis.get_view_interval())
    span = math.log10(hi / lo) if lo > 0 and hi > 0 else 99.0
    axis.set_major_locator(LogLocator(base=10))
    axis.set_major_formatter(FuncFormatter(_plain))
    if span < 2:
        axis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
        axis.set_minor_formatter(FuncFormatter(_plain))
    else:
        axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(2, 10))))
        axis.set_minor_formatter(FuncFormatter(lambda v, p=None: ""))


def _save_accuracy_panels(fig, axes, path, dpal: bool = False) -> bool:
    """The accuracy-vs-parameter panel grids' common ending: y label, fitted y range, legend, saved."""
    axes[0][0].set_ylabel(("conventional accuracy" if dpal else "accuracy under attack") + " (mean ± sd)")
    fit_ylim(axes)
    axes[0][-1].legend(fontsize=6)
    _save(fig, axes, path)
    return True


def _save(fig, ax_or_axes, path: Path, legend_fontsize=7) -> None:
    """Write ``path`` (PNG) and the same figure as a vector file (PDF) beside it; log axes get
    plain decimal tick labels."""
    plt = _plt()
    from matplotlib.ticker import FixedLocator

    for ax in np.atleast_1d(ax_or_axes).ravel():
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log" and not isinstance(axis.get_major_locator(), FixedLocator):
                plain_log_axis(axis)
    fig.tight_layout()
    fig.savefig(path)
    fig.savefig(Path(path).with_suffix(VECTOR))
    plt.close(fig)


def _series(df, agg, exclude=EPSILON_PARAMS) -> list:
    """``agg`` (one row per configuration) with ``_series``: the trainable and the values of every
    other swept key (all varying configured keys but ``exclude``, the x axis), one series each."""
    varying = label_keys(finished(df))
    agg = agg.copy()
    agg["_series"] = [group_label(r, varying, exclude) for r in agg.to_dict("records")]
    return agg


def plot_pareto(trials, metric: str, path: Path, ylabel: str, refs=(), best: dict | None = None) -> bool:
    """Each configuration (mean over its repeats, error bars one sd) as a point (privacy epsilon,
    ``metric``), one series (colour and marker) per value of the other swept keys, each series'
    front (of the means) as a step line. Only trainables whose epsilon is a privacy guarantee; a
    non-private baseline (infinite epsilon) has no place on the axis and is a horizontal reference
    line at its mean score, labelled "non-private baseline" (what privacy costs: issue 51, point 4)."""
    if trials.empty or "epsilon" not in trials or metric not in trials:
        return False
    df = trials[trials["trainable"].map(_privacy).astype(bool)]
    agg = aggregate(df, ["epsilon", metric])
    if agg.empty:
        return False
    baselines = agg[~np.isfinite(agg["epsilon"].astype(float)) & np.isfinite(agg[metric].astype(float))]
    agg = agg[np.isfinite(agg["epsilon"].astype(float)) & np.isfinite(agg[metric].astype(float))]
    if agg.empty:
        return False
    agg = _series(df, agg)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    for i, (series, g) in enumerate(sorted(agg.groupby("_series"), key=lambda kv: kv[0])):
        st = style(i)
        e, a = g["epsilon"].to_numpy(float), g[metric].to_numpy(float)
        front = pareto_front(e, a)
        ax.step(e[front], a[front], where="post", color=st["color"], lw=1.3, alpha=0.6)
        ax.errorbar(e, a, yerr=_sd(g[f"{metric}.sd"]), xerr=_sd(g["epsilon.sd"]), fmt=st["marker"], color=st["color"],
                    ms=5, capsize=3, lw=1.2, zorder=3, label=series)
    several = baselines["trainable"].nunique() > 1 if "trainable" in baselines else False
    for r in baselines.to_dict("records"):
        score = fmt_stat(r[metric], r.get(f"{metric}.sd", math.nan), int(r.get(f"{metric}.n", r["n"])))
        ax.axhline(r[metric], color="black", ls=":", lw=1.3, zorder=2,
                   label=f"non-private baseline{' (' + r['trainable'] + ')' if several else ''}: "
                         f"{score} (n={int(r['n'])})")
    for r in agg.to_dict("records"):
        if is_best(r, best):
            mark_best(ax, r["epsilon"], r[metric], best)
    done: list = []
    _stars(ax, [(_ref_x(df, r["_where"], "epsilon"), r["published"], r["point"])
                for r in refs if r["metric"] == metric], done)
    ax.set_xscale("log")
    epsilon_axis(ax, agg["epsilon"], "privacy epsilon (measured per trial; mean over repeats)")
    ax.set_ylabel(ylabel + " (mean ± sd)")
    fit_ylim(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, title="mean ± sd; line: the series' front", title_fontsize=7)
    _save(fig, ax, path)
    return True


def _robust_x(df) -> str | None:
    if "robustness_epsilon_config" in df and df["robustness_epsilon_config"].notna().any():
        return "robustness_epsilon_config"
    return "param.epsilon" if "param.epsilon" in df else None


def plot_robustness(trials, metric: str, path: Path, ylabel: str, refs=(), best: dict | None = None) -> bool:
    """Trainables whose epsilon is a robustness parameter (PixelDP): ``metric`` against the
    configured robustness epsilon, a line per configuration of the other parameters (mean ± sd)."""
    if trials.empty or metric not in trials or "trainable" not in trials:
        return False
    df = trials[~trials["trainable"].map(_privacy).astype(bool)]
    xcol = _robust_x(df) if not df.empty else None
    if xcol is None:
        return False
    if xcol.startswith("param."):
        df = df.assign(robustness_epsilon_config=df[xcol].map(_num))
    agg = aggregate(df, ["robustness_epsilon_config", metric])
    if agg.empty or not np.isfinite(agg[metric].astype(float)).any():
        return False
    agg = _series(df, agg, ("param.epsilon",))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    for i, (series, g) in enumerate(sorted(agg.groupby("_series"), key=lambda kv: kv[0])):
        g = g.sort_values("robustness_epsilon_config")
        ax.errorbar(g["robustness_epsilon_config"].to_numpy(float), g[metric].to_numpy(float),
                    yerr=_sd(g[f"{metric}.sd"]), capsize=3, label=series, **style(i))
        for r in g.to_dict("records"):
            if is_best(r, best):
                mark_best(ax, r["robustness_epsilon_config"], r[metric], best)
    _stars(ax, [(_ref_x(df, r["_where"], "param.epsilon"), r["published"], r["point"])
                for r in refs if r["metric"] == metric], [])
    return _finish_epsilon_figure(fig, ax, path, agg["robustness_epsilon_config"],
                                  "robustness epsilon (configured; not a privacy guarantee)", ylabel)


def _label(row) -> str:
    eps = row.get("epsilon", math.nan)
    return f"{row['trainable']} eps={eps:.3g}" if isinstance(eps, float) and math.isfinite(eps) else row["trainable"]


def _table_groups(sweep: Sweep, kind: str) -> tuple[dict, dict[str, list[str]]]:
    """group id -> (label, [tables]) of the finished trials with a ``kind`` table."""
    trials = with_groups(sweep.trials)
    fin = finished(trials)
    varying = label_keys(fin)
    by_id = fin.set_index("run_id")
    groups: dict = {}
    for (rid, k), table in sweep.tables.items():
        if k != kind or rid not in by_id.index:
            continue
        row = by_id.loc[rid]
        entry = groups.setdefault(int(row["group"]), [group_label(row.to_dict(), varying), []])
        entry[1].append(table)
    return groups, varying


def plot_certified_curves(sweep: Sweep, kind: str, path: Path, refs=(), best: dict | None = None) -> bool:
    """One curve per configuration from its trials' per-example tables (any attack size, not only
    configured ones): the mean over its repeats, a band of one sd."""
    groups, _ = _table_groups(sweep, kind)
    if not groups:
        return False
    plt = _plt()
    grid = size_grid(sweep, kind)
    mechs = sorted({label.split()[0] for label, _ in groups.values()})
    best_gids = _best_groups(sweep, best)
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    for i, (gid, (label, tables)) in enumerate(sorted(groups.items())):
        curves = np.array([certified_accuracy_at(t, kind, grid) for t in tables])
        mean = curves.mean(axis=0)
        st = style(i)
        color = st["color"]
        ls = ("-", "--", ":", "-.")[mechs.index(label.split()[0]) % 4]
        top = gid in best_gids
        ax.plot(grid, mean, ls=ls, alpha=0.9, markevery=max(1, len(grid) // 8), ms=4, lw=3.0 if top else 1.5,
                label=f"{label} (n={len(tables)})" + (f" [best by {best['_metric']}]" if top else ""), **st)
        if len(tables) > 1:
            sd = curves.std(axis=0, ddof=1)
            ax.fill_between(grid, mean - sd, mean + sd, color=color, alpha=0.15, lw=0)
    prefix = "smooth_cert_acc_" if kind == "smoothing" else "cert_acc_"
    _stars(ax, [(float(r["metric"][len(prefix):]), r["published"], r["point"]) for r in refs
                if r["metric"].startswith(prefix) and CERT.match(r["metric"]) and _matches_any(sweep.trials, r["_where"])
                and bool(CERT.match(r["metric"]).group(1)) == (kind == "smoothing")], [])
    if kind == "smoothing":
        ax.set_xlabel(f"certified radius (l2, {DOMAIN}; randomized smoothing)")
    else:
        ax.set_xlabel(size_label(sweep.trials, "certified size", ("param.norm", "param.attack_norm")))
    ax.set_ylabel("certified accuracy (mean ± sd)")
    fit_ylim(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    _save(fig, ax, path)
    return True


def _attack_columns(trials) -> dict[str, dict[float, str]]:
    """attack -> {size: column} of the conventional-accuracy metrics present."""
    out: dict[str, dict[float, str]] = {}
    for col in trials.columns:
        m = ACC.match(str(col))
        if m:
            out.setdefault(m.group(1), {})[float(m.group(2))] = col
    return out


def _with_config_epsilon(trials):
    """``_eps``: the configured epsilon of each trial (``param.epsilon``; the guarantee for a
    privacy mechanism, the robustness parameter for PixelDP), the measured one where none is
    configured; NaN for a non-private baseline."""
    df = trials.copy()
    conf = pd.Series(np.nan, index=df.index)
    for key in EPSILON_PARAMS:  # DPAL configures eps_t, the others epsilon
        if key in df:
            conf = conf.where(conf.notna(), df[key].map(_num))
    meas = df["epsilon"].astype(float) if "epsilon" in df else pd.Series(np.nan, index=df.index)
    eps = conf.where(np.isfinite(conf.astype(float)), meas).astype(float)
    df["_eps"] = eps.where(np.isfinite(eps))
    return df


def _series_name(row, varying) -> str:
    name = group_label(row, varying, EPSILON_PARAMS)
    return name + ("" if _privacy(row.get("trainable")) else " (x: configured robustness eps)")


def plot_accuracy_vs_epsilon_per_attack(trials, size: float, path: Path, refs=(), best: dict | None = None) -> bool:
    """Fig. 2's layout: a panel per attack at ``size``; accuracy against the configured epsilon,
    a line per configuration of the other parameters (mean ± sd over repeats)."""
    cols = {a: s[size] for a, s in _attack_columns(trials).items() if size in s}
    if not cols or trials.empty:
        return False
    df = _with_config_epsilon(trials)
    df = df[df["_eps"].notna()]
    agg = aggregate(df, ["_eps", *cols.values()])
    if agg.empty:
        return False
    varying = label_keys(finished(df))
    agg["_series"] = [_series_name(r, varying) for r in agg.to_dict("records")]
    if agg.groupby("_series")["_eps"].nunique().max() < 2:
        return False
    plt = _plt()
    dpal = dpal_study(trials)
    attacks = [a for a in ATTACK_LABEL if a in cols]
    fig, axes = plt.subplots(1, len(attacks), figsize=(3.2 * len(attacks), 3.3), dpi=120, squeeze=False, sharey=True)
    for ax, attack in zip(axes[0], attacks):
        col = cols[attack]
        for i, (series, g) in enumerate(sorted(agg.groupby("_series"), key=lambda kv: kv[0])):
            g = g.sort_values("_eps")
            ax.errorbar(g["_eps"].to_numpy(float), g[col].to_numpy(float), yerr=_sd(g[f"{col}.sd"]),
                        capsize=2, ms=4, label=series, **style(i))
            for r in g.to_dict("records"):
                if is_best(r, best):
                    mark_best(ax, r["_eps"], r[col], best)
        mean_metric = f"acc_attack_mean_{size:.6g}"  # published as an average over the attacks: on every panel
        _stars(ax, [(_ref_x(df, r["_where"], "_eps"), r["published"],
                     r["point"] + (" (avg over attacks)" if r["metric"] == mean_metric else ""))
                    for r in refs if r["metric"] in (col, mean_metric)], [])
        ax.set_title(f"{attack_label(attack, dpal)}, {norms(trials)} size {size:g} ({DOMAIN})", fontsize=8)
        epsilon_axis(ax, agg["_eps"], "epsilon (configured)")
        ax.grid(alpha=0.3)
    return _save_accuracy_panels(fig, axes, path, dpal)


def _per_point(n) -> str:
    """`` (n=3 per point)`` when points average repeats, nothing for single trials."""
    lo, hi = int(n.min()), int(n.max())
    return "" if hi == 1 else f" (n={lo} per point)" if lo == hi else f" (n={lo}-{hi} per point)"


def plot_accuracy_vs_epsilon(trials, metric: str, path: Path, ylabel: str, refs=(), best: dict | None = None) -> bool:
    """``metric`` (clean accuracy) against the configured epsilon, one line (colour and marker)
    per value of the other swept keys (mean ± sd over repeats); a log epsilon axis with plain
    decimal ticks when the epsilons span a factor of 4 or more. False with fewer than two epsilons
    in every series."""
    if trials.empty or metric not in trials:
        return False
    df = _with_config_epsilon(trials)
    df = df[df["_eps"].notna()]
    agg = aggregate(df, ["_eps", metric])
    if agg.empty:
        return False
    agg = agg[np.isfinite(agg[metric].astype(float))]
    varying = label_keys(finished(df))
    agg["_series"] = [_series_name(r, varying) for r in agg.to_dict("records")]
    if agg.empty or agg.groupby("_series")["_eps"].nunique().max() < 2:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    for i, (series, g) in enumerate(sorted(agg.groupby("_series"), key=lambda kv: kv[0])):
        g = g.sort_values("_eps")
        ax.errorbar(g["_eps"].to_numpy(float), g[metric].to_numpy(float), yerr=_sd(g[f"{metric}.sd"]), capsize=3,
                    ms=5, label=series + _per_point(g["n"]), **style(i))
        for r in g.to_dict("records"):
            if is_best(r, best):
                mark_best(ax, r["_eps"], r[metric], best)
    _stars(ax, [(_ref_x(df, r["_where"], "_eps"), r["published"], r["point"]) for r in refs if r["metric"] == metric],
           [])
    return _finish_epsilon_figure(fig, ax, path, agg["_eps"], "epsilon (configured)", ylabel)


def _finish_epsilon_figure(fig, ax, path, eps_values, xlabel: str, ylabel: str) -> bool:
    """The shared end of a metric-against-epsilon figure: ticks at the swept epsilons, the y range
    fitted, grid, legend, saved (PNG and PDF)."""
    epsilon_axis(ax, eps_values, xlabel)
    ax.set_ylabel(ylabel + " (mean ± sd)")
    fit_ylim(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, ax, path)
    return True


def plot_accuracy_vs_size_per_attack(trials, path: Path, refs=()) -> bool:
    """Fig. 4's layout: a panel per attack; accuracy against the attack size, a line per
    configuration (mean ± sd over its repeats)."""
    cols = {a: s for a, s in _attack_columns(trials).items() if len(s) >= 2}
    if not cols or trials.empty:
        return False
    agg = aggregate(trials, [c for s in cols.values() for c in s.values()])
    if agg.empty:
        return False
    plt = _plt()
    dpal = dpal_study(trials)
    attacks = [a for a in ATTACK_LABEL if a in cols]
    keys = label_keys(finished(trials))
    fig, axes = plt.subplots(1, len(attacks), figsize=(3.2 * len(attacks), 3.3), dpi=120, squeeze=False, sharey=True)
    for ax, attack in zip(axes[0], attacks):
        sizes = sorted(cols[attack])
        for i, row in enumerate(agg.to_dict("records")):
            acc = [row.get(cols[attack][s], math.nan) for s in sizes]
            sd = [row.get(f"{cols[attack][s]}.sd", math.nan) for s in sizes]
            ax.errorbar(sizes, acc, yerr=_sd(sd), capsize=2, ms=4, label=f"{group_label(row, keys)} (n={row['n']})",
                        **style(i))
        _stars(ax, [(float(ACC.match(r["metric"]).group(2)), r["published"], r["point"]) for r in refs
                    if ACC.match(r["metric"]) and ACC.match(r["metric"]).group(1) == attack
                    and _matches_any(trials, r["_where"])], [])
        _stars(ax, [(float(r["metric"][len("acc_attack_mean_"):]), r["published"], r["point"] + " (avg over attacks)")
                    for r in refs if r["metric"].startswith("acc_attack_mean_") and _matches_any(trials, r["_where"])], [])
        ax.set_title(attack_label(attack, dpal), fontsize=9)
        ax.set_xlabel(size_label(trials, "attack size mu_a" if dpal else "attack size"))
        ax.grid(alpha=0.3)
    return _save_accuracy_panels(fig, axes, path, dpal)


def plot_certified_vs_size_by_mechanism(sweep: Sweep, path: Path, refs=()) -> bool:
    """Fig. 6's layout: certified accuracy against the attack size, a line per (mechanism,
    configured epsilon, certifier): the mean of the per-trial curves (from the per-example
    tables), a band of one sd."""
    if not sweep.tables:
        return False
    plt = _plt()
    df = finished(_with_config_epsilon(sweep.trials))
    varying = label_keys(df)
    df = df.set_index("run_id")
    groups: dict[tuple, list] = {}
    for (rid, kind), table in sweep.tables.items():
        if rid not in df.index:
            continue
        row = df.loc[rid]
        # a non-private trial's epsilon is inf, one key for all of them: NaN (never equal to itself) split
        # the baseline's repeats into n=1 series (issue 51, point 4)
        eps = round(float(row["_eps"]), 6) if math.isfinite(_num(row["_eps"])) else math.inf
        other = group_label(row.to_dict(), varying, EPSILON_PARAMS)  # the other swept keys
        groups.setdefault((other, eps, kind), []).append(table)
    if not groups:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=120)
    for i, ((series, eps, kind), tables) in enumerate(sorted(groups.items(), key=lambda kv: kv[0])):
        grid = size_grid(sweep, kind)
        curves = np.array([certified_accuracy_at(t, kind, grid) for t in tables])
        mean = curves.mean(axis=0)
        st = style(i)
        color = st["color"]
        mech, rest = (series.split(" ", 1) + [""])[:2]
        what = "eps" if _privacy(mech) else "robustness eps (configured)"
        privacy = f"{what}={eps:.3g}" if math.isfinite(eps) else "non-private"
        ax.plot(grid, mean, ls="-" if kind == "native" else "--", markevery=max(1, len(grid) // 8), ms=4,
                label=f"{mech} {privacy}{' ' + rest if rest else ''} (n={len(tables)})"
                + (" (smoothing)" if kind == "smoothing" else ""), **st)
        if len(tables) > 1:
            sd = curves.std(axis=0, ddof=1)
            ax.fill_between(grid, mean - sd, mean + sd, color=color, alpha=0.15, lw=0)
    _stars(ax, [(float(CERT.match(r["metric"]).group(2)), r["published"], r["point"]) for r in refs
                if CERT.match(r["metric"]) and _matches_any(sweep.trials, r["_where"])], [])
    kinds = {k for (_, _, k) in groups}
    what = "attack size mu_a" if dpal_study(sweep.trials) else "certified size"
    ax.set_xlabel(size_label(sweep.trials, what, ("param.norm", "param.attack_norm"))
                  + ("; dashed: randomized smoothing, l2" if "smoothing" in kinds else ""))
    ax.set_ylabel("certified accuracy (mean ± sd)")
    fit_ylim(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, ax, path)
    return True


def _best_groups(sweep: Sweep, best: dict | None) -> set:
    """The group ids (``data.with_groups``) of the best configuration's trials."""
    if not best or sweep.trials.empty:
        return set()
    agg = aggregate(with_groups(sweep.trials), [])
    return {int(r["group"]) for r in agg.to_dict("records") if is_best(r, best)}


def certified_table(sweep: Sweep, sizes) -> list[dict]:
    """Certified accuracy at the asked sizes from the per-example tables, one row per
    (configuration, certifier): mean ± sd over its repeats, with n."""
    out = []
    for kind in TABLES:
        groups, _ = _table_groups(sweep, kind)
        for gid, (label, tables) in sorted(groups.items()):
            values = np.array([certified_accuracy_at(t, kind, sizes) for t in tables])
            row = {"configuration": label, "certifier": kind, "n": len(tables)}
            for j, s in enumerate(sizes):
                col = f"cert_acc_{s:.6g}" if kind == "native" else f"smooth_cert_acc_{s:.6g}"
                sd = float(values[:, j].std(ddof=1)) if len(tables) > 1 else math.nan
                row[col] = fmt_stat(float(values[:, j].mean()), sd, len(tables))
            out.append(row)
    return out


__all__ = ["TABLES", "attack_label", "best_configuration", "certified_table", "dpal_study", "epsilon_axis", "fit_ylim", "plot_accuracy_vs_epsilon", "plot_accuracy_vs_epsilon_per_attack", "plot_accuracy_vs_size_per_attack",
           "plot_certified_curves", "plot_certified_vs_size_by_mechanism", "plot_pareto", "plot_robustness"]
