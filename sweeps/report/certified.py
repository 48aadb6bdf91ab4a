"""The report's certified-radius figure and table (issue 36, part 3): certified accuracy against
the l2 radius of randomized smoothing, the way the certification literature prints it.

CERTIFY (Cohen et al. 2019, Alg. "certify"; ``dpmech/robustness/smoothing.py``) gives each
certified test image a radius R = sigma Phi^-1(p_A_lower) in dpsweep's [-1, 1] input domain; the
literature's radii are in the [0, 1] pixel domain, half ours (docs/dp_certified.md). The figure's
x axis is the [0, 1] radius (the axis label says so) with the [-1, 1] radius on a second axis on top;
the table's columns name both.

* one curve per configuration (trials that differ only in seed / repeat: the mean of their
  per-example curves, ``data.certified_accuracy_at``);
* per epsilon (per trainable and configured epsilon), the *envelope* over the other swept keys
  (sigma, the training method): at every radius the best configuration's certified accuracy, as
  Cohen et al. (2019, Fig. 7 and Table 2) report "the best sigma per radius". Chosen on the
  certified images themselves, that is a tuning choice on the test subset, and it is labelled so;
* the spec's ``reference`` points on ``smooth_cert_acc_<r>`` (r in the [-1, 1] domain) as black
  dashed lines with stars at r / 2;
* each trainable labelled with what its epsilon protects (``TrainableEntry.epsilon_protects``):
  PixelDP's epsilon is a robustness parameter and protects no training data; SecureSGD's is its
  DP-SGD ledger's (docs/secure_sgd.md);
* N (with n0 and alpha) and the number of certified images beside the figure and in the table.

Only randomized-smoothing certificates (``certification/smoothing.parquet``) are drawn, so every
curve comes from the same certifier at the same radii; a mechanism's own certificate (PixelDP's)
stays in the report's other figures. ``draw_radius_figure`` takes plain curves, so
``benchmarks/dp_certified_mnist.py --docs`` draws the same figure from its results file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sweeps.report.data import (
    SWEEP_COLUMN,
    Sweep,
    as_number,
    certified_accuracy_at,
    finished,
    key_name,
    varying_columns,
    with_groups,
)

RADII_01 = (0.5, 1.0, 1.5, 2.0)          # the literature's headline radii, [0, 1] domain
SMOOTH = re.compile(r"^smooth_cert_acc_([0-9.eE+-]+)$")
SIGMA_KEYS = ("param.noise_augmentation_sigma", "param.smoothing_sigma")  # the smoothing sigma, [-1, 1] domain
EPS_KEYS = ("param.epsilon", "param.eps_t")
XLABEL = "certified l2 radius, [0, 1] pixel domain (the literature's)"
TOP_XLABEL = "l2 radius, [-1, 1] domain (dpsweep's inputs; 2 x the [0, 1] radius)"
LEGEND_ALL = 8            # more configurations than this: the thin curves leave the legend (the table names them)
ANCHOR_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))
TUNING_NOTE = ("per radius the best configuration on the certified images themselves (Cohen et al.'s best sigma "
               "per radius): a tuning choice on the test subset")


@dataclass
class RadiusCurve:
    """One curve of the figure: certified accuracy (fractions) at ``radii01`` ([0, 1] domain)."""

    label: str                      # the configuration, within its family ("noise_augmentation_sigma=1 ...")
    family: str                     # trainable and epsilon ("dpsgd eps 3"): colour and envelope group
    protects: str                   # what the family's epsilon protects (short)
    radii01: np.ndarray
    acc: np.ndarray
    sd: np.ndarray | None = None
    n: int = 1                      # repeats averaged
    best: bool = False              # the best configuration by search.metric
    config: dict = field(default_factory=dict)   # key -> value of the keys that vary within the family
    not_learned: int = 0            # repeats whose model never learned (``not_learned``: accuracy at chance)


def protects_short(trainable: str, epsilon: float) -> str:
    """What a trainable's epsilon protects, for a legend: ``not DP: a robustness parameter``,
    ``non-private``, or ``DP: <what>`` from its registry entry (docs/metrics.md)."""
    from trainables.registry import REGISTRY

    entry = REGISTRY.get(trainable)
    if entry is not None and not entry.privacy_epsilon:
        return "not DP: a robustness parameter, protects no training data"
    if not math.isfinite(epsilon):
        return "non-private"
    what = getattr(entry, "epsilon_protects", "training examples") if entry is not None else "training examples"
    return "DP: " + what.split(" (")[0].split(";")[0]


def protects_long(trainable: str) -> str:
    from trainables.registry import REGISTRY

    entry = REGISTRY.get(trainable)
    if entry is None:
        return ""
    if not entry.privacy_epsilon:
        return (f"`{trainable}`'s epsilon is a robustness parameter of its noise layer: it protects no training "
                "data (docs/pixeldp.md)")
    extra = " (docs/secure_sgd.md)" if trainable == "secure_sgd" else ""
    return f"`{trainable}`'s epsilon protects {entry.epsilon_protects}{extra}"


def _config_epsilon(row) -> float:
    for key in EPS_KEYS:
        v = as_number(row.get(key))
        if math.isfinite(v):
            return v
    return math.nan


def _family(row) -> str:
    from trainables.registry import REGISTRY

    trainable = str(row.get("trainable", ""))
    eps = _config_epsilon(row)
    robust = not getattr(REGISTRY.get(trainable), "privacy_epsilon", True)
    sweep = f"{row[SWEEP_COLUMN]}: " if SWEEP_COLUMN in row and isinstance(row[SWEEP_COLUMN], str) else ""
    if not math.isfinite(eps):
        return f"{sweep}{trainable} non-private"
    return f"{sweep}{trainable} {'robustness eps' if robust else 'eps'} {eps:.3g}"


def _value(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _sigma01(row) -> float:
    """The smoothing sigma in the [0, 1] domain: a DP-SGD / dpal_sound trial's parameter, or the std of a
    PixelDP / SecureSGD noise layer on the input (``noise_after`` 0: the noise it is smoothed with; its
    ``noise_scale`` metric, [-1, 1] domain); NaN where the noise is not on the input."""
    for key in SIGMA_KEYS:
        v = as_number(row.get(key))
        if math.isfinite(v):
            return v / 2.0
    if as_number(row.get("param.noise_after")) == 0:
        v = as_number(row.get("noise_scale"))
        if math.isfinite(v) and v > 0:
            return v / 2.0
    return math.nan


def differing(members: list[dict]) -> list[str]:
    """The ``config`` keys whose values differ between the groups ``members``, in order of appearance."""
    return [k for k in dict.fromkeys(k for g in members for k in g["config"])
            if len({_value(g["config"].get(k)) for g in members}) > 1]


def smoothing_groups(sweep: Sweep) -> list[dict]:
    """The finished trials' smoothing tables, one entry per configuration: ``family``, ``label``,
    ``config``, ``trainable``, ``epsilon`` (configured), ``rows`` (its trials), ``tables``."""
    trials = finished(with_groups(sweep.trials))
    if trials.empty:
        return []
    by_id = trials.set_index("run_id")
    # the keys that take two or more values where they are set (a key another trainable lacks does not count)
    varying = [c for c in varying_columns(trials) if c not in EPS_KEYS and c != SWEEP_COLUMN
               and trials[c].dropna().map(_value).nunique() > 1]
    groups: dict[int, dict] = {}
    for (rid, kind), table in sweep.tables.items():
        if kind != "smoothing" or rid not in by_id.index or not len(table):
            continue
        row = by_id.loc[rid].to_dict()
        row["run_id"] = rid
        g = groups.setdefault(int(row["group"]), {
            "family": _family(row), "trainable": str(row.get("trainable", "")), "epsilon": _config_epsilon(row),
            "config": {key_name(c): row[c] for c in varying if c in row and _value(row[c]) not in ("", "nan", "None")},
            "sigma01": _sigma01(row), "rows": [], "tables": []})
        g["rows"].append(row)
        g["tables"].append(table)
        g["not_learned"] = g.get("not_learned", 0) + int(as_number(row.get("not_learned")) >= 0.5)
    # a curve's label names what tells it from the other configurations of its family (the legend prefixes
    # the family: trainable and epsilon), or, alone in its family, from the trainable's other configurations;
    # never a key only another trainable varies. The sweep-wide keys stay in ``config`` (table, envelope).
    families: dict[str, list[dict]] = {}
    trainables: dict[str, list[dict]] = {}
    for g in groups.values():
        families.setdefault(g["family"], []).append(g)
        trainables.setdefault(g["trainable"], []).append(g)
    for g in groups.values():
        keys = differing(families[g["family"]]) or differing(trainables[g["trainable"]])
        g["label"] = " ".join(f"{k}={_value(g['config'][k])}" for k in keys if k in g["config"]) or g["trainable"]
    return [groups[k] for k in sorted(groups)]


def _logged(groups: list[dict], key: str) -> list[float]:
    """The distinct finite values the trials of ``groups`` logged under ``key``, sorted."""
    return sorted(v for v in {as_number(r.get(key)) for g in groups for r in g["rows"]} if math.isfinite(v))


def _n_text(g: dict) -> str:
    """`` at N 10,000`` (the largest logged N of a configuration's trials), or nothing."""
    ns = _logged([g], "param.certify_n")
    return f" at N {int(ns[-1]):,}" if ns else ""


def _counts(groups: list[dict]) -> str:
    """``N 100,000 (n0 100, alpha 0.001); 500 certified images`` over the drawn models."""
    ns, n0s = _logged(groups, "param.certify_n"), _logged(groups, "param.smoothing_n0")
    alphas = _logged(groups, "param.smoothing_alpha")
    images = sorted({len(t) for g in groups for t in g["tables"]})
    text = "CERTIFY N " + (" / ".join(f"{int(n):,}" for n in ns) if ns else "not logged")
    extra = [f"n0 {' / '.join(f'{int(v)}' for v in n0s)}" if n0s else "",
             f"alpha {' / '.join(f'{v:g}' for v in alphas)}" if alphas else ""]
    extra = [e for e in extra if e]
    if extra:
        text += f" ({', '.join(extra)})"
    return text + f"; {' / '.join(str(i) for i in images)} certified images per model"


def radius_curves(sweep: Sweep, best: dict | None = None, points: int = 200) -> tuple[list[RadiusCurve], str]:
    """One ``RadiusCurve`` per configuration with a smoothing table, on a [0, 1]-domain grid up to
    the largest certified radius, and the N / images note."""
    from sweeps.report.plots import is_best

    groups = smoothing_groups(sweep)
    if not groups:
        return [], ""
    top = max(float(np.nanmax(t["radius"].to_numpy(np.float64), initial=0.0)) for g in groups for t in g["tables"])
    grid = np.linspace(0.0, max(top / 2.0, 0.05) * 1.02, points)
    curves = []
    for g in groups:
        acc = np.array([certified_accuracy_at(t, "smoothing", 2.0 * grid) for t in g["tables"]])
        sd = acc.std(axis=0, ddof=1) if len(acc) > 1 else None
        first = dict(g["rows"][0])
        curves.append(RadiusCurve(g["label"], g["family"], protects_short(g["trainable"], g["epsilon"]), grid,
                                  acc.mean(axis=0), sd, len(acc), is_best(first, best), dict(g["config"]),
                                  g.get("not_learned", 0)))
    return curves, _counts(groups)


def envelopes(curves: list[RadiusCurve]) -> list[tuple[RadiusCurve, list[RadiusCurve]]]:
    """Per family with two or more configurations: (the envelope, its members). The envelope's
    value at each radius is the largest mean certified accuracy of a member there (Cohen et al.'s
    best sigma per radius); its label names the keys it runs over."""
    fams: dict[str, list[RadiusCurve]] = {}
    for c in curves:
        fams.setdefault(c.family, []).append(c)
    out = []
    for fam, members in fams.items():
        if len(members) < 2:
            continue
        keys = [k for k in dict.fromkeys(k for m in members for k in m.config)
                if len({_value(m.config.get(k)) for m in members}) > 1]
        env = RadiusCurve(f"envelope over {', '.join(keys) or 'configurations'}", fam, members[0].protects,
                          members[0].radii01, np.max([m.acc for m in members], axis=0), None,
                          min(m.n for m in members))
        out.append((env, members))
    return out


def anchors_from_refs(refs) -> list[tuple[str, list[tuple[float, float]]]]:
    """The spec's reference points on ``smooth_cert_acc_<r>`` ([-1, 1] radius r) as (label, [(r / 2,
    published)]) (the report draws only points some trial of the sweep matches)."""
    out: dict[str, list] = {}
    for r in refs:
        m = SMOOTH.match(str(r.get("metric", "")))
        if m is None or not r.get("_matched", True):
            continue
        out.setdefault(r["point"], []).append((float(m.group(1)) / 2.0, float(r["published"])))
    return [(label, sorted(pts)) for label, pts in out.items()]


def draw_radius_figure(curves: list[RadiusCurve], path: Path, *, anchors=(), note: str = "",
                       title: str = "") -> bool:
    """Certified accuracy against the l2 radius ([0, 1] domain on the x axis, [-1, 1] on top):
    a thin curve per configuration, a thick envelope per family (``envelopes``), the published
    ``anchors`` [(label, [(radius01, accuracy)])], ``note`` (N and images) under the title; the y
    range fitted to what is drawn. Writes ``path`` (PNG) and a PDF beside it."""
    from sweeps.report.plots import _plt, _save, fit_ylim, style

    if not curves:
        return False
    plt = _plt()
    fams = list(dict.fromkeys(c.family for c in curves))
    envs = {env.family: (env, members) for env, members in envelopes(curves)}
    show_all = len(curves) <= LEGEND_ALL

    def name(fam, protects):
        return fam if protects == "non-private" else f"{fam} ({protects})"

    fig, ax = plt.subplots(figsize=(7.2, 6.2), dpi=120)
    for i, fam in enumerate(fams):
        st = style(i)
        members = [c for c in curves if c.family == fam]
        alone = fam not in envs
        for j, c in enumerate(members):
            text = f"{name(fam, c.protects)}: {c.label}" + (f", n={c.n}" if c.n > 1 else "") \
                + (" [best configuration]" if c.best else "") + (f" {not_learned_mark(c.not_learned, c.n)}"
                                                                  if c.not_learned else "")
            lw = 2.4 if alone else 1.0
            # a model at chance is drawn grey and dotted, and always named: never read as a result beside
            # the published points (issue 51.4)
            ax.plot(c.radii01, c.acc, color="grey" if c.not_learned else st["color"],
                    lw=lw + (1.2 if c.best else 0.0),
                    ls=":" if c.not_learned else (("-", "--", ":", "-.")[j % 4] if not alone else "-"),
                    alpha=0.95 if alone else 0.5,
                    label=text if (show_all or alone or c.best or c.not_learned) else "_" + text)
            if c.sd is not None:
                ax.fill_between(c.radii01, c.acc - c.sd, c.acc + c.sd, color=st["color"], alpha=0.1, lw=0)
        if not alone:
            env = envs[fam][0]
            ax.plot(env.radii01, env.acc, color=st["color"], lw=2.8, marker=st["marker"],
                    markevery=max(1, len(env.radii01) // 10), ms=5,
                    label=f"{name(fam, env.protects)}: {env.label}")
    for k, (label, pts) in enumerate(anchors):
        x, y = zip(*pts)
        ax.plot(x, y, color="black", ls=ANCHOR_STYLES[k % len(ANCHOR_STYLES)], lw=1.1, marker="*", ms=10,
                markeredgecolor="white", zorder=5, label=f"published: {label}")
    ax.set_xlabel(XLABEL)
    top = ax.secondary_xaxis("top", functions=(lambda r: 2.0 * r, lambda r: r / 2.0))
    top.set_xlabel(TOP_XLABEL, fontsize=8)
    ax.set_ylabel("certified accuracy" + (" (mean over repeats)" if any(c.n > 1 for c in curves) else ""))
    # the published points stay on the chart when the sweep's models certify smaller radii
    reach = max([float(c.radii01[-1]) for c in curves] + [1.04 * float(x) for _, pts in anchors for x, _ in pts])
    ax.set_xlim(0.0, reach)
    fit_ylim(ax)
    ax.grid(alpha=0.3)
    import textwrap

    # wrapped to the figure's width: a note naming N and images per family runs long
    ax.set_title("\n".join(textwrap.fill(t, 110) for t in (title, note) if t), fontsize=8)
    # the legend hangs a fixed distance (points) below the x label: an offset in axes fractions put it over
    # the label when a long title left the axes short
    from matplotlib.transforms import offset_copy

    fig.canvas.draw()
    below = (ax.get_window_extent().y0 - ax.xaxis.label.get_window_extent().y0) * 72.0 / fig.dpi + 4.0
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=1, title=None if show_all else
              "thin: each configuration (table below)", title_fontsize=6,
              bbox_transform=offset_copy(ax.transAxes, fig=fig, y=-below, units="points"))
    _save(fig, ax, path)
    return True


def _pct(v: float) -> str:
    return f"{100.0 * v:.1f}" if math.isfinite(v) else ""


def reach01(g: dict) -> float:
    """The largest [0, 1]-domain radius CERTIFY could return for configuration ``g`` (its sigma_[0,1] and the
    largest logged N and alpha of its trials, so that no trial of it could reach further;
    ``dpmech.robustness.smoothing.max_radius``): certified accuracy beyond it is 0 by construction. Infinite
    where sigma or N is unknown (nothing is claimed then)."""
    from dpmech.robustness.smoothing import max_radius

    ns = [n for n in _logged([g], "param.certify_n") if n >= 1]
    alphas = [a for a in _logged([g], "param.smoothing_alpha") if 0 < a < 0.5]
    if not ns or not math.isfinite(g["sigma01"]) or g["sigma01"] <= 0:
        return math.inf
    return max_radius(g["sigma01"], int(ns[-1]), alphas[-1] if alphas else 0.001)


def _beyond(reach: float, n_text: str) -> str:
    return f"0.0 (beyond reach: r_[0,1] <= {reach:.2f}{n_text})"


def radius_columns(radii01=RADII_01) -> list[str]:
    return [f"r_[0,1] {r:g} (r_[-1,1] {2 * r:g})" for r in radii01]


def not_learned_mark(k: int, n: int) -> str:
    """``[did not learn: 1/3 at chance]``: repeats of a configuration whose model never learned."""
    return f"[did not learn: {k}/{n} at chance]"


def table_radii01(sweep: Sweep, refs=()) -> tuple[float, ...]:
    """The table's radii ([0, 1] domain): the sizes the trials certified at (their ``certify_sizes``, logged
    as ``smooth_cert_acc_<size>`` in the [-1, 1] domain; 0 left out) and the published points' radii; the
    literature's ``RADII_01`` when no trial logged a size (issue 51.4: a spec's sigma 0.25 asks for radii the
    literature's 2.0 is beyond)."""
    sizes = {float(m.group(1)) / 2.0 for c in sweep.trials.columns if (m := SMOOTH.match(str(c)))}
    sizes = {round(r, 9) for r in sizes if r > 0}
    if not sizes:
        return RADII_01
    sizes |= {round(x, 9) for _, pts in anchors_from_refs(refs) for x, _ in pts}
    return tuple(sorted(sizes))


def radius_records(sweep: Sweep, refs=(), radii01=RADII_01, best: dict | None = None) -> list[dict]:
    """The table's numbers: one record per configuration, per family's envelope and per published
    anchor. Each has ``kind`` (configuration / envelope / published), ``configuration``, ``protects``,
    ``epsilon`` (measured, the largest of its repeats), ``sigma01``, ``n``, ``counts`` (N and images),
    ``not_learned`` (repeats at chance) and ``cells``: per radius ``{mean, sd, n, beyond_reach, reach01,
    chosen}`` (fractions; ``chosen``: the configuration an envelope takes there)."""
    from sweeps.report.plots import is_best

    groups = smoothing_groups(sweep)
    if not groups:
        return []
    records, per_family = [], {}
    for g in groups:
        acc = np.array([certified_accuracy_at(t, "smoothing", [2.0 * r for r in radii01]) for t in g["tables"]])
        eps = [e for e in (as_number(r.get("epsilon")) for r in g["rows"]) if math.isfinite(e)]
        reach = reach01(g)
        cells = []
        for j, r01 in enumerate(radii01):
            beyond = bool(r01 > reach and not acc[:, j].any())     # 0 by construction: said, not a bare 0
            cells.append({"mean": float(acc[:, j].mean()), "sd": float(acc[:, j].std(ddof=1)) if len(acc) > 1
                          else math.nan, "n": len(acc), "beyond_reach": beyond, "reach01": reach, "chosen": ""})
        records.append({"kind": "configuration", "configuration": f"{g['family']}: {g['label']}",
                        "best": is_best(g["rows"][0], best), "trainable": g["trainable"],
                        "protects": protects_short(g["trainable"], g["epsilon"]),
                        "epsilon": max(eps) if eps else math.nan, "sigma01": g["sigma01"], "n": len(acc),
                        "counts": _counts([g]).replace("CERTIFY ", ""), "n_text": _n_text(g),
                        "not_learned": g.get("not_learned", 0), "cells": cells})
        per_family.setdefault(g["family"], []).append((g, acc.mean(axis=0)))
    for fam, members in per_family.items():
        if len(members) < 2:
            continue
        keys = differing([g for g, _ in members])
        reach = max(reach01(g) for g, _ in members)
        cells = []
        for j, r01 in enumerate(radii01):
            g, acc = max(members, key=lambda m: m[1][j])
            cells.append({"mean": float(acc[j]), "sd": math.nan, "n": len(g["tables"]),
                          "beyond_reach": bool(r01 > reach and not acc[j]), "reach01": reach, "chosen": g["label"]})
        records.append({"kind": "envelope", "best": False, "trainable": members[0][0]["trainable"],
                        "configuration": f"{fam}: envelope over {', '.join(keys) or 'configurations'} (best per "
                                         "radius: a tuning choice)",
                        "protects": protects_short(members[0][0]["trainable"], members[0][0]["epsilon"]),
                        "epsilon": math.nan, "sigma01": math.nan, "n": min(len(g["tables"]) for g, _ in members),
                        "counts": _counts([g for g, _ in members]).replace("CERTIFY ", ""), "n_text": "",
                        "not_learned": sum(g.get("not_learned", 0) for g, _ in members), "cells": cells})
    for label, pts in anchors_from_refs(refs):
        cells = [{"mean": next((y for x, y in pts if math.isclose(x, r01, rel_tol=1e-9)), math.nan), "sd": math.nan,
                  "n": math.nan, "beyond_reach": False, "reach01": math.nan, "chosen": ""} for r01 in radii01]
        records.append({"kind": "published", "best": False, "trainable": "", "configuration": f"published: {label}",
                        "protects": "", "epsilon": math.nan, "sigma01": math.nan, "n": "",
                        "counts": "as published (spec reference)", "n_text": "", "not_learned": 0, "cells": cells})
    return records


def radius_table(sweep: Sweep, refs=(), radii01=RADII_01, best: dict | None = None,
                 records: list[dict] | None = None) -> list[dict]:
    """Certified accuracy (%) at ``radii01`` ([0, 1] domain; the column names say both domains), for
    the page: a row per configuration (mean ± sd over its repeats, n; one that did not learn flagged), a
    row per family's envelope (each cell names the configuration that gives it: a tuning choice on the
    certified images), and the published anchors of the spec's reference block (``radius_records``, or
    ``records`` already computed at ``radii01``)."""
    cols = radius_columns(radii01)
    rows = []
    for rec in records if records is not None else radius_records(sweep, refs, radii01, best):
        row = {"configuration": rec["configuration"] + (" [best]" if rec["best"] else ""),
               "epsilon protects": rec["protects"]}
        if rec["kind"] == "configuration":
            row["epsilon (measured)"] = f"{rec['epsilon']:.4g}" if math.isfinite(rec["epsilon"]) else ""
            row["sigma_[0,1] (sigma_[-1,1])"] = (f"{rec['sigma01']:g} ({2 * rec['sigma01']:g})"
                                                 if math.isfinite(rec["sigma01"]) else "")
        row["n"] = rec["n"]
        row["N, images"] = rec["counts"]
        if rec["not_learned"]:
            row["learned"] = "! " + not_learned_mark(rec["not_learned"], rec["n"])[1:-1]
        for c, cell in zip(cols, rec["cells"]):
            if rec["kind"] == "published":
                row[c] = _pct(cell["mean"])
            elif cell["beyond_reach"]:
                row[c] = _beyond(cell["reach01"], rec["n_text"] if rec["kind"] == "configuration"
                                 else " for every configuration")
            elif rec["kind"] == "envelope":
                row[c] = f"{_pct(cell['mean'])} ({cell['chosen']})"
            else:
                row[c] = _pct(cell["mean"]) + (f" ± {100.0 * cell['sd']:.1f}" if cell["n"] > 1 else "")
        rows.append(row)
    return rows


def radius_csv_rows(records: list[dict], radii01=RADII_01) -> list[dict]:
    """``certified_radius.csv``: numbers in columns (issue 51.4), percentages: per radius
    ``r01_<r>_mean``, ``_sd``, ``_n`` and ``_beyond_reach`` (CERTIFY cannot certify that far: 0 by
    construction), and an envelope's ``_chosen`` configuration."""
    out = []
    for rec in records:
        row = {"kind": rec["kind"], "configuration": rec["configuration"], "best": int(bool(rec["best"])),
               "epsilon_protects": rec["protects"],
               "epsilon": rec["epsilon"] if math.isfinite(rec["epsilon"]) else "",
               "sigma_01": rec["sigma01"] if math.isfinite(rec["sigma01"]) else "",
               "n": rec["n"], "did_not_learn": rec["not_learned"], "certify": rec["counts"]}
        for r01, cell in zip(radii01, rec["cells"]):
            k = f"r01_{r01:g}"
            row[f"{k}_mean"] = round(100.0 * cell["mean"], 4) if math.isfinite(cell["mean"]) else ""
            row[f"{k}_sd"] = round(100.0 * cell["sd"], 4) if math.isfinite(cell["sd"]) else ""
            row[f"{k}_n"] = cell["n"] if isinstance(cell["n"], int) else ""
            row[f"{k}_beyond_reach"] = int(cell["beyond_reach"])
            if rec["kind"] == "envelope":
                row[f"{k}_chosen"] = cell["chosen"]
        out.append(row)
    return out


def certified_radius_section(sweep: Sweep, refs, out: Path, best: dict | None = None,
                             md_table=None, split: str = "none") -> tuple[list[str], list[Path]]:
    """The report's section: the table (also ``certified_radius.csv``, numbers in columns) and the
    figure (``certified_radius.png`` and its PDF); ([], []) when no trial logged a smoothing table.
    ``split``: the spec's ``selection.split``, said beside the figure and the table (which images the
    curves are on)."""
    from sweeps.report.plots import _matches_any

    refs = [dict(r, _matched=_matches_any(sweep.trials, r["_where"])) for r in refs]
    curves, note = radius_curves(sweep, best)
    if not curves:
        return [], []
    from sweeps.report.best import SELECTION_IMAGES

    where = (f"on {SELECTION_IMAGES[split]}; the other images' figures are the trials' "
             "`heldout_smooth_cert_acc_<r>` (best configuration above)") if split in SELECTION_IMAGES else ""
    note_where = f"{note}; on {SELECTION_IMAGES[split].split(' (')[0]}" if where else note
    fname = "certified_radius.png"
    draw_radius_figure(curves, out / fname, anchors=anchors_from_refs(refs), note=note_where,
                       title="Randomized smoothing: certified accuracy against l2 radius")
    radii01 = table_radii01(sweep, refs)
    records = radius_records(sweep, refs, radii01, best)
    import csv

    csv_rows = radius_csv_rows(records, radii01)
    with open(out / "certified_radius.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in csv_rows for k in r)))
        w.writeheader()
        w.writerows(csv_rows)
    rows = radius_table(sweep, refs, radii01, best, records)
    trainables = list(dict.fromkeys(g["trainable"] for g in smoothing_groups(sweep)))
    protects = "; ".join(p for p in (protects_long(t) for t in trainables) if p)
    chance = (" A configuration flagged `did not learn` has a repeat whose model stayed at chance accuracy "
              "(`not_learned`): its curve is grey and dotted, not a result." if any(r["not_learned"] for r in records)
              else "")
    table = md_table(rows) if md_table else []
    lines = ["## Certified accuracy against l2 radius (randomized smoothing)", "",
             f"{note}{'; ' + where if where else ''}. Radii in the [0, 1] pixel domain (the literature's) with the "
             "[-1, 1] radius of dpsweep's inputs beside it (twice as large), at the radii the trials certified "
             "(`certify_sizes`, halved) and the published points'; certified accuracy in %, mean ± sd over each "
             f"configuration's n repeats. Envelope rows: {TUNING_NOTE}. Published rows: the spec's reference "
             f"block. {protects}.{chance}", "",
             *table, "", f"![certified accuracy against l2 radius]({fname})", "",
             f"A thin curve per configuration, a thick one per epsilon: the envelope over the other swept keys "
             f"({TUNING_NOTE}); black: published. {note_where}. Numbers: "
             "[certified_radius.csv](certified_radius.csv) (mean, sd and n per radius). Vector: "
             f"[{Path(fname).with_suffix('.pdf').name}]({Path(fname).with_suffix('.pdf').name}).", ""]
    files = [out / fname, (out / fname).with_suffix(".pdf"), out / "certified_radius.csv"]
    return lines, files


__all__ = ["RADII_01", "RadiusCurve", "certified_radius_section", "draw_radius_figure", "envelopes",
           "radius_csv_rows", "radius_curves", "radius_records", "radius_table", "table_radii01"]
