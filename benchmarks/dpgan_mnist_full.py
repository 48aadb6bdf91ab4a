"""DPGAN and DP-MERF on full MNIST with the SoK protocol (issue 17; docs/dpgan.md, docs/dp_merf.md).

Train-on-synthetic, test-on-real as in Hu et al.'s SoK (S&P 2024): a CNN trained on 60,000 generated
labelled images (balanced labels), tested on the 10,000 real test images (``tstr_acc``), beside the
judge's scores of the samples (``sample_quality``, ``classifier_score``: a CNN trained on real
held-out images). Units, in this order (the issue's targets first; resumable, every finished unit is
written at once and skipped on restart):

1. DP-MERF epsilon 1 and 10, seed 0 (5 x 40 generator steps); 2. DPGAN epsilon 10 and 1, seed 0; 3. the
``dpgan_v2`` recipe at epsilon 10; 4. DP-MERF with the paper's 600 generator steps (``dp_merf_paper``),
seeds 0, 1, 2;
5. the non-private DPGAN (WGAN) seed 0; 6. DPGAN seeds 1, 2; 7. the non-private DP-MERF (paper steps);
8. the 5 x 40-step DP-MERF at seeds 1, 2.

Writes benchmarks/results/dpgan_mnist_full.json: the shipped recipes (:data:`SHIPPED`) at the top level
(``dpgan_hist.eps_10.tstr_acc`` = mean over the seeds done, ``..._std``, ``..._seeds``, ``epsilon_rdp``,
``train_seconds``; ``units`` holds their runs), every other recipe under ``superseded.<method>`` =
{reason, base, recipes, results (the same aggregates), units} (:data:`SUPERSEDED`), and a sample grid
per unit, benchmarks/results/dpgan_mnist_full/<unit>.png. One thread (``torch.set_num_threads(1)``):
seconds are 1-thread CPU seconds on a shared machine.

    nohup nice -n 5 .venv/bin/python benchmarks/dpgan_mnist_full.py > /work/logs/dpgan_full.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, environment, log, merge_new, read_result, update_doc_blocks, write_result  # noqa: E402
from dpmech.datasets.splits import load_splits  # noqa: E402
from dpmech.dp_merf.trainer import DPMERFConfig, DPMERFTrainer  # noqa: E402
from dpmech.dpgan.config import DPGANConfig  # noqa: E402
from dpmech.dpgan.trainer import DPGANTrainer
from dpmech.dpgan.evaluate import evaluate_samples, predict, sample_grid  # noqa: E402

NAME = "dpgan_mnist_full"
# DPGAN recipes (docs/dpgan.md, "What changed"): expected batch m and epochs sized so that the noisy
# sum's signal-to-noise ratio per step is >= ~1 and a run takes minutes on one CPU thread.
DPGAN_BASE = dict(dataset="mnist", delta=1e-5, n_critic=1, clip_grad=1.0, clip_weight=0.1, clip_fake=True,
                  mode_seeking=1.0, ema=0.99, optimizer="rmsprop", latent_dim=64, hidden=128, architecture="mlp")
DPGAN_RECIPES = {
    10.0: dict(batch_size=1200, epochs=30, lr_critic=5e-4, lr_generator=5e-4),
    1.0: dict(batch_size=2000, epochs=30, lr_critic=5e-4, lr_generator=5e-4),
    None: dict(batch_size=1200, epochs=30, lr_critic=5e-4, lr_generator=5e-4),
}
# DP-MERF: the paper's features, batch and schedule, but 5 x 40 generator steps instead of 5 x 120 (the CPU
# share of this machine; measured 0.79 TSTR after 200 steps at epsilon 1, docs/dp_merf.md).
MERF_BASE = dict(dataset="mnist", delta=1e-5, n_features=10000, epochs=5, steps_per_epoch=40, batch_size=500,
                 lr=0.01, lr_decay=0.9, code_dim=5, hidden=200)
TSTR_SAMPLES, TSTR_EPOCHS = 60000, 2          # the SoK protocol: 60k generated images, 10k real test images
JUDGE_SIZE, JUDGE_EPOCHS, QUALITY_SAMPLES = 5000, 3, 2000


# dpgan_v2 (epsilon 10, seed 0): a second recipe after the first measured one (tstr_acc 0.695, salt-and-pepper
# samples and one class lost): 40 epochs (2,000 critic steps) and a slower generator EMA (0.998).
DPGAN_V2 = {10.0: dict(DPGAN_RECIPES[10.0], epochs=40)}
DPGAN_V2_BASE = dict(DPGAN_BASE, ema=0.998)
# dpgan_dcg: the first recipe with the reference code's generator shape (generator "dcgan": fully connected
# to 7 x 7, two transposed convolutions; narrowed to 32 / 16 channels, GroupNorm): the MLP generator's
# samples carry per-pixel salt-and-pepper noise and lose a class at every epsilon, and the non-private
# WGAN with the MLP recipe is no better than the private one, so the generator, not the privacy noise,
# was the suspect. The critic and the privacy are unchanged.
DPGAN_DCG_BASE = dict(DPGAN_BASE, generator="dcgan")
# dpgan_hist: the first recipe with fake labels drawn from the label histogram released by the Gaussian
# mechanism (noise std 100 per count, in the ledger; fake_labels "dp_histogram"): with uniform fake labels
# the critic grows per-class offsets that follow MNIST's class frequencies and the rarest class's (5)
# generator makes noise (docs/dpgan.md, "Why class 5 fails").
DPGAN_HIST_BASE = dict(DPGAN_BASE, fake_labels="dp_histogram", histogram_noise=100.0)
# dp_merf_paper: the paper's 5 x 120 generator steps (3x the CPU of dp_merf's 5 x 40), seed 0 only.
MERF_PAPER = {**MERF_BASE, "steps_per_epoch": 120}

# the recipes of sweeps/dpgan_mnist_sok.yaml (and dpgan_mnist.yaml) and sweeps/dp_merf_mnist.yaml: the
# file's top level; every other method is kept under ``superseded`` with the reason it was replaced
SHIPPED = {"dpgan": "dpgan_hist (sweeps/dpgan_mnist_sok.yaml); `dpgan` = the same with uniform fake labels",
           "dp_merf": "dp_merf_paper (sweeps/dp_merf_mnist.yaml)"}
SUPERSEDED = {
    "dpgan": "uniform fake labels (Alg. 1 as printed): class 5's samples are noise at every epsilon and epsilon 10 "
             "missed its target; dpgan_hist draws them from the DP label histogram (docs/dpgan.md)",
    "dpgan_v2": "40 epochs and generator EMA 0.998 on the uniform-label recipe (epsilon 10): no better than `dpgan`",
    "dpgan_dcg": "the reference's generator shape on the uniform-label recipe: class 5 still lost (the labels, not "
                 "the generator, were the cause), ~3x the CPU",
    "dp_merf": "5 x 40 generator steps (the CPU share of the first run); dp_merf_paper runs the paper's 5 x 120",
}
# the recipe of each superseded method (base, per-epsilon recipes where it has its own)
SUPERSEDED_RECIPES = {"dpgan": (DPGAN_BASE, DPGAN_RECIPES), "dpgan_v2": (DPGAN_V2_BASE, DPGAN_V2),
                      "dpgan_dcg": (DPGAN_DCG_BASE, DPGAN_RECIPES), "dp_merf": (MERF_BASE, None)}


def units():
    out = [("dp_merf", 1.0, 0), ("dp_merf", 10.0, 0), ("dpgan", 10.0, 0), ("dpgan", 1.0, 0)]
    out += [("dpgan_v2", 10.0, 0), ("dp_merf_paper", 1.0, 0), ("dp_merf_paper", 10.0, 0)]
    out += [("dp_merf_paper", e, s) for s in (1, 2) for e in (1.0, 10.0)]
    out += [("dpgan", None, 0)]
    out += [("dpgan", e, s) for s in (1, 2) for e in (10.0, 1.0)]
    out += [("dp_merf_paper", None, 0)]
    out += [("dp_merf", e, s) for s in (1, 2) for e in (1.0, 10.0)]
    out += [("dpgan_dcg", e, 0) for e in (10.0, 1.0)] + [("dpgan_dcg", e, s) for s in (1, 2) for e in (10.0, 1.0)]
    out += [("dpgan_hist", e, 0) for e in (10.0, 1.0)] + [("dpgan_hist", e, s) for s in (1, 2) for e in (10.0, 1.0)]
    out += [("dpgan_hist", None, 0)]
    out += [("dpgan_hist", e, 0) for e in PAPER_EPS]          # Xie et al.'s epsilons, one seed
    return out


# the DPGAN paper's epsilons (Xie et al. 2018, MNIST; sweeps/dpgan_mnist.yaml)
PAPER_EPS = (11.5, 5.76, 3.2, 0.72)


def dpgan_recipe(recipes: dict, eps):
    """The recipe at ``eps``; an epsilon without its own (the paper's) takes epsilon 10's batch from
    epsilon 2 up and epsilon 1's below (the batch that keeps the noisy sum's SNR near 1)."""
    if eps in recipes:
        return recipes[eps]
    return recipes[10.0] if eps >= 2 else recipes[1.0]


def eps_key(eps) -> str:
    return "non_private" if eps is None else f"eps_{eps:g}"


def unit_key(method, eps, seed) -> str:
    return f"{method}.{eps_key(eps)}.seed_{seed}"


def _finite(v):
    return None if isinstance(v, float) and (math.isinf(v) or math.isnan(v)) else v


def run_unit(method, eps, seed, data, device, progress_every=1):
    x, y, xt, yt, judge = data
    t0 = time.perf_counter()
    if method.startswith("dpgan"):
        base, recipes = {"dpgan": (DPGAN_BASE, DPGAN_RECIPES), "dpgan_v2": (DPGAN_V2_BASE, DPGAN_V2),
                         "dpgan_dcg": (DPGAN_DCG_BASE, DPGAN_RECIPES),
                         "dpgan_hist": (DPGAN_HIST_BASE, DPGAN_RECIPES)}[method]
        cfg = DPGANConfig(epsilon=eps, seed=seed, **base, **dpgan_recipe(recipes, eps))
        tr = DPGANTrainer(cfg, x, y, device=device, judge_data=judge, judge_epochs=JUDGE_EPOCHS)
        log(f"  sigma {tr.noise_multiplier:.4f}, q {tr.sampling_rate:.5f}, {tr.planned_critic_steps} critic steps")
        epochs = cfg.epochs
    else:
        cfg = DPMERFConfig(epsilon=eps, seed=seed, **(MERF_PAPER if method == "dp_merf_paper" else MERF_BASE))
        tr = DPMERFTrainer(cfg, x, y, device=device, judge_data=judge, judge_epochs=JUDGE_EPOCHS)
        log(f"  sigma {tr.noise_multiplier:.4f} (sensitivity 1), noisy count {tr.noisy_count:.1f}, "
            f"release {time.perf_counter() - t0:.1f} s")
        epochs = cfg.epochs
    curve = []
    for e in range(epochs):
        m = tr.train_epoch()
        if (e + 1) % progress_every == 0 or e + 1 == epochs:
            agree = tr.accuracy(xt, yt)   # the judge's agreement on eval_samples generated images
            curve.append({"epoch": e + 1, "train_loss": m["train_loss"], "judge_agreement": agree})
            log(f"  epoch {e + 1}/{epochs}: loss {m['train_loss']:.4g}, judge agreement {agree:.3f}, "
                f"{time.perf_counter() - t0:.0f} s")
    train_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    ev = evaluate_samples(tr, xt, yt, tstr_samples=TSTR_SAMPLES, tstr_epochs=TSTR_EPOCHS,
                          quality_samples=QUALITY_SAMPLES, seed=seed)
    per_class = class_quality(tr, seed)
    (RESULTS / NAME).mkdir(parents=True, exist_ok=True)
    grid = sample_grid(tr, RESULTS / NAME / f"{unit_key(method, eps, seed).replace('.', '_')}.png", seed=seed)
    priv = tr.privacy()
    row = {"method": method, "epsilon_target": eps, "seed": seed, "config": cfg.to_dict(), **ev,
           "epsilon_rdp": priv["epsilon"], "epsilon_pld": priv["epsilon_pld"],
           "noise_multiplier": priv["noise_multiplier"], "train_seconds": train_s,
           "eval_seconds": time.perf_counter() - t1, "judge_curve": curve, "sample_grid": f"{NAME}/{grid.name}",
           "sample_quality_by_class": per_class}
    if method.startswith("dpgan"):
        row.update(sampling_rate=priv["sampling_rate"], critic_steps=priv["critic_steps"],
                   clipped_fraction=priv["clipped_fraction"], epsilon_paper_lemma2=priv["epsilon_paper_lemma2"])
    return {k: _finite(v) for k, v in row.items()}


def class_quality(trainer, seed: int, per_class: int = 200) -> list[float]:
    """The judge's accuracy on ``per_class`` generated images of each class (a lost class shows as ~0)."""
    labels = torch.arange(trainer.classes).repeat_interleave(per_class)
    pred = predict(trainer.judge(), trainer.sample(labels, seed=seed + 11)).cpu()
    return [round(float((pred[labels == c] == c).float().mean()), 4) for c in range(trainer.classes)]


def aggregate(done: dict) -> dict:
    """method -> eps_key -> tstr_acc (mean over seeds), tstr_acc_std, seeds, epsilon_rdp, train_seconds..."""
    out: dict = {}
    for row in done.values():
        out.setdefault(row["method"], {}).setdefault(eps_key(row["epsilon_target"]), []).append(row)
    agg = {}
    for method, by_eps in out.items():
        for ek, rows in by_eps.items():
            rows = sorted(rows, key=lambda r: r["seed"])
            acc = [r["tstr_acc"] for r in rows]
            entry = {"tstr_acc": statistics.fmean(acc), "tstr_acc_std": statistics.stdev(acc) if len(acc) > 1 else None,
                     "seeds": [r["seed"] for r in rows], "tstr_acc_per_seed": acc,
                     "sample_quality": statistics.fmean(r["sample_quality"] for r in rows),
                     "epsilon_rdp": max((r["epsilon_rdp"] for r in rows if r["epsilon_rdp"] is not None), default=None),
                     "train_seconds": statistics.fmean(r["train_seconds"] for r in rows)}
            agg.setdefault(method, {})[ek] = entry
    return agg


def method_results(result: dict, method: str) -> dict | None:
    """A method's aggregates: at the top level (a shipped recipe) or under ``superseded``."""
    if method in result:
        return result[method]
    return result.get("superseded", {}).get(method, {}).get("results")


def all_units(state: dict) -> dict:
    """Every run of a results file: the shipped recipes' and the superseded methods' (not the entries of
    ``superseded`` kept from code that no longer exists, which no unit of :func:`units` names)."""
    old = state.get("superseded", {})
    return {**state.get("units", {}), **{k: v for m in SUPERSEDED for k, v in old.get(m, {}).get("units", {}).items()}}


# published TSTR accuracies (Hu et al., SoK, S&P 2024, Table 2) and issue 17's targets, for the docs' tables
PUBLISHED = {("dpgan", "eps_10"): 0.747, ("dpgan", "eps_1"): 0.586, ("dpgan", "non_private"): 0.889,
             ("dp_merf", "eps_10"): 0.832, ("dp_merf", "eps_1"): 0.839, ("dp_merf", "non_private"): 0.870}
TARGETS = {("dpgan", "eps_10"): 0.75, ("dpgan", "eps_1"): 0.55, ("dp_merf", "eps_10"): 0.80, ("dp_merf", "eps_1"): 0.80}
DOC_TABLES = {  # doc -> (method, caption) in order; written between the doc's results markers
    "docs/dpgan.md": (("dpgan", "Recipe of the table above (`dpgan`)"),
                      ("dpgan_v2", "`dpgan_v2`: 40 epochs, generator EMA 0.998 (epsilon 10 only)"),
                      ("dpgan_dcg", "`dpgan_dcg`: the recipe above with the reference's generator shape "
                                    "(`generator: dcgan`)"),
                      ("dpgan_hist", "`dpgan_hist`: the first recipe with fake labels drawn from the DP label histogram "
                                     "(`fake_labels: dp_histogram`, noise std 100 per count, in epsilon)")),
    "docs/dp_merf.md": (("dp_merf", "`dp_merf`: 5 x 40 generator steps (the benchmark's setting)"),
                        ("dp_merf_paper", "`dp_merf_paper`: the paper's 5 x 120 generator steps")),
}


def results_table(result: dict, method: str) -> str:
    """Published vs measured (markdown) for one method of the benchmark's JSON."""
    base = "dp_merf" if method.startswith("dp_merf") else "dpgan"
    lines = ["| setting | published (SoK) | target | measured tstr_acc | seeds | epsilon (RDP) | sample_quality "
             "| train s (1 thread) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for ek in ("eps_10", "eps_1", "non_private"):
        e = (method_results(result, method) or {}).get(ek)
        pub, tgt = PUBLISHED.get((base, ek)), TARGETS.get((base, ek))
        if e is None:
            if method in (base, "dpgan_dcg", "dpgan_hist"):
                lines.append(f"| {ek} | {pub if pub is not None else '-'} | {tgt or '-'} | not run | - | - | - | - |")
            continue
        sd = f" ± {e['tstr_acc_std']:.3f}" if e.get("tstr_acc_std") is not None else ""
        eps = "inf" if e["epsilon_rdp"] is None else f"{e['epsilon_rdp']:.3f}"
        lines.append(f"| {ek} | {pub if pub is not None else '-'} | {tgt or '-'} | {e['tstr_acc']:.3f}{sd} | "
                     f"{', '.join(map(str, e['seeds']))} | {eps} | {e['sample_quality']:.3f} | {e['train_seconds']:.0f} |")
    return "\n".join(lines)


def paper_eps_table(result: dict, method: str = "dpgan_hist") -> str:
    """tstr_acc at the DPGAN paper's epsilons (one seed each) with the recipe's batch size."""
    lines = ["| epsilon (target) | expected batch m | tstr_acc | seeds | epsilon (RDP) | sample_quality | train s (1 thread) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for e in PAPER_EPS:
        r = (method_results(result, method) or {}).get(eps_key(e))
        m = dpgan_recipe(DPGAN_RECIPES, e)["batch_size"]
        if r is None:
            lines.append(f"| {e:g} | {m} | not run | - | - | - | - |")
            continue
        lines.append(f"| {e:g} | {m} | {r['tstr_acc']:.3f} | {', '.join(map(str, r['seeds']))} | "
                     f"{r['epsilon_rdp']:.3f} | {r['sample_quality']:.3f} | {r['train_seconds']:.0f} |")
    return "\n".join(lines)


def update_docs(result: dict, root: Path = Path(__file__).resolve().parent.parent) -> list[Path]:
    """Rewrite the ``results`` block of docs/dpgan.md and docs/dp_merf.md from ``result``."""
    src = f"From benchmarks/results/{NAME}.json by `python benchmarks/{NAME}.py --docs`.\n\n"
    blocks = {root / doc: {"results": src + "\n\n".join(f"{caption}:\n\n{results_table(result, m)}"
                                                        for m, caption in methods
                                                        if method_results(result, m) is not None)}
              for doc, methods in DOC_TABLES.items()}
    blocks[root / "docs/dpgan.md"]["paper-eps"] = src + paper_eps_table(result)
    return update_doc_blocks(blocks)


def payload(done: dict, state: dict, device: torch.device) -> dict:
    """The JSON: the shipped recipes, their per-method aggregates (:func:`aggregate`) and units at the top
    level; each superseded method's reason, recipe, aggregates and units under ``superseded``."""
    agg = aggregate(done)
    superseded = {}
    for m, reason in SUPERSEDED.items():
        units_m = {k: r for k, r in done.items() if r["method"] == m}
        if units_m:
            base, recipes = SUPERSEDED_RECIPES[m]
            superseded[m] = {"reason": reason, "base": base,
                             **({"recipes": {eps_key(k): v for k, v in recipes.items()}} if recipes else {}),
                             "results": agg[m], "units": units_m}
    # entries of code that no longer runs (kept as they were)
    superseded.update({k: v for k, v in state.get("superseded", {}).items() if k not in SUPERSEDED})
    return {"benchmark": NAME, "protocol": f"SoK (Hu et al. 2024): SmallCNN trained on {TSTR_SAMPLES} generated "
            f"labelled images ({TSTR_EPOCHS} epochs), tested on the 10,000 real MNIST test images",
            "threads": 1, "note": "1-thread CPU seconds on a 2-core machine shared with other jobs; judge = SmallCNN "
            "on the last 5,000 real test images (diagnostic for sample_quality; judge_acc is partly in-sample)",
            "shipped_recipe": SHIPPED, "dpgan_hist_base": DPGAN_HIST_BASE,
            "dpgan_recipes": {eps_key(k): v for k, v in DPGAN_RECIPES.items()}, "dp_merf_paper_base": MERF_PAPER,
            **{m: a for m, a in agg.items() if m not in SUPERSEDED},
            "units": {k: r for k, r in done.items() if r["method"] not in SUPERSEDED},
            "superseded": superseded, "environment": environment(device)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated unit keys, e.g. dp_merf.eps_1.seed_0")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--docs", action="store_true", help="only rewrite the docs' results tables from the JSON")
    ap.add_argument("--merge", type=Path, nargs="+", default=None,
                    help="only add the units of these JSON files (runs written with --out) to the results")
    args = ap.parse_args(argv)
    if args.merge:
        path = args.out or RESULTS / f"{NAME}.json"
        state = json.loads(path.read_text()) if path.exists() else {}
        done = merge_new(all_units(state), args.merge, "units", part=lambda o: {"units": all_units(o)})
        write_result(NAME, payload(done, state, torch.device("cpu")), path)
        return {}
    if args.docs:
        for p in update_docs(json.loads((args.out or RESULTS / f"{NAME}.json").read_text())):
            log(f"wrote {p}")
        return {}
    logging.getLogger("absl").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    path = args.out or RESULTS / f"{NAME}.json"
    state = json.loads(path.read_text()) if path.exists() else {}
    done = all_units(state)
    log("loading MNIST (60,000 training, 10,000 test images) ...")
    train, test = load_splits("mnist", train_size=None, test_size=None, seed=0)
    x, y = train.tensors
    xt, yt = test.tensors
    # All 70,000 split images are in use; the judge (a diagnostic: sample_quality) trains on the last
    # 5,000 test images, so its judge_acc on the full test set is partly in-sample (tstr_acc is the result).
    judge = (xt[-JUDGE_SIZE:], yt[-JUDGE_SIZE:])
    data = (x, y, xt, yt, judge)
    wanted = None if args.only is None else set(args.only.split(","))
    for method, eps, seed in units():
        key = unit_key(method, eps, seed)
        if key in done or (wanted is not None and key not in wanted):
            continue
        log(f"{key}: training ...")
        r = run_unit(method, eps, seed, data, device)
        log(f"{key}: tstr_acc {r['tstr_acc']:.4f}, sample_quality {r['sample_quality']:.3f}, epsilon_rdp "
            f"{r['epsilon_rdp']}, train {r['train_seconds']:.0f} s, eval {r['eval_seconds']:.0f} s")
        # units another process wrote to the same file meanwhile are kept (re-read before each write)
        done = {**all_units(read_result(path)), **done, key: r}
        write_result(NAME, payload(done, state, device), path)
    log("all units done")
    return state


if __name__ == "__main__":
    main()
