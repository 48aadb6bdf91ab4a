"""``dpsweep report``: the trade-offs of a sweep, read back from MLflow, on one summary page.

``--run A --run B`` (or ``--run A,B``) compares several sweeps of the experiment in one report: a
``sweep`` column in every table, a series per sweep in every figure, a privacy section and a best
trial per sweep; without ``--run`` the latest sweep, and the page says which other sweeps the
experiment holds and how to include them.

Repeats of a configuration (``search.num_samples``: trials that differ only in ``seed`` and
``repeat``) are grouped by their configured parameters and shown as mean ± standard deviation
with n in every table, and with error bars (bands for curves) in every figure.

Writes to ``--out`` and logs to the sweep's parent run under ``report/``:

* ``report.md``: the summary page — the privacy of the sweep (per-trial privacy epsilon, and
  either the end-to-end epsilon of a ``tuning_privacy`` sweep with the released trial, or a plain
  statement that the selection among trials is not covered), the best trial by ``search.metric``
  with that caveat and the address of MLflow's compare view of the trials, empirical audits beside
  the claimed epsilon, the spec's published values beside the measured ones (its ``reference``
  block), the trials table per configuration (with the privacy parameters epsilon, epsilon_pld,
  delta, sigma, q and steps where logged), certified accuracy at the asked sizes, and every figure;
* ``trials.csv`` (every trial's parameters and final metrics), ``trials_aggregated.csv`` (per
  configuration: ``<metric>``, ``<metric>.sd``, ``<metric>.n``, ``n``) and
  ``certified_accuracy.csv`` (certified accuracy at ``--sizes``, from the per-example tables);
* ``pareto_accuracy.png`` / ``pareto_certified.png``: privacy epsilon against conventional and
  certified accuracy, a series per value of the other swept keys, each with its Pareto front
  (privacy epsilons only); ``accuracy_vs_epsilon.png``: clean accuracy against the configured
  epsilon, a line per value of the other swept keys;
  ``robustness_accuracy.png`` / ``robustness_certified.png``: the same against the configured
  robustness epsilon of robustness mechanisms (PixelDP);
* ``cert_acc_vs_size.png`` (and ``smooth_cert_acc_vs_size.png``): certified accuracy against the
  attack size from the per-example tables, one curve per configuration;
* the layouts of the DPAL paper's figures when the sweep has their data: ``fig2_accuracy_vs_epsilon.png``,
  ``fig4_accuracy_vs_attack_size.png``, ``fig6_certified_vs_attack_size.png``;
* mechanism-specific figures (label DP's accuracy and MSE against epsilon).

Published values (the spec's ``reference`` block) are black stars on the figures they belong to.
Every figure draws a series (colour and marker, legend) per value of the swept keys off its axes,
labels log axes in plain decimals and is also written as a PDF. A report of one sweep is logged
under ``report/`` on its parent run; a comparison under ``report_comparison/`` on each compared one.
"""

from __future__ import annotations

import math
from pathlib import Path

from sweeps.report import plots as rp
from sweeps.report.data import (
    SWEEP_COLUMN,
    Sweep,
    aggregate,
    finished,
    fmt_stat,
    key_name,
    load_sweep,
    load_sweeps,
    load_tables,
    other_sweeps,
    reference_rows,
    with_groups,
)
from sweeps.words import all_of, counted
from trainables.tracking import retry

DEFAULT_SIZES = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
HIDDEN = ("run_id",)


def _fmt(v) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def _md_table(rows: list[dict], cols: list[str] | None = None) -> list[str]:
    if not rows:
        return ["(none)"]
    if cols is None:
        cols = []
        for r in rows:
            cols += [k for k in r if k not in cols]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return out


# the privacy parameters a paper's table needs, as the summary table heads them (docs/metrics.md)
PRIVACY_HEADERS = {"epsilon": "epsilon (RDP)", "noise_multiplier": "sigma", "sampling_rate": "q"}


def _headline_metrics(trials) -> list[str]:
    """The headline metrics of the summary page: privacy (epsilon, epsilon_pld, delta, sigma, q,
    steps), robustness parameters, accuracies."""
    first = ("epsilon", "epsilon_pld", "delta", "noise_multiplier", "sampling_rate", "steps", "epsilon_lower_bound",
             "robustness_epsilon_config", "robustness_epsilon")
    metrics = [c for c in trials.columns if c in first or c == "acc_clean"
               or str(c).startswith(("acc_", "cert_acc_", "smooth_cert_acc_", "heldout_acc_", "heldout_cert_acc_",
                                     "heldout_smooth_cert_acc_")) and c not in ("acc_clean_expected",
                                                                                "heldout_acc_clean_expected")]
    metrics.sort(key=lambda c: (c not in first, first.index(c) if c in first else 0, c != "acc_clean", c))
    return metrics


def aggregated_rows(trials) -> tuple[list[dict], list[str]]:
    """The summary page's trials table: one row per configuration (repeats that differ only in
    seed/repeat aggregated), its varying configured parameters, n, and each headline metric as
    mean ± sd (with (k) when only k of the n trials have it). A configuration some repeat of which
    did not learn is flagged ``!`` (``not_learned``: accuracy not above chance); one whose final
    train loss sat near ln K gets a hint (``loss_near_chance``), which is no verdict."""
    agg = aggregate(trials)
    if agg.empty:
        return [], []
    fin = finished(with_groups(trials))
    swept = [c for c in agg.columns if (str(c).startswith("param.") or c == SWEEP_COLUMN) and c != "param.trainable"
             and agg[c].astype(str).nunique() > 1]
    metrics = _headline_metrics(fin)
    rows = []
    for r in agg.to_dict("records"):
        row = {"configuration": r["runs"] if r["n"] == 1 else f"{r['n']} repeats: {r['runs']}",
               "trainable": r["trainable"]}
        # configured, not measured (cfg.<key>); the sweep a row comes from when several are compared
        row.update({c if c == SWEEP_COLUMN else f"cfg.{key_name(c)}": r[c] for c in swept})
        row["n"] = r["n"]
        for m in metrics:
            row[PRIVACY_HEADERS.get(m, m) if "epsilon_pld" in metrics or m != "epsilon" else m] = fmt_stat(r.get(m, math.nan), r.get(f"{m}.sd", math.nan), int(r.get(f"{m}.n", 0)), of=r["n"])
        bad = r.get("not_learned", 0.0) * r.get("not_learned.n", 0)
        if isinstance(bad, float) and math.isfinite(bad) and bad > 0:
            row["learned"] = f"! {int(round(bad))}/{r['n']} did not learn"
        hint = r.get("loss_near_chance", 0.0) * r.get("loss_near_chance.n", 0)
        if isinstance(hint, float) and math.isfinite(hint) and hint > 0:  # a hint, not a verdict (docs/metrics.md)
            note = f"hint: train loss near ln K in {int(round(hint))}/{r['n']}"
            row["learned"] = f"{row['learned']}; {note}" if "learned" in row else note
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return rows, cols


def _reference_section(sweep: Sweep, refs: list[dict]) -> list[str]:
    ref = sweep.reference
    if not ref:
        return []
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in refs]
    lines = ["## Published vs measured", "", f"Published: {ref.get('citation', '')}."]
    if ref.get("note"):
        lines.append(f"Units: {ref['note']}.")
    lines += ["", "Measured: mean ± sd over the finished trials each point's configured values match (its repeats), "
              "n trials; difference = measured mean - published. The published points are the black stars on the "
              "figures below.", "", *_md_table(rows, ["point", "metric", "published", "measured", "difference"]), ""]
    if any(str(r.get("metric", "")).startswith("ref_") for r in rows):
        lines += [f"Points on `ref_*` metrics (DPAL `evaluation: reference`): {REF_PROTOCOL_LABEL} (docs/dpal.md).", ""]
    return lines


REF_PROTOCOL_LABEL = "reference protocol: not a DP guarantee, not a white-box attack, not a certificate"


def _dpal_side_by_side(trials, refs: list[dict]) -> list[str]:
    """DPAL-paper figures: faithful DPAL, the reference protocol (labelled) and dpal_sound side by side, one row per
    variant and epsilon (mean ± sd over repeats), with the published points of the spec's reference block."""
    import re

    import numpy as np
    import pandas as pd

    from sweeps.report.data import finished, with_metric

    df = finished(trials)
    if df.empty or "trainable" not in df:
        return []
    ev = df["param.evaluation"] if "param.evaluation" in df else None
    variant = np.where(df["trainable"] == "dpal_sound", "dpal_sound",
                       np.where((df["trainable"] == "dpal") & (ev == "reference" if ev is not None else False),
                                f"DPAL, {REF_PROTOCOL_LABEL}", np.where(df["trainable"] == "dpal", "DPAL faithful", "")))
    df = df.assign(_variant=variant)
    df = df[df["_variant"] != ""]
    if df.empty or df["_variant"].nunique() < 2:
        return []
    eps_cols = [c for c in ("param.eps_t", "param.epsilon") if c in df]
    eps_col = eps_cols[0] if eps_cols else None
    eps = df[eps_cols[0]].astype(float) if eps_cols else pd.Series(math.nan, index=df.index)
    for c in eps_cols[1:]:
        eps = eps.fillna(df[c].astype(float))
    df = df.assign(_eps=eps)
    sizes = sorted({float(m.group(2)) for c in df.columns
                    if (m := re.fullmatch(r"(ref_)?acc_(?:fgsm|ifgsm|mim|pgd)_(.+)", str(c))) and _is_float(m.group(2))})
    cert_sizes = sorted({float(m.group(1)) for c in df.columns
                         if (m := re.fullmatch(r"(?:ref_cert_acc|cert_acc|cert_linf_acc)_(.+)", str(c)))
                         and _is_float(m.group(1))})
    radii = sorted({float(m.group(1)) for c in df.columns
                    if (m := re.fullmatch(r"(?:smooth_cert_acc|cert_l2_acc)_(.+)", str(c))) and _is_float(m.group(1))})
    for s_ in sizes:
        df = with_metric(df, f"acc_attack_mean_{s_:.6g}")
    rows = []
    for (var, eps), g in df.groupby(["_variant", "_eps"], sort=True, dropna=False):
        row = {"variant": var, "eps": f"{float(eps):g}" if eps_col else ""}
        ref_mode = var.startswith("DPAL, reference")
        sound = var == "dpal_sound"

        def stat(col):
            vals = g[col].astype(float).dropna() if col in g else []
            return fmt_stat(float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else math.nan,
                            len(vals)) if len(vals) else ""

        row["clean"] = stat("ref_acc_clean" if ref_mode else "acc_clean_smoothed" if sound else "acc_clean")
        for s_ in sizes:
            row[f"attack mean {s_:g}"] = stat(f"ref_acc_attack_mean_{s_:.6g}" if ref_mode else f"acc_attack_mean_{s_:.6g}")
        for s_ in cert_sizes:
            row[f"certified l-inf {s_:g}"] = stat(f"ref_cert_acc_{s_:.6g}" if ref_mode else
                                                  f"cert_linf_acc_{s_:.6g}" if sound else f"cert_acc_{s_:.6g}")
        for r_ in radii:
            row[f"certified l2 {r_:g}"] = stat(next((c for c in (f"cert_l2_acc_{r_:.6g}", f"smooth_cert_acc_{r_:.6g}")
                                                     if c in g and g[c].notna().any()), ""))
        rows.append(row)
    pub = [f"{r['point']}: {r['metric']} = {r['published']}" for r in refs if r.get("published") not in (None, "")]
    return ["## DPAL: faithful, reference protocol and dpal_sound side by side", "",
            "Clean accuracy (`acc_clean`, `ref_acc_clean`, dpal_sound's `acc_clean_smoothed`), accuracy under attack "
            "averaged over the attacks run at each size (`acc_attack_mean_<size>`; the reference protocol's "
            "`ref_acc_attack_mean_<size>`; dpal_sound's attacks are white-box EOT on its noisy classifier with true "
            "labels) and certified accuracy (`cert_acc_<size>`, `ref_cert_acc_<size>`, `cert_linf_acc_<size>` at an "
            "l-inf size; `cert_l2_acc_<r>`, `smooth_cert_acc_<r>` at an l2 radius), mean ± sd over "
            f"repeats. Rows marked reference protocol: {REF_PROTOCOL_LABEL} (docs/dpal.md). Published: "
            + ("; ".join(pub) if pub else "none in this spec") + ".", "", *_md_table(rows), ""]


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _privacy_section(sweep: Sweep) -> list[str]:
    m, tags, trials = sweep.parent_metrics, sweep.parent_tags, sweep.trials
    lines = ["## Privacy of the sweep", ""]
    all_eps = list(trials["epsilon"].dropna().astype(float)) if "epsilon" in trials else []
    eps = [e for e in all_eps if math.isfinite(e)]
    if eps:
        from sweeps.words import span

        whose = "each holds for its own trial only" if len(eps) > 1 else "it holds for that trial only"
        lines.append(f"Per-trial epsilon: {span(min(eps), max(eps))} ({whose}).")
    if "trainable" in trials and len(trials):
        from trainables.registry import REGISTRY

        names = sorted(n for n in set(trials["trainable"]) if n in REGISTRY)
        robust = [n for n in names if not REGISTRY[n].privacy_epsilon]
        other = [n for n in names if REGISTRY[n].privacy_epsilon and not REGISTRY[n].config_model.protects_training_examples]
        if robust:
            one = len(robust) == 1
            lines.append(f"{', '.join(f'`{n}`' for n in robust)} report{'s' if one else ''} no privacy epsilon: "
                         f"{'its' if one else 'their'} epsilon is a robustness parameter (logged as "
                         "`robustness_epsilon`, configured `robustness_epsilon_config`), left out of this section "
                         "and of the epsilon plots (docs/metrics.md).")
        for n in other:
            lines.append(f"The epsilon of `{n}` protects {REGISTRY[n].epsilon_protects}.")
    if len(eps) < len(all_eps):
        lines.append(f"{len(all_eps) - len(eps)} trial(s) have no guarantee (epsilon infinite: non-private "
                     "baselines); the epsilon plots leave them out.")
    if "tuning_epsilon" in m:
        released = trials[trials["released"]] if "released" in trials else trials.iloc[0:0]
        rel = (f" The released trial is `{released.iloc[0]['run']}`" if len(released) else "")
        score = [f"{k[len('released_'):]} = {v:.4g}" for k, v in m.items() if k.startswith("released_")]
        lines += ["", f"**Private hyperparameter selection** ({tags.get('dpsweep.selection_privacy', '')}). "
                  "K candidates were drawn from the "
                  "sweep's secret (K is for the owner only: the bound assumes it unobserved); each candidate's "
                  "guarantee is at most "
                  f"epsilon {m.get('trial_epsilon_worst', math.nan):.4g} (worst case over the search space) and "
                  f"releasing only the best costs **epsilon {m['tuning_epsilon']:.4g} at delta "
                  f"{m.get('tuning_delta', math.nan):.3g} end to end** (Papernot & Steinke 2022, computed with "
                  f"dp-accounting).{rel}{' with ' + ', '.join(score) if score else ''}. The other trials are "
                  "not covered by that guarantee and must not be published: this report and its files are for the "
                  "sweep's owner only, and what may be published is the release bundle that `dpsweep release` "
                  "writes (below; docs/tuning_privacy.md)."]
        lines += ["", *_owner_only(sweep)]
    elif len(trials) == 1:
        lines += ["", "One trial, nothing chosen: its own epsilon covers it. A sweep that chooses among trials "
                  "trained on the same private data needs `tuning_privacy` (docs/tuning_privacy.md) for an "
                  "end-to-end guarantee."]
    elif not eps:   # no trial claims privacy (PixelDP only, or only non-private baselines): no epsilon to bound
        lines += ["", f"No trial of these {len(trials)} reports a privacy epsilon for its training data, so choosing "
                  "the best among them is a tuning choice on the evaluation images, not a privacy question; its "
                  "score is optimistic (chosen on the same images)."]
    else:
        lines += ["", "**The selection among trials is not covered by any privacy guarantee.** Choosing the best "
                  f"of these {len(trials)} trials, trained on the same private data, uses that data again: the "
                  "per-trial epsilons above do not bound what publishing the best trial reveals. Run the sweep "
                  "with `tuning_privacy` (docs/tuning_privacy.md) for an end-to-end guarantee."]
    from sweeps.report.audit import section_lines  # claimed vs audited epsilon (docs/audit.md)

    lines += section_lines(trials, _md_table)
    from sweeps.report.mia import section_lines as mia_lines  # attack beside audit and claim (docs/mia.md)

    lines += mia_lines(trials, _md_table)
    return lines + [""]


def _owner_only(sweep: Sweep) -> list[str]:
    """What of a private selection's report is for the sweep's owner only, and what may be published
    (issue 34, point 9; docs/tuning_privacy.md)."""
    name = sweep.experiment
    return ["**For the sweep's owner only** (the end-to-end guarantee covers none of it): the number of trials "
            "(it is K, which the bound assumes unobserved), every candidate's hyperparameters and scores, the "
            "trials and certified-accuracy tables, `trials.csv`, `trials_aggregated.csv`, the figures, the best "
            "configuration's runner-up and significance statement, and the MLflow runs.",
            "",
            "**What may be published**: the release bundle, and nothing else of the sweep: "
            f"`dpsweep release {name} --out release/` writes the released trial's model, its hyperparameters, its "
            "score, the end-to-end (epsilon, delta) and the threat model (docs/tuning_privacy.md)."]


def _trial_count(part: Sweep) -> str:
    """"4 trials", or "4 trials (2 finished)" when not all of them finished."""
    trials = part.trials
    done = len(finished(trials))
    return counted(len(trials), "trial") + (f" ({done} finished)" if done < len(trials) else "")


def _completion_lines(part: Sweep) -> list[str]:
    """An unfinished sweep said at the top of the page (issue 51, point 7): how many trials finished of
    how many (``dpsweep.trials_planned``, or the child runs), the parent run's status and why, and the
    command that resumes it. Nothing for a finished sweep whose trials all finished."""
    import re
    from collections import Counter

    trials, tags = part.trials, part.parent_tags
    status = part.parent.info.status
    counts = Counter(trials["status"]) if "status" in trials else Counter()
    done, started = counts.get("FINISHED", 0), len(trials)
    try:
        planned = int(tags.get("dpsweep.trials_planned", ""))
    except ValueError:
        planned = None
    total = max(planned or 0, started)
    if status == "FINISHED" and done == total:
        return []
    others = ", ".join(f"{k} {s}" for s, k in sorted(counts.items()) if s != "FINISHED")
    unstarted = total - started
    detail = "; ".join(x for x in (others, f"{unstarted} not started" if unstarted > 0 else "") if x)
    text = (f"**Unfinished sweep: {done} of {total} trials finished**{f' ({detail})' if detail else ''}; "
            f"the parent run `{part.parent.info.run_id}` is **{status}**")
    note = (tags.get("dpsweep.interrupted") if status == "KILLED" else tags.get("dpsweep.error")) or ""
    found = re.search(r"(\S*dpsweep resume \S+)", note)
    if note and note != "resumed":   # its resume command (the driver's note) as code
        note = note.strip().rstrip(".")
        text += f" ({note.replace(found.group(1), f'`{found.group(1)}`') if found else note})"
    if status == "RUNNING":
        text += ": the sweep is still running (or its driver was killed without closing it)"
    if not found and status in ("KILLED", "FAILED", "RUNNING"):
        text += (". Resume it with `dpsweep resume <storage>/<run name>` (the sweep's directory under the spec's "
                 f"`storage`, named `{part.parent.info.run_name}`)")
    text += (". Every table and figure below, and the best configuration, cover the finished trials only "
             "(a best chosen among fewer trials than planned).")
    return [text, ""]


def _run_ids(parent_run_id) -> list[str]:
    """``--run`` as given: None, one id, ``A,B``, or a list of either (``--run A --run B``)."""
    if not parent_run_id:
        return []
    items = [parent_run_id] if isinstance(parent_run_id, str) else list(parent_run_id)
    return list(dict.fromkeys(i.strip() for item in items for i in str(item).split(",") if i.strip()))


def make_report(experiment: str, tracking_uri: str, out: Path, *, sizes=None,
                parent_run_id: str | list[str] | None = None) -> Path:
    """Write the report of the latest sweep in ``experiment`` (or of the sweeps ``parent_run_id``
    names: one id, ``A,B`` or a list; several are compared in one report) to ``out``; returns
    report.md."""
    import sys

    ids = _run_ids(parent_run_id)
    sweep = load_sweeps(experiment, tracking_uri, ids) if ids else load_sweep(experiment, tracking_uri)
    load_tables(sweep)
    sizes = tuple(sorted(sizes or DEFAULT_SIZES))
    out.mkdir(parents=True, exist_ok=True)
    trials = sweep.trials
    visible = [c for c in trials.columns if c not in HIDDEN]
    from sweeps.report.data import without_shadowed_audit_keys

    _csv_spelling(without_shadowed_audit_keys(trials[visible])).to_csv(out / "trials.csv", index=False)
    files = [out / "trials.csv"]

    figures: list[tuple[str, str, str]] = []  # (title, file, caption)

    def add(ok: bool, title: str, fname: str, caption: str = "") -> None:
        if ok:
            figures.append((title, fname, caption))

    refs = reference_rows(trials, sweep.reference)
    agg_rows, agg_cols = aggregated_rows(trials)
    if agg_rows:
        _write_csv(out / "trials_aggregated.csv", aggregate(trials).to_dict("records"))
        files.append(out / "trials_aggregated.csv")
    repeats = "; each point the mean over a configuration's repeats, error bars one standard deviation"
    from sweeps.report.audit import plot_claimed_vs_audited

    add(plot_claimed_vs_audited(trials, out / "claimed_vs_audited.png"), "Claimed vs audited epsilon",
        "claimed_vs_audited.png", "Each audited trial's empirical lower bound (its own confidence) against its claimed "
        "epsilon; above the dashed line y = x the claim is refuted (docs/audit.md).")
    from sweeps.report.mia import plot_membership_inference

    add(plot_membership_inference(trials, out / "membership_inference.png"), "Membership inference against epsilon",
        "membership_inference.png", "Per mechanism and attack: AUC, TPR at 0.1% and 1% FPR and the attack's epsilon "
        "lower bound against the claimed epsilon (non-private at the right end), beside the audit's bound and "
        "the claim y = x (docs/mia.md).")
    # issue 34 point 6: neutral words outside a DPAL study, the best configuration ringed, no near-duplicates
    dpal = rp.dpal_study(trials)
    clean = "conventional accuracy (clean)" if dpal else "clean accuracy"
    params = dict(sweep.parent.data.params) if len(sweep.sweeps) == 1 else {}
    best = rp.best_configuration(trials, params.get("search.metric"), params.get("search.mode") or "max")
    one_mechanism = "trainable" in trials and trials["trainable"].nunique() == 1
    layout = (lambda n: f"; DPAL paper Fig. {n} layout") if dpal else (lambda n: "")
    pareto = rp.plot_pareto(trials, "acc_clean", out / "pareto_accuracy.png", clean, refs, best)
    add(pareto, f"Privacy epsilon against {clean}", "pareto_accuracy.png",
        f"Every configuration a point{repeats}; a series (colour and marker) per value of the other swept keys, "
        "its line the series' Pareto front (no configuration of it has lower epsilon and higher accuracy). Privacy epsilons only: robustness mechanisms (PixelDP) are in their "
        "own figure, against their configured parameter.")
    if not (pareto and one_mechanism):  # one mechanism: the Pareto figure already draws accuracy against epsilon
        add(rp.plot_accuracy_vs_epsilon(trials, "acc_clean", out / "accuracy_vs_epsilon.png", clean, refs, best),
            "Clean accuracy against epsilon", "accuracy_vs_epsilon.png",
            f"Configured epsilon on the x axis, a line per value of the other swept keys{repeats}.")
    add(rp.plot_robustness(trials, "acc_clean", out / "robustness_accuracy.png", clean, refs, best),
        f"Robustness mechanisms: configured robustness epsilon against {clean}",
        "robustness_accuracy.png", "PixelDP's epsilon is a robustness parameter, not a privacy guarantee" + repeats + ".")
    cert_metric = next((f"cert_acc_{s:.6g}" for s in sizes if f"cert_acc_{s:.6g}" in trials), None)
    if cert_metric:
        add(rp.plot_pareto(trials, cert_metric, out / "pareto_certified.png", f"certified accuracy ({cert_metric})",
                           refs, best),
            f"Privacy epsilon against certified accuracy ({cert_metric})", "pareto_certified.png")
        add(rp.plot_robustness(trials, cert_metric, out / "robustness_certified.png",
                               f"certified accuracy ({cert_metric})", refs, best),
            f"Robustness mechanisms: configured robustness epsilon against certified accuracy ({cert_metric})",
            "robustness_certified.png")
    native = rp.plot_certified_curves(sweep, "native", out / "cert_acc_vs_size.png", refs, best)
    add(native, "Certified accuracy against attack size", "cert_acc_vs_size.png",
        "From the per-example tables: any size can be read off, not only the configured ones. One curve per "
        "configuration (mean over its repeats, band one standard deviation).")
    from sweeps.report.certified import certified_radius_section  # issue 36.3: the literature's figure and table

    radius_lines, radius_files = certified_radius_section(sweep, refs, out, best, _md_table,
                                                          split=params.get("selection.split") or "none")
    files.extend(f for f in radius_files if f.exists())
    if not radius_lines:  # else the certified-radius section draws the smoothing curves
        add(rp.plot_certified_curves(sweep, "smoothing", out / "smooth_cert_acc_vs_size.png", refs, best),
            "Randomized-smoothing certified accuracy against l2 radius", "smooth_cert_acc_vs_size.png")
    fig2_size = _fig2_size(trials)
    if fig2_size is not None:
        add(rp.plot_accuracy_vs_epsilon_per_attack(trials, fig2_size, out / "fig2_accuracy_vs_epsilon.png", refs, best),
            f"{'Conventional accuracy' if dpal else 'Accuracy'} against epsilon under each attack (size "
            f"{fig2_size:g}, {rp.norms(trials)}, [-1, 1] domain{layout(2)})",
            "fig2_accuracy_vs_epsilon.png", "Configured epsilon on the x axis" + repeats + ".")
    add(rp.plot_accuracy_vs_size_per_attack(trials, out / "fig4_accuracy_vs_attack_size.png", refs),
        f"{'Conventional accuracy' if dpal else 'Accuracy'} against attack size ({rp.norms(trials)}, [-1, 1] domain"
        f"{layout(4)})", "fig4_accuracy_vs_attack_size.png")
    if not (native and one_mechanism):  # one mechanism: the same curves as cert_acc_vs_size
        # the DPAL paper's figure number only on a DPAL study; elsewhere named after what it shows (issue 51.4)
        fig6 = "fig6_certified_vs_attack_size.png" if dpal else "certified_vs_size_by_mechanism.png"
        add(rp.plot_certified_vs_size_by_mechanism(sweep, out / fig6, refs),
            f"Certified accuracy against attack size by mechanism and epsilon{' (DPAL paper Fig. 6 layout)' if dpal else ''}",
            fig6)
    for title, fname in _mechanism_figures(trials, out):
        figures.append((title, fname, ""))
    from sweeps.report.samples import sample_grid_figures  # generative trials' sample grids (dpgan, dp_merf)

    figures.extend(sample_grid_figures(sweep, out))
    if len(sweep.sweeps) == 1:   # the swept keys against search.metric (issue 34, point 7; sweeps/report/parallel.py)
        from sweeps.report.parallel import parallel_figure

        figures.extend(f for f in [parallel_figure(sweep, out)] if f)

    others = other_sweeps(sweep)
    if others:
        print(f"dpsweep: note: {_others_text(others)}", file=sys.stderr, flush=True)
    lines = [f"# Sweep report: {experiment}", ""]
    if len(sweep.sweeps) == 1:
        lines += [f"Parent run `{sweep.parent.info.run_id}` ({sweep.parent.info.run_name}), {_trial_count(sweep)}, "
                  f"tracking URI `{tracking_uri}`.", ""]
        lines += _completion_lines(sweep)
    else:
        lines += [f"{len(sweep.sweeps)} sweeps compared (column `sweep`, a series per sweep in every figure), "
                  f"{counted(len(trials), 'trial')}, tracking URI `{tracking_uri}`:", ""]
        lines += [f"* `{s.parent.info.run_name}`: parent run `{s.parent.info.run_id}`, {_trial_count(s)}"
                  for s in sweep.sweeps] + [""]
        for s in sweep.sweeps:
            lines += [f"`{s.parent.info.run_name}`: {line}" if line else line
                      for line in _completion_lines(s)]
    if others:
        text = _others_text(others)
        lines += [text[0].upper() + text[1:] + ".", ""]
    for part in sweep.sweeps:
        section = _privacy_section(part)
        if len(sweep.sweeps) > 1:
            section[0] = f"## Privacy of the sweep `{part.parent.info.run_name}`"
        lines += section
        lines += _best_section(part, tracking_uri)
    lines += _reference_section(sweep, refs)
    lines += _dpal_side_by_side(trials, refs)
    if len(sweep.sweeps) == 1:   # which swept key drove the search metric (issue 34, point 3)
        from sweeps.report.importance import importance_section

        lines += importance_section(sweep)
    if agg_rows:
        lines += ["## Trials", "",
                  "One row per configuration: repeats (`search.num_samples`; trials that differ only in `seed` and "
                  "`repeat`) are aggregated as mean ± standard deviation over the n finished trials, grouped by "
                  "their configured parameters (`cfg.<key>`); `(k)` after a value: only k of them have it.", "",
                  *_md_table(agg_rows, agg_cols),
                  "", "Every trial's parameters and metrics: `trials.csv`; per configuration with mean, sd and n: "
                  "`trials_aggregated.csv`.", ""]
        if any(str(c).startswith("ref_") for c in agg_cols):
            lines += [f"Columns `ref_*` (DPAL `evaluation: reference`): {REF_PROTOCOL_LABEL} (docs/dpal.md).", ""]
    cert_rows = rp.certified_table(sweep, sizes)
    if cert_rows:
        _write_csv(out / "certified_accuracy.csv", cert_rows)
        files.append(out / "certified_accuracy.csv")
        lines += [f"## Certified accuracy at sizes {', '.join(f'{s:g}' for s in sizes)}", "",
                  "Computed from each trial's per-example table (`dpsweep report --sizes ...` asks for others); "
                  "mean ± sd over each configuration's n repeats.", "",
                  *_md_table(cert_rows), ""]
    lines += radius_lines
    dpal_rows = _dpal_rows(sweep)
    if dpal_rows:
        lines += ["## DPAL verified inference (per-example tables)", "",
                  "Medians over the certified test examples of the robustness budget eps_r maximising Eq. 15, the "
                  "bounds kappa and phi of Theorem 5, the certified size max(kappa, phi) (docs/dpal.md), and the "
                  "fraction isRobust at the configured mu_a; mean ± sd of those per-trial values over each "
                  "configuration's n repeats.", "", *_md_table(dpal_rows), ""]
    if figures:
        lines += ["Every figure is also written as a vector file (PDF) beside its PNG, for a paper.", ""]
        from sweeps.report.best import SELECTION_IMAGES

        split = params.get("selection.split") or "none"
        if split in SELECTION_IMAGES:   # issue 51.4: which images the curves are on
            lines[-2] += (f" The figures and tables are measured on {SELECTION_IMAGES[split]}; the scores on the "
                          "images selection never read are each trial's `heldout_<metric>` (best configuration "
                          "above).")
    for title, fname, caption in figures:
        vector = (out / fname).with_suffix(rp.VECTOR)
        lines += [f"## {title}", "", f"![{title}]({fname})", ""] + ([caption, ""] if caption else [])
        if vector.exists():
            lines[-1 if not caption else -2] += f" Vector: [{vector.name}]({vector.name})."
            files.append(vector)
        files.append(out / fname)
    report = out / "report.md"
    report.write_text("\n".join(lines))
    where = "report" if len(sweep.sweeps) == 1 else "report_comparison"  # a comparison never replaces a sweep's own
    for part in sweep.sweeps:
        for f in [report, *files]:
            retry(lambda f=f, part=part: sweep.client.log_artifact(part.parent.info.run_id, str(f), where),
                  what="log_artifact(report)")
    return report


def _others_text(others: list[dict]) -> str:
    """What else the experiment holds, and how to include it."""
    items = [f"{o['name']} ({o['run_id']}, "
             f"{counted(o['trials'], 'trial') if o['trials'] is not None else 'unknown number of trials'}, "
             f"{o['date']}, {o['status']})" for o in others[:10]]
    more = f" and {len(others) - 10} more" if len(others) > 10 else ""
    return (f"this experiment also holds {len(others)} other sweep{'s' if len(others) > 1 else ''}: "
            f"{'; '.join(items)}{more}; add --run ID (repeatable, or A,B) to include them in this report")


def _best_section(sweep: Sweep, tracking_uri: str) -> list[str]:
    """The best trial by the spec's ``search.metric`` (issue 24, point 5), with what covers
    choosing it, and the address of MLflow's compare view of the sweep's trials (point 9)."""
    from sweeps.report.best import claims_privacy, compare_url, selection_caveat, ui_base

    params, tags, trials = dict(sweep.parent.data.params), sweep.parent_tags, sweep.trials
    metric, mode = params.get("search.metric"), params.get("search.mode") or "max"
    repeats = "group" in with_groups(finished(trials)) and with_groups(finished(trials))["group"].duplicated().any()
    lines = ["## Best configuration" if repeats else "## Best trial", ""]
    if metric in (None, "", "null"):
        lines.append("The spec sets no single `search.metric`: no best trial is named (the figures show the "
                     "trade-offs).")
    elif metric not in trials or finished(trials).empty or finished(trials)[metric].dropna().empty:
        lines.append(f"No finished trial reports `{metric}`.")
    else:
        lines += _best_configuration(sweep, metric, mode, params)
    url = tags.get("dpsweep.compare_url", "")
    if not url.startswith("http") and "run_id" in trials and len(trials):
        url = compare_url(ui_base(tracking_uri), sweep.parent.info.experiment_id, list(trials["run_id"]))
    if url:
        lines += ["", f"MLflow compare view of {all_of(len(trials), 'trial')} (parallel coordinates of the swept keys "
                  f"against a metric; run `mlflow ui` first for a local store): <{url}>"]
    return lines + [""]


def _best_configuration(sweep: Sweep, metric: str, mode: str, params: dict) -> list[str]:
    """The best configuration (issue 34, point 1; ``sweeps.report.best.select_configuration``): its
    statistic with mean ± sd and n over its seeds, the runner-up and the significance statement, its
    score on the held-out images of a selection split (point 2), and what covers the choice. A
    tuning-private sweep's best is its released trial, whose held-out score is the headline."""
    from sweeps.report.best import (
        HELD_OUT,
        claims_privacy,
        describe_held_out,
        describe_stats,
        select_configuration,
        selection_caveat,
    )

    trials = sweep.trials
    fin = finished(with_groups(trials))
    private = "tuning_epsilon" in sweep.parent_metrics
    statistic = params.get("selection.statistic") or "mean"
    split = params.get("selection.split") or "none"
    rows = fin.to_dict("records")
    from sweeps.report.best import compare_from_params
    from sweeps.report.data import is_nonprivate, trial_config
    from sweeps.spec.sweep_spec import reference_matches

    sel = select_configuration(rows, metric, mode, statistic,
                               config_of=(lambda r: r["run_id"]) if private else (lambda r: r["group"]),
                               seed_of=lambda r: r.get("param.seed"),
                               baseline_of=None if private else is_nonprivate,
                               best_among=params.get("selection.best_of") or "private",
                               compare=compare_from_params(params),
                               matches=lambda where, r: reference_matches(where, trial_config(r)))
    agg = aggregate(fin, [])
    labels = dict(zip(agg["group"], agg["label"])) if not agg.empty else {}
    lines: list[str] = []
    claims = claims_privacy(trials["trainable"].dropna().unique()) if "trainable" in trials else True
    if private:
        released = fin[fin["released"]] if "released" in fin else fin.iloc[0:0]
        best = released.iloc[0] if len(released) else fin.loc[fin[metric].astype(float).idxmax() if mode == "max"
                                                              else fin[metric].astype(float).idxmin()]
        lines.append(f"By `search.metric` = `{metric}` ({mode}): the released trial **`{best['run']}`**, {metric} = "
                     f"{float(best[metric]):.4g} on the selection images, MLflow run `{best['run_id']}`.")
        held = best.get(HELD_OUT + metric)
        if held is not None and math.isfinite(float(held)):
            lines += ["", f"**Headline: held-out {metric} = {float(held):.4g}** on test images the selection never read "
                      f"(`{HELD_OUT}{metric}`; the selection score above counts the selection's luck)."]
        lines += ["", f"The choice: {selection_caveat(True, len(trials), claims)}."]
        return lines
    b = sel.best
    label = labels.get(b.key, str(b.rows[0].get("trainable", "")))
    runs = ", ".join(f"`{r['run']}`" for r in b.rows)
    how = {"mean": "mean", "median": "median", "worst": "worst seed"}.get(statistic, statistic)
    if b.n == 1:   # one trial per configuration: the trial is the configuration
        one = b.rows[0]
        shown = "" if str(label) in str(one["run"]) else f" ({label})"  # child runs are named after it
        lines.append(f"By `search.metric` = `{metric}` ({mode}): **`{one['run']}`**{shown}, {metric} = "
                     f"{float(one[metric]):.4g}, MLflow run `{one['run_id']}`"
                     + (" (tagged `dpsweep.best_run_id` on the parent run)"
                        if sweep.parent_tags.get("dpsweep.best_run_id") else "") + ".")
    else:
        lines.append(f"By `search.metric` = `{metric}` ({mode}), the best configuration by the {how} over its "
                     f"repeats (`selection.statistic`): **{label}**: {describe_stats(b, metric)}"
                     + (f", {statistic} {b.statistic:.4g}" if statistic != "mean" else "") + f"; trials {runs}.")
    if sel.runner_up is not None:
        lines += ["", f"Runner-up: {labels.get(sel.runner_up.key, '?')}: {describe_stats(sel.runner_up, metric)}. "
                  f"{sel.statement()[0].upper() + sel.statement()[1:]}."]
    ties = sel.tie_statement()
    if ties:
        names = ", ".join(labels.get(t.key, "?") for t in sel.best_ties + sel.ties)
        lines += ["", f"Ties: {ties} ({names})."]
    if sel.baseline is not None and sel.baseline is not b:   # a reference, not a contender (issue 51.1)
        text = sel.baseline_statement(labels.get(sel.baseline.key, ""))
        lines += ["", f"**Reference: {text[0].upper() + text[1:]}.** The best is chosen among the private "
                  "configurations (`selection.best_of: private`); the baseline shows what privacy costs."]
    others = [c for c in sel.comparisons if c.name not in ("best vs runner-up", "best vs non-private baseline")]
    if others or len([c for c in sel.comparisons if c.test]) > 1:
        lines += ["", "Comparisons (`selection.compare`; mean difference first minus second with its 95% interval, "
                  "the paired t-test on matching seeds or Welch's, Holm-adjusted p-values when several are tested):",
                  ""]
        lines += [f"* {c.name if c.name.startswith('best') else c.name} ({labels.get(c.a.key, '?')} vs "
                  f"{labels.get(c.b.key, '?')}): {c.summary(metric)}" for c in sel.comparisons]
    held = describe_held_out(b, metric, split)
    if held:
        lines += ["", f"**Headline: {held}** (`{HELD_OUT}{metric}`): the score to quote, since selection never read "
                  "these images; the selection score above is optimistic."]
    elif split == "none":
        lines += ["", "Selected and scored on the same test images (no `selection` split in the spec), so the best "
                  "score is optimistic; `selection: {split: test_half}` or `{split: validation, size: N}` reports "
                  "the chosen configuration on images selection never saw (docs/specs.md)."]
    lines += ["", f"The choice: {selection_caveat(False, len(trials), claims)}."]
    return lines


def _dpal_rows(sweep: Sweep) -> list[dict]:
    """One row per DPAL configuration from its trials' per-example tables (eps_r, kappa, phi,
    certified size, isRobust: per-trial medians / fractions, then mean ± sd over repeats)."""
    import numpy as np

    if sweep.trials.empty:
        return []
    trials = finished(with_groups(sweep.trials))
    agg = aggregate(trials, [])
    labels = dict(zip(agg["group"], agg["label"])) if not agg.empty else {}
    by_id = trials.set_index("run_id")
    per_group: dict[int, list[dict]] = {}
    for (rid, kind), t in sorted(sweep.tables.items()):
        if kind != "native" or not {"kappa", "phi", "eps_r"} <= set(t.columns) or rid not in by_id.index:
            continue
        row = by_id.loc[rid]
        per_group.setdefault(int(row["group"]), []).append(
            {"eps_t": float(row.get("epsilon", math.nan)), "examples": len(t), "eps_r": float(t["eps_r"].median()),
             "kappa": float(t["kappa"].median()), "phi": float(t["phi"].median()),
             "certified_size": float(t["certified_size"].median()),
             "isRobust": float(t["is_robust"].mean()) if "is_robust" in t else math.nan})
    rows = []
    for gid, items in sorted(per_group.items()):
        out = {"configuration": labels.get(gid, str(gid)), "n": len(items)}
        for key in ("eps_t", "examples", "eps_r", "kappa", "phi", "certified_size", "isRobust"):
            vals = np.array([it[key] for it in items], dtype=np.float64)
            out[key] = fmt_stat(float(vals.mean()), float(vals.std(ddof=1)) if len(vals) > 1 else math.nan, len(vals))
        rows.append(out)
    return rows


def _csv_spelling(frame):
    """``trials.csv`` spells booleans as the spec does, ``true``/``false`` (pandas would write
    Python's ``True``; ``attack_labels: true`` is read back from MLflow as a boolean); pandas and
    most CSV readers parse the lowercase words as booleans again."""
    import numpy as np

    frame = frame.copy()
    for col in frame.columns:
        if frame[col].dtype == bool or frame[col].dtype == object:
            frame[col] = frame[col].map(lambda x: ("true" if x else "false") if isinstance(x, (bool, np.bool_)) else x)
    return frame


def _write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` as CSV, booleans spelt ``true``/``false`` as in ``trials.csv`` (``_csv_spelling``)."""
    import csv

    import numpy as np

    rows = [{k: ("true" if v else "false") if isinstance(v, (bool, np.bool_)) else v for k, v in r.items()}
            for r in rows]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)


def _fig2_size(trials) -> float | None:
    """The attack size of Fig. 2's layout: the one most attacks were run at (0.2 on ties, as the paper)."""
    count: dict[float, int] = {}
    for c in trials.columns:
        m = rp.ACC.match(str(c))
        if m:
            count[float(m.group(2))] = count.get(float(m.group(2)), 0) + 1
    if not count:
        return None
    return max(count, key=lambda s: (count[s], s == 0.2, -abs(s - 0.2)))


def _mechanism_figures(trials, out: Path) -> list[tuple[str, str]]:
    """Figures a mechanism's own module draws (label DP: accuracy and MSE against epsilon)."""
    figs = []
    try:
        from sweeps.report.labeldp import labeldp_figures
    except ImportError:
        return figs
    for path in labeldp_figures(trials, out) or []:
        figs.append((f"Label DP: {Path(path).stem.replace('_', ' ')}", Path(path).name))
    return figs
