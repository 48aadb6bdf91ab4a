"""The report's "Membership inference" section (issue 52; docs/mia.md, docs/report.md): every trial
with the ``mia`` key, its attack's AUC and TPR at low FPR and the epsilon lower bound the attack
implies, beside the trial's claim (its epsilon) and, where it was audited, the audit's one-run bound;
a table per (mechanism, attack, epsilon) -- means over the configuration's trials -- and a figure
against epsilon per mechanism; and the ``label_attack`` key's label-inference table (label_dp trials:
advantage and the label epsilon the guesses refute, beside the trial's label epsilon).

An attack's figures and an audit's bound are lower bounds on what leaks; epsilon is an upper bound.
A bound above the claim refutes it; below it, it proves nothing.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

from sweeps.report.data import as_number as _num

NON_PRIVATE = "non-private"


def _attack(row) -> str:
    raw = row.get("param.mia")
    if isinstance(raw, dict):
        return str(raw.get("attack", "?"))
    if isinstance(raw, str):
        for parse in (json.loads, ast.literal_eval):
            try:
                value = parse(raw)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, dict):
                return str(value.get("attack", "?"))
    flag = _num(row.get("mia_attack_rmia"))
    return "?" if not math.isfinite(flag) else ("rmia" if flag == 1.0 else "lira")


def mia_rows(trials) -> list[dict]:
    """One row per (mechanism, attack, epsilon): the trials' means (and their count)."""
    if "mia_auc" not in trials or not trials["mia_auc"].notna().any():
        return []
    attacked = trials[trials["mia_auc"].notna()]
    groups: dict[tuple, list] = {}
    for _, r in attacked.iterrows():
        eps = _num(r.get("epsilon"))
        key = (str(r.get("trainable", "")), _attack(r), round(eps, 3) if math.isfinite(eps) else math.inf)
        groups.setdefault(key, []).append(r)
    out = []
    for (trainable, attack, eps), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        def mean(col):
            vals = [_num(r.get(col)) for r in rs]
            vals = [v for v in vals if math.isfinite(v)]
            return sum(vals) / len(vals) if vals else math.nan

        def spread(col):
            vals = [v for v in (_num(r.get(col)) for r in rs) if math.isfinite(v)]
            if len(vals) < 2:
                return math.nan
            m = sum(vals) / len(vals)
            return math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))

        lb, audit = mean("mia_eps_lb"), mean("audit_epsilon_lb")
        refuted = any(_num(r.get("mia_eps_lb")) > _num(r.get("epsilon")) for r in rs)
        out.append({"mechanism": trainable, "attack": attack,
                    "epsilon (claim)": eps, "trials": len(rs),
                    "AUC": mean("mia_auc"), "AUC std": spread("mia_auc"),
                    "AUC interval": f"[{mean('mia_auc_lo'):.3f}, {mean('mia_auc_hi'):.3f}]",
                    "TPR @ 0.1% FPR": mean("mia_tpr_at_fpr_0.001"), "TPR @ 1% FPR": mean("mia_tpr_at_fpr_0.01"),
                    "attack eps_lb": lb, "audit eps_lb": audit,
                    "candidates": mean("mia_candidates"), "references": mean("mia_references"),
                    "consistent": "**NO**" if refuted else "yes"})
    return out


def _fmt(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if k == "epsilon (claim)":
            out[k] = NON_PRIVATE if math.isinf(v) else f"{v:g}"
        elif isinstance(v, float):
            out[k] = "" if not math.isfinite(v) else (f"{v:.0f}" if k in ("candidates", "references") else f"{v:.3f}")
        else:
            out[k] = v
    return out


def label_rows(trials) -> list[dict]:
    """The ``label_attack`` key's trials (label_dp): one row per (mechanism, label epsilon), the means of
    the label-inference figures beside the claim (the trial's ``label_epsilon``)."""
    if "label_inference_eps_lb" not in trials or not trials["label_inference_eps_lb"].notna().any():
        return []
    groups: dict[tuple, list] = {}
    for _, r in trials[trials["label_inference_eps_lb"].notna()].iterrows():
        eps = _num(r.get("label_epsilon"))
        key = (str(r.get("trainable", "")), str(r.get("param.mechanism", "?")),
               round(eps, 3) if math.isfinite(eps) else math.inf)
        groups.setdefault(key, []).append(r)
    out = []
    for (trainable, mechanism, eps), rs in sorted(groups.items(), key=lambda kv: kv[0]):
        def mean(col):
            vals = [v for v in (_num(r.get(col)) for r in rs) if math.isfinite(v)]
            return sum(vals) / len(vals) if vals else math.nan

        refuted = any(_num(r.get("label_inference_eps_lb")) > _num(r.get("label_epsilon")) for r in rs)
        out.append({"mechanism": f"{trainable} {mechanism}", "label epsilon (claim)": eps, "trials": len(rs),
                    "attack accuracy": mean("label_inference_accuracy"),
                    "prior accuracy": mean("label_inference_prior_accuracy"),
                    "advantage": mean("label_inference_advantage"), "attack eps_lb": mean("label_inference_eps_lb"),
                    "examples": mean("label_inference_examples"),
                    "consistent": "**NO**" if refuted else "yes"})
    return out


def _fmt_label(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if k == "label epsilon (claim)":
            out[k] = NON_PRIVATE if math.isinf(v) else f"{v:g}"
        elif isinstance(v, float):
            out[k] = "" if not math.isfinite(v) else (f"{v:.0f}" if k == "examples" else f"{v:.3f}")
        else:
            out[k] = v
    return out


def _label_lines(trials, md_table) -> list[str]:
    rows = label_rows(trials)
    if not rows:
        return []
    return ["", "### Label inference: attack beside the label epsilon", "",
            "Each label_dp trial with the `label_attack` key was attacked after training (docs/mia.md, \"Label DP in a "
            "sweep\"): the labels of its audited training examples were drawn from the uniform prior by the trial's "
            "secret key before the release; the attacker guessed each from the model's output. Advantage: the "
            "attack's accuracy minus the prior's (1/K). `attack eps_lb`: the label epsilon the guesses refute at the "
            "attack's confidence (Kalemaj et al.'s label-inference audit with a known prior), beside the claim, the "
            "trial's label epsilon (labels only: nothing here is about images or membership). A bound above the "
            "claim refutes it (\"consistent\": NO); below it, it proves nothing.", "",
            *md_table([_fmt_label(r) for r in rows])]


def section_lines(trials, md_table) -> list[str]:
    """The report's "Membership inference" section (``md_table`` renders rows), with the label-inference
    table of ``label_attack`` trials; [] without attacks."""
    rows = mia_rows(trials)
    if not rows:
        return _label_lines(trials, md_table)
    return ["", "### Membership inference: attack beside audit and claim", "",
            "Each trial with the `mia` key was attacked after training (docs/mia.md): a pool of candidates, each "
            "in its training set by a secret fair coin; offline RMIA or LiRA with reference models trained on "
            "population data. AUC (1/2: no better than a coin), TPR at 0.1% and 1% FPR, and the epsilon lower bound "
            "the attack implies at the trial's delta (`mia_eps_lb`, one-run bound at the attack's confidence), beside "
            "the claim (the trial's epsilon) and the white-box audit's bound (`audit_epsilon_lb`) where the trial "
            "was audited. Means over the trials of each row. Every figure here is a lower bound on what leaks, "
            "epsilon an upper bound: a bound above the claim refutes it (\"consistent\": NO); below it, it proves "
            "nothing.", "", *md_table([_fmt(r) for r in rows]), *_label_lines(trials, md_table)]


def plot_membership_inference(trials, path: Path) -> bool:
    """AUC, TPR at low FPR and the lower bounds against epsilon, a line per (mechanism, attack); the
    non-private rows at the right end; the audit's bound and the claim (y = x) in the third panel."""
    rows = mia_rows(trials)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r["epsilon (claim)"] for r in rows if math.isfinite(r["epsilon (claim)"])]
    right = 2 * max(finite) if finite else 10.0
    x_of = (lambda e: right if math.isinf(e) else e)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    series: dict[tuple, list] = {}
    for r in rows:
        series.setdefault((r["mechanism"], r["attack"]), []).append(r)
    for (mech, attack), rs in series.items():
        rs = sorted(rs, key=lambda r: x_of(r["epsilon (claim)"]))
        xs = [x_of(r["epsilon (claim)"]) for r in rs]
        label = f"{mech}, {attack.upper()}"
        axes[0].errorbar(xs, [r["AUC"] for r in rs], yerr=[0 if math.isnan(r["AUC std"]) else r["AUC std"] for r in rs],
                         marker="o", capsize=3, label=label)
        axes[1].plot(xs, [r["TPR @ 0.1% FPR"] for r in rs], marker="o", label=f"{label}, 0.1% FPR")
        axes[1].plot(xs, [r["TPR @ 1% FPR"] for r in rs], marker="s", linestyle="--", label=f"{label}, 1% FPR")
        axes[2].plot(xs, [r["attack eps_lb"] for r in rs], marker="o", label=f"{label}: attack eps_lb")
        audited = [(x, r["audit eps_lb"]) for x, r in zip(xs, rs) if math.isfinite(r["audit eps_lb"])]
        if audited:
            axes[2].plot(*zip(*audited), marker="^", linestyle=":", label=f"{mech}: audit eps_lb")
    if finite:
        axes[2].plot(sorted(set(finite)), sorted(set(finite)), "k--", lw=0.8, label="claim (epsilon)")
    axes[0].axhline(0.5, color="grey", lw=0.5)
    ticks = sorted({x_of(r["epsilon (claim)"]) for r in rows})
    for ax, title in zip(axes, ("AUC", "TPR at low FPR", "epsilon: lower bounds and the claim")):
        ax.set_xscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([NON_PRIVATE if t == right and not (t in finite) else f"{t:g}" for t in ticks])
        ax.set_xlabel("epsilon (claim)")
        ax.set_title(title)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
