"""DPGAN on MNIST: train-on-synthetic, test-on-real accuracy at the paper's epsilons.

For epsilon in {non-private, 11.5, 5.76, 3.2, 0.72} (Xie et al. 2018's values, delta = 1e-5) trains
a conditional DPGAN (docs/dpgan.md) and reports, side by side:

* ``tstr_acc``: a small CNN trained only on generated labelled images, tested on the real test set;
* ``sample_quality`` / ``sample_confidence`` / ``classifier_score``: scores of the samples under a
  classifier trained on real, non-training images (``judge_acc``: that classifier's test accuracy);
* ``epsilon`` (RDP, from the ledger), ``epsilon_pld`` and the paper's Lemma 2 formula
  ``epsilon_paper_lemma2`` for the same noise, sampling rate and number of critic steps;
* the noise multiplier, the fraction of clipped per-example gradients, seconds.

Prints a table and writes benchmarks/results/dpgan_mnist.json (device, versions, date).
``--demo`` runs a small version (2,000 training images, 10 epochs, small evaluation; measured 7.5
minutes for all five epsilons on a heavily shared 2-core CPU) and writes it under the ``demo`` key
of benchmarks/results/dpgan_mnist.json.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import demo_parser, environment, log, write_run  # noqa: E402
from dpmech.datasets.splits import load_held_out, load_splits  # noqa: E402
from dpmech.dpgan.config import DPGANConfig  # noqa: E402
from dpmech.dpgan.trainer import DPGANTrainer
from dpmech.dpgan.evaluate import evaluate_samples  # noqa: E402

EPSILONS = (None, 11.5, 5.76, 3.2, 0.72)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv=None) -> dict:
    ap = demo_parser(__doc__)
    ap.add_argument("--test-size", type=int, default=None)
    ap.add_argument("--epsilons", type=str, default=None, help="comma-separated; 'none' = non-private")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)
    demo = args.demo
    device = torch.device(args.device)
    train_size = args.train_size or (2000 if demo else None)
    test_size = args.test_size or (500 if demo else 10000)
    epochs = args.epochs or (10 if demo else 30)
    eps_list = EPSILONS if args.epsilons is None else tuple(
        None if e.strip().lower() in ("none", "null") else float(e) for e in args.epsilons.split(","))
    tstr_samples, tstr_epochs = (1000, 2) if demo else (10000, 3)
    judge_size, judge_epochs = (2000, 2) if demo else (10000, 3)
    quality_samples = 500 if demo else 2000

    log(f"DPGAN MNIST benchmark on {device} ({'demo' if demo else 'full'}): loading MNIST ...")
    train, test = load_splits("mnist", train_size=train_size, test_size=test_size, seed=args.seed)
    x, y = train.tensors
    xt, yt = test.tensors
    pool = load_held_out("mnist", train_size=train_size, test_size=test_size, seed=args.seed)
    judge = (pool.tensors[0][:judge_size], pool.tensors[1][:judge_size])
    log(f"  {x.shape[0]} training images, {xt.shape[0]} test images, judge trained on {judge[0].shape[0]} "
        f"held-out images")
    base = dict(dataset="mnist", delta=1e-5, epochs=epochs, batch_size=64, n_critic=1, clip_grad=1.0,
                clip_weight=0.1, lr_critic=1e-3, lr_generator=1e-3, optimizer="rmsprop",
                latent_dim=32 if demo else 64, hidden=128 if demo else 256, seed=args.seed)
    rows = []
    for eps in eps_list:
        cfg = DPGANConfig(epsilon=eps, **base)
        t0 = time.perf_counter()
        tr = DPGANTrainer(cfg, x, y, device=device, judge_data=judge, judge_epochs=judge_epochs)
        log(f"epsilon {_fmt(eps)}: sigma {tr.noise_multiplier:.4f}, q {tr.sampling_rate:.5f}, "
            f"{tr.planned_critic_steps} critic steps planned")
        for e in range(epochs):
            m = tr.train_epoch()
            if (e + 1) % max(1, epochs // 5) == 0 or e + 1 == epochs:
                log(f"  epoch {e + 1}/{epochs}: critic loss {m['train_loss']:.4f}, "
                    f"judge agreement {tr.accuracy(xt, yt):.3f}")
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ev = evaluate_samples(tr, xt, yt, tstr_samples=tstr_samples, tstr_epochs=tstr_epochs,
                              quality_samples=quality_samples, seed=args.seed)
        priv = tr.privacy()
        row = {"epsilon_target": eps, **ev, **priv, "train_seconds": train_s,
               "eval_seconds": time.perf_counter() - t0}
        rows.append(row)
        log(f"  tstr_acc {ev['tstr_acc']:.4f}, sample_quality {ev['sample_quality']:.3f}, epsilon "
            f"{_fmt(priv['epsilon'])} (pld {_fmt(priv['epsilon_pld'])}, paper Lemma 2 {_fmt(priv['epsilon_paper_lemma2'])})")

    cols = ("epsilon_target", "epsilon", "epsilon_pld", "epsilon_paper_lemma2", "noise_multiplier", "tstr_acc",
            "sample_quality", "classifier_score", "clipped_fraction", "train_seconds")
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
    judge_acc = rows[0]["judge_acc"] if rows else None
    print(f"\njudge classifier accuracy on the real test set: {_fmt(judge_acc)}")
    result = {
        "benchmark": "dpgan_mnist",
        "mode": "demo" if demo else "full",
        "config": base,
        "train_images": int(x.shape[0]),
        "test_images": int(xt.shape[0]),
        "tstr_samples": tstr_samples,
        "tstr_epochs": tstr_epochs,
        "judge_images": int(judge[0].shape[0]),
        "rows": [{k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in r.items()} for r in rows],
        "note": "epsilon null in rows = infinite (non-private); epsilon_paper_lemma2 is the paper's formula, not a guarantee",
        "environment": environment(device),
    }
    write_run("dpgan_mnist", result, demo, args.out)
    return result


if __name__ == "__main__":
    main()
