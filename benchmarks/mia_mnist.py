"""Membership inference against DP-SGD on MNIST (issue 52): writes benchmarks/results/mia_mnist.json.

The setting (docs/mia.md, "Benchmark"): Tramer & Boneh's tanh CNN (``tb_cnn``) trained by DP-SGD
on the members of a pool of ``--candidates`` MNIST training images (default 2,000; each a member by a
fair coin, about 1,000 members; the sampling rate planned from the public expected count, n // 2),
at epsilon 1, 3 and 8 (delta 1e-5, the RDP ledger's figure) and without clipping or noise
(``non_private``), 3 seeds (a seed: the target's initialisation and its membership coins). The
attacks: offline RMIA and offline LiRA (dpmech.privacy.mia) with 2 reference models per epsilon,
trained by the same recipe (the same epsilon) on 1,000-image subsets of the other 58,000 training
images, shared by the seeds of one epsilon (as a sweep's disk cache shares them); 2,000 further
population images are RMIA's z. Recipe (all four rows): Adam lr 0.004, batch 100 (q = 0.1),
clipping 1.0, 40 epochs (400 steps); one CPU thread.

The audit of the same models (``AUDIT``; docs/mia.md, "Benchmark"): each private target is trained
with the white-box engine canaries of the shipped spec sweeps/dpsgd_mnist_mia.yaml (``audit: {mode:
whitebox, canaries: 1000}``: :class:`dpmech.privacy.audit.whitebox.EngineCanaries`, 1,000 Dirac
gradient canaries on the network's largest ``nn.Linear`` weight, each a member of D by its own coin,
drawn by the engine's sampler and clipped by its clipping routine, LLR statistic) and audited in the
same run by :meth:`~dpmech.privacy.audit.whitebox.WhiteBoxCanaries.audit` (the estimators
trainables/runtime.py's ``run_audit`` calls; guess fraction 0.2, 95%). The canaries are extra
gradient-space rows the engine inserts: the candidates, the membership coins, the plan (q = batch /
expected members) and the claim are the game's, and the attacks score the model that was audited.
The reference models are trained without canaries, as a sweep's trial trains them (trainables/mia_trial.py
drops ``audit`` from the reference recipe). ``non_private`` has no audit (no clipping, no noise).

Each (row, seed) is a unit: ``benchmarks/results/mia_mnist/<row>_seed<k>.json`` is written when it
ends and skipped when there (``.running``: claimed by another process), so runs resume; the
top-level file is rebuilt from the unit files after each unit, with per row
``{"rmia": {"auc", "auc_std", "tpr_at_fpr_0.001", "tpr_at_fpr_0.01", "eps_lb", ...}, "lira": {...},
"epsilon", "seeds", "audit", "cost"}`` (means over seeds; ``audit``: {"fdp_lb", "fdp_eps_lb", "steinke_lb",
"gdp_estimate", "canaries", "guess_fraction", "confidence", ...}; ``cost``: seconds of the target's training, of the
reference models' training per trial -- their total over the row divided by its trials, since they
are shared -- and of each attack, inference and scoring included).

Run: ``.venv/bin/python benchmarks/mia_mnist.py [--rows eps_1 ...] [--seeds 0 1 2]``;
``--summary`` rebuilds the file from the units; ``--docs`` writes docs/mia.md's table and
docs/figures/mia_mnist.png from it; ``--demo`` a tiny run (200 candidates, 3 epochs) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, claimed_unit, environment, log, read_result, update_doc_blocks, write_result  # noqa: E402

NAME = "mia_mnist"
RUNS = RESULTS / NAME
DOC = Path(__file__).resolve().parent.parent / "docs" / "mia.md"
ROWS = {"eps_1": 1.0, "eps_3": 3.0, "eps_8": 8.0, "non_private": None}
DELTA = 1e-5
RECIPE = {"model": "tb_cnn", "optimizer": "adam", "lr": 4e-3, "batch_size": 100, "max_grad_norm": 1.0, "epochs": 40}
REFERENCES = 2
ATTACKS = ("rmia", "lira")
# the shipped spec's audit (sweeps/dpsgd_mnist_mia.yaml; trainables/audit_config.py's defaults), fixed
# before any run of this benchmark; the demo uses 100 canaries (its 100-member target)
AUDIT = {"mode": "whitebox", "canary": "engine", "canaries": 1000, "placement": "largest", "statistic": "llr",
         "estimators": ["fdp", "steinke", "gdp"], "guess_fraction": 0.2, "confidence": 0.95}
AUDIT_FIGURES = ("fdp_lb", "fdp_eps_lb", "steinke_lb", "gdp_estimate", "mu_lb")
FIGURES = ("auc", "auc_lo", "auc_hi", "tpr_at_fpr_0.001", "tpr_at_fpr_0.001_lo", "tpr_at_fpr_0.001_hi",
           "tpr_at_fpr_0.01", "tpr_at_fpr_0.01_lo", "tpr_at_fpr_0.01_hi", "eps_lb", "eps_lb_rates")


def _data(candidates: int, num_z: int, ref_size: int):
    """(candidates x, y), (population x, y), (test x, y): a public permutation (seed 0) of the
    training split; the first ``candidates`` are the pool, the rest the population."""
    from dpmech.datasets.splits import load_splits

    train, test = load_splits("mnist", train_size=None, test_size=None, seed=0)
    x, y = train.tensors
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    cand, pop = perm[:candidates], perm[candidates:candidates + num_z + 20 * ref_size]
    return (x[cand], y[cand]), (x[pop], y[pop]), test.tensors


def _train_fn(epsilon, plan_size: int, recipe: dict, log_to: dict, canaries=None):
    from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer, build_dpsgd_model
    from dpmech.privacy.secret import NoiseKey

    def train(x, y, seed):
        t0 = time.perf_counter()
        cfg = DPSGDConfig(epsilon=epsilon, delta=DELTA, batch_size=recipe["batch_size"], epochs=recipe["epochs"],
                          lr=recipe["lr"], optimizer=recipe["optimizer"], max_grad_norm=recipe["max_grad_norm"],
                          seed=seed)
        trainer = DPSGDTrainer(build_dpsgd_model("mnist", seed, recipe["model"]), x, y, cfg, plan_size=plan_size,
                               noise_key=NoiseKey.reproducible(seed), canaries=canaries).fit()
        log_to["seconds"] = log_to.get("seconds", 0.0) + time.perf_counter() - t0
        log_to["privacy"] = trainer.privacy()
        log_to["trainer"] = trainer
        model = trainer.model
        model.eval()
        return model
    return train


_REF_CACHE: dict = {}
_REF_SECONDS: dict = {}


def _audit(canaries, claim: float) -> dict:
    """The one-run audit of the target's engine canaries (the estimators of trainables/runtime.py's
    ``run_audit``, white-box branch; ``gaussian_mu`` is None there at q < 1, as here): ``fdp_lb`` the
    Gaussian-family f-DP epsilon (``audit_epsilon_gaussian_fdp``, audit_mnist.json's ``fdp_lb``),
    ``fdp_eps_lb`` and ``steinke_lb`` the rigorous bounds (``audit_epsilon_lb_fdp`` / ``_steinke``)."""
    a = canaries.audit(delta=DELTA, estimators=tuple(AUDIT["estimators"]), beta=round(1 - AUDIT["confidence"], 12),
                       guess_fraction=AUDIT["guess_fraction"], claim=claim)
    return {"fdp_lb": float(a["audit_epsilon_gaussian_fdp"]), "fdp_eps_lb": float(a["audit_epsilon_lb_fdp"]),
            "steinke_lb": float(a["audit_epsilon_lb_steinke"]), "gdp_estimate": float(a["audit_epsilon_est_gdp"]),
            "mu_lb": float(a["audit_mu_lb_fdp"]), "canaries": int(a["audit_canaries"]),
            "included": int(canaries.members), "guesses": int(a["audit_guesses"]), "correct": int(a["audit_correct"]),
            "steps": int(a["audit_steps"]), "kind": a["canary_kind"], "guess_fraction": AUDIT["guess_fraction"],
            "confidence": AUDIT["confidence"], "layers": list(canaries.layer_names),
            "canary_rows_per_step": round(float(canaries.sampled.sum()) / max(1, int(a["audit_steps"])), 2),
            "claim": claim}


def run_unit(row: str, seed: int, *, candidates: int, num_z: int, recipe: dict, references: int,
             audit_canaries: int = AUDIT["canaries"]) -> dict:
    from dpmech.privacy.audit.whitebox import EngineCanaries
    from dpmech.privacy.mia.attacks import run_attack
    from dpmech.privacy.mia.game import MembershipGame
    from dpmech.privacy.mia.references import ReferenceModels
    from dpmech.privacy.secret import NoiseKey

    eps = ROWS[row]
    (cx, cy), (px, py), (xt, yt) = _data(candidates, num_z, candidates // 2)
    # the membership coins: the owner's secret in a sweep; a reproducible key per seed here
    game = MembershipGame(cx, cy, generator=NoiseKey.reproducible(10_000 + seed).generator("mia.membership", seed))
    size = game.expected_members
    info: dict = {}
    # white-box engine canaries (AUDIT): extra rows of the engine's own sampler, batch and clipping; the
    # game's candidates, coins and plan_size are untouched. None without clipping and noise (non_private).
    canaries = (EngineCanaries(audit_canaries, seed=seed, statistic=AUDIT["statistic"], placement=AUDIT["placement"])
                if eps is not None else None)
    target = _train_fn(eps, size, recipe, info, canaries=canaries)(*game.members(), 1000 + seed)
    trainer = info["trainer"]
    train_x, train_y = game.members()
    out = {"row": row, "seed": seed, "epsilon_target": eps, "epsilon": float(info["privacy"]["epsilon"]),
           "delta": DELTA, "candidates": game.num_candidates, "members": int(train_x.shape[0]),
           "plan_size": size, "train_seconds": round(info["seconds"], 2),
           "train_acc": trainer.accuracy(train_x, train_y), "test_acc": trainer.accuracy(xt, yt)}
    if canaries is not None:
        t0 = time.perf_counter()
        out["audit"] = _audit(canaries, out["epsilon"])
        out["audit"]["seconds"] = round(time.perf_counter() - t0, 3)
        a = out["audit"]
        log(f"[{row} seed {seed}] audit ({a['canaries']} engine canaries, {a['included']} included): f-DP "
            f"{a['fdp_lb']:.2f} (rigorous {a['fdp_eps_lb']:.2f}), Steinke {a['steinke_lb']:.2f} "
            f"(claim {out['epsilon']:.2f}); {a['correct']}/{a['guesses']} guesses right")
    else:
        out["audit"] = None
    ref_log: dict = {}
    refs = ReferenceModels(_train_fn(eps, size, recipe, ref_log), px, py, count=references, train_size=size,
                           num_z=num_z, architecture=recipe["model"], recipe={**recipe, "epsilon": eps, "delta": DELTA},
                           seed=0, cache=_REF_CACHE)
    refs.models()
    _REF_SECONDS[row] = _REF_SECONDS.get(row, 0.0) + ref_log.get("seconds", 0.0)
    out["reference_seconds_trained_here"] = round(ref_log.get("seconds", 0.0), 2)
    out["references"] = references
    for attack in ATTACKS:
        t0 = time.perf_counter()
        res = run_attack(game, target, refs, attack=attack, delta=DELTA, confidence=0.95)
        out[f"{attack}_seconds"] = round(time.perf_counter() - t0, 3)
        m = res.metrics()
        out[attack] = {k: float(m[f"mia_{k}"]) for k in FIGURES}
        log(f"[{row} seed {seed}] {attack}: AUC {res.auc:.3f}, TPR {m['mia_tpr_at_fpr_0.001']:.3f} at 0.1% FPR, "
            f"{m['mia_tpr_at_fpr_0.01']:.3f} at 1%, eps_lb {res.eps_lb:.2f} (claim {out['epsilon']:.2f})")
    return out


def summarize(runs: Path = RUNS, out: Path | None = None, extra: dict | None = None) -> Path:
    units = [json.loads(p.read_text()) for p in sorted(runs.glob("*_seed*.json"))]
    old = read_result(out or RESULTS / f"{NAME}.json")
    summary = {"benchmark": NAME, **environment(torch.device("cpu")),
               "setting": {"model": RECIPE["model"], "recipe": RECIPE, "delta": DELTA, "references": REFERENCES,
                           "confidence": 0.95, "attacks": list(ATTACKS), "audit": AUDIT,
                           "note": "means over seeds; each seed a fresh membership draw and target initialisation; "
                                   "reference models shared by the seeds of a row"}}
    audited = [u["audit"]["canaries"] for u in units if u.get("audit")]
    if audited:    # the canaries the units ran with (the demo's 100)
        summary["setting"]["audit"] = dict(AUDIT, canaries=audited[0])
    if old.get("setting", {}).get("candidates"):
        summary["setting"]["candidates"] = old["setting"]["candidates"]
    for row in ROWS:
        us = sorted((u for u in units if u["row"] == row), key=lambda u: u["seed"])
        if not us:
            continue
        entry = {}
        for attack in ATTACKS:
            fig = {}
            for k in FIGURES:
                vals = [u[attack][k] for u in us]
                fig[k] = round(statistics.fmean(vals), 4)
                if k in ("auc", "tpr_at_fpr_0.001", "tpr_at_fpr_0.01", "eps_lb"):
                    fig[f"{k}_std"] = round(statistics.stdev(vals), 4) if len(vals) > 1 else 0.0
                    fig[f"{k}_per_seed"] = [round(v, 4) for v in vals]
            entry[attack] = fig
        n_trials = len(us)
        ref_total = sum(u.get("reference_seconds_trained_here", 0.0) for u in us)
        entry.update({
            "epsilon": round(statistics.fmean(u["epsilon"] for u in us), 4) if ROWS[row] is not None else None,
            "claim": ROWS[row], "delta": DELTA, "seeds": n_trials, "candidates": us[0]["candidates"],
            "members": [u["members"] for u in us],
            "train_acc": round(statistics.fmean(u["train_acc"] for u in us), 4),
            "test_acc": round(statistics.fmean(u["test_acc"] for u in us), 4),
            "cost": {"target_training_seconds": round(statistics.fmean(u["train_seconds"] for u in us), 2),
                     "reference_training_seconds_per_trial": round(ref_total / n_trials, 2),
                     "reference_training_seconds_total": round(ref_total, 2),
                     **{f"{a}_attack_seconds": round(statistics.fmean(u[f"{a}_seconds"] for u in us), 3)
                        for a in ATTACKS}},
            "targets_met": {"eps_lb_at_most_claim": all(u[a]["eps_lb"] <= u["epsilon"] + 1e-9
                                                        for u in us for a in ATTACKS)}})
        entry["audit"] = audit_entry(us)
        if entry["audit"].get("fdp_lb") is not None:
            entry["targets_met"]["audit_lb_at_most_claim"] = all(
                u["audit"][k] <= u["epsilon"] + 1e-9 for u in us for k in ("fdp_eps_lb", "steinke_lb"))
            entry["targets_met"]["audit_gaussian_fdp_at_most_claim"] = all(
                u["audit"]["fdp_lb"] <= u["epsilon"] + 1e-9 for u in us)
        if ROWS[row] is None:
            entry["targets_met"] = {"rmia_auc_at_least_0.6": entry["rmia"]["auc"] >= 0.6,
                                    "rmia_tpr_at_fpr_0.001_at_least_0.01": entry["rmia"]["tpr_at_fpr_0.001"] >= 0.01}
        summary[row] = entry
    summary.update(extra or {})
    audit = read_result(RESULTS / "audit_mnist.json").get("whitebox", {})
    if audit:
        summary["audit_for_context"] = {
            "note": "not these models (each row's `audit` is the audit of these): benchmarks/results/"
                    "audit_mnist.json's white-box one-run bounds of the full-MNIST Tramer & Boneh recipes "
                    "(60,000 examples, 50,000 isolated gradient canaries on an audit block, guess fraction 0.01): "
                    "a stronger audit of other models, kept as the one-run ceiling's context",
            **{k: {f: audit[k].get(f) for f in ("claim", "fdp_lb", "steinke_lb")} for k in ("eps_1", "eps_3", "eps_8")
               if k in audit}}
    return write_result(NAME, summary, out)


def audit_entry(units: list[dict]) -> dict:
    """A row's ``audit``: the means over its seeds of each bound (and each seed's value), the canaries
    and the guesses; ``{"skipped": why}`` where the units carry none (non_private)."""
    runs = [u["audit"] for u in units if u.get("audit")]
    if not runs:
        return {"skipped": "no clipping and no noise: no claim for gradient canaries to test (the audit key "
                           "refuses epsilon null, trainables/audit_config.py)"}
    out = {}
    for k in AUDIT_FIGURES:
        vals = [a[k] for a in runs]
        out[k] = round(statistics.fmean(vals), 4)
        out[f"{k}_per_seed"] = [round(x, 4) for x in vals]
    out.update({"canaries": runs[0]["canaries"], "kind": runs[0]["kind"], "placement": AUDIT["placement"],
                "layers": runs[0]["layers"], "statistic": AUDIT["statistic"],
                "guess_fraction": runs[0]["guess_fraction"], "confidence": runs[0]["confidence"],
                "included_per_seed": [a["included"] for a in runs], "guesses": runs[0]["guesses"],
                "correct_per_seed": [a["correct"] for a in runs], "steps": runs[0]["steps"],
                "canary_rows_per_step": round(statistics.fmean(a["canary_rows_per_step"] for a in runs), 2),
                "audit_seconds": round(statistics.fmean(a["seconds"] for a in runs), 3), "seeds": len(runs),
                "note": "fdp_lb: audit_epsilon_gaussian_fdp (Mahloujifar et al.'s empirical epsilon, a lower bound "
                        "within the Gaussian family only; audit_mnist.json's fdp_lb); fdp_eps_lb and steinke_lb: "
                        "(1 - beta)-confidence lower bounds on epsilon for any mechanism; gdp_estimate: an estimate"})
    return out


def docs_table(summary: dict) -> str:
    """docs/mia.md's table: per row and attack the claim, the audit's bounds of the same models and the
    attack's, side by side, then the attack's figures and the cost."""
    lines = ["| row | epsilon (claim) | audit lb, same models: Steinke / f-DP / f-DP Gaussian family | attack "
             "| attack eps_lb | AUC (std) | TPR @ 0.1% FPR | TPR @ 1% FPR | test acc "
             "| cost per trial: target / references / attack / audit (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in ROWS:
        e = summary.get(row)
        if not e:
            continue
        eps = "inf (no clipping, no noise)" if e["epsilon"] is None else f"{e['epsilon']:.2f}"
        a = e.get("audit") or {}
        audit = (f"{a['steinke_lb']:.2f} / {a['fdp_eps_lb']:.2f} / {a['fdp_lb']:.2f}" if a.get("fdp_lb") is not None
                 else "none (nothing to audit)")
        audit_s = f"{a['audit_seconds']:.2f}" if a.get("fdp_lb") is not None else "-"
        for attack in ATTACKS:
            f = e[attack]
            c = e["cost"]
            lines.append(f"| {row} | {eps} | {audit} | {attack.upper()} | {f['eps_lb']:.2f} "
                         f"| {f['auc']:.3f} ({f['auc_std']:.3f}) | {f['tpr_at_fpr_0.001']:.3f} "
                         f"| {f['tpr_at_fpr_0.01']:.3f} | {e['test_acc']:.3f} | "
                         f"{c['target_training_seconds']:.1f} / {c['reference_training_seconds_per_trial']:.1f} / "
                         f"{c[f'{attack}_attack_seconds']:.2f} / {audit_s} |")
    s = summary.get("setting", {})
    au = s.get("audit") or AUDIT
    lines.append("")
    lines.append(f"Means over {', '.join(str(summary[r]['seeds']) for r in ROWS if r in summary)} seeds per row "
                 f"({summary.get('date', '')[:10]}, {summary.get('device', '')}); {s.get('references')} reference "
                 "models per row, shared by its seeds; confidence 0.95; delta 1e-5. Audit: "
                 f"{au['canaries']:,} white-box {au['canary']} canaries per target (Dirac, on the largest nn.Linear "
                 f"weight, {au['statistic']} statistic), guess fraction {au['guess_fraction']}, confidence "
                 f"{au['confidence']}; target training time includes the canaries' rows.")
    return "\n".join(lines)


def draw_figure(summary: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in ROWS if r in summary]
    if not rows:
        return False
    xs = {r: (summary[r]["epsilon"] if summary[r]["epsilon"] is not None else 30.0) for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for attack, marker in (("rmia", "o"), ("lira", "s")):
        for ax, key, label in ((axes[0], "auc", "AUC"), (axes[1], "tpr_at_fpr_0.001", "TPR at 0.1% FPR"),
                               (axes[1], "tpr_at_fpr_0.01", "TPR at 1% FPR"), (axes[2], "eps_lb", "eps_lb")):
            ys = [summary[r][attack][key] for r in rows]
            err = [summary[r][attack].get(f"{key}_std", 0.0) for r in rows]
            style = "-" if key != "tpr_at_fpr_0.01" else "--"
            ax.errorbar([xs[r] for r in rows], ys, yerr=err, marker=marker, linestyle=style, capsize=3,
                        label=f"{attack.upper()} {label}" if ax is axes[1] else attack.upper())
    priv = [r for r in rows if summary[r]["epsilon"] is not None]
    axes[2].plot([xs[r] for r in priv], [summary[r]["epsilon"] for r in priv], "k:", label="claim (epsilon)")
    aud = [r for r in priv if (summary[r].get("audit") or {}).get("steinke_lb") is not None]
    for key, marker, label in (("steinke_lb", "^", "audit, Steinke"), ("fdp_eps_lb", "v", "audit, f-DP"),
                               ("fdp_lb", "D", "audit, f-DP Gaussian family")):
        if aud:
            vals = [summary[r]["audit"][f"{key}_per_seed"] for r in aud]
            ys = [statistics.fmean(v) for v in vals]
            err = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]
            axes[2].errorbar([xs[r] for r in aud], ys, yerr=err, marker=marker, linestyle="-.", capsize=3,
                             label=f"{label} (same models)")
    for ax, title in zip(axes, ("AUC", "TPR at low FPR", "epsilon: claim and lower bounds (95%)")):
        ax.set_xscale("log")
        ax.set_xticks([xs[r] for r in rows])
        ax.set_xticklabels([("non-private" if summary[r]["epsilon"] is None else f"{summary[r]['epsilon']:.0f}")
                            for r in rows])
        ax.set_xlabel("epsilon")
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[0].axhline(0.5, color="grey", lw=0.5)
    fig.suptitle("MNIST, tb_cnn, DP-SGD: offline MIAs against epsilon (benchmarks/mia_mnist.py)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_docs(path: Path | None = None, doc: Path = DOC) -> None:
    summary = read_result(path or RESULTS / f"{NAME}.json")
    figure = doc.parent / "figures" / f"{NAME}.png"
    block = docs_table(summary)
    if draw_figure(summary, figure):
        block += (f"\n\n![AUC, TPR at low FPR, and the attack's and the audit's lower bounds against epsilon]({os.path.relpath(figure, doc.parent)})\n\n"
                  "Error bars: the standard deviation over seeds; the non-private row drawn at the right end.")
    update_doc_blocks({doc: {NAME: block}})
    log(f"wrote {doc}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--candidates", type=int, default=2000)
    ap.add_argument("--num-z", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=Path, default=RUNS)
    ap.add_argument("--summary", action="store_true", help="only rebuild the results file from the unit files")
    ap.add_argument("--docs", action="store_true", help="write docs/mia.md's table and figure from the results file")
    ap.add_argument("--demo", action="store_true",
                    help="tiny: 200 candidates, 3 epochs, 1 seed, 1 reference, 100 audit canaries")
    ap.add_argument("--out", type=Path, default=None, help="write the summary here (demo: required)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.summary or args.docs:
        if args.summary:
            log(f"wrote {summarize(args.runs, args.out)}")
        if args.docs:
            write_docs(args.out)
        return read_result(args.out or RESULTS / f"{NAME}.json")
    recipe, references, candidates, num_z = dict(RECIPE), REFERENCES, args.candidates, args.num_z
    audit_canaries = AUDIT["canaries"]
    if args.demo:
        if args.out is None:
            ap.error("--demo needs --out (the committed results are the full run's)")
        recipe.update(epochs=3, batch_size=20)
        references, candidates, num_z, audit_canaries = 1, 200, 200, 100
        args.seeds = args.seeds[:1]
        args.runs = args.out.parent / f"{args.out.stem}_units"
    if args.epochs:
        recipe["epochs"] = args.epochs
    args.runs.mkdir(parents=True, exist_ok=True)
    for row in args.rows:
        for seed in args.seeds:
            with claimed_unit(args.runs, f"{row}_seed{seed}") as path:
                if path is None:
                    continue
                out = run_unit(row, seed, candidates=candidates, num_z=num_z, recipe=recipe, references=references,
                               audit_canaries=audit_canaries)
                path.write_text(json.dumps(out, indent=1) + "\n")
                log(f"wrote {path}")
            summarize(args.runs, args.out, extra={"setting_candidates": candidates})
    return read_result(args.out or RESULTS / f"{NAME}.json")


if __name__ == "__main__":
    main()
