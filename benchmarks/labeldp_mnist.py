"""Label DP on MNIST: classification accuracy and regression MSE against epsilon, Laplace and
randomized response side by side, with the non-private baseline of each task.

For each task (classification: one-hot labels + Lap(2/eps) -> argmax; regression: the digit +
Lap(9/eps) clamped to [0, 9], MSE loss), each mechanism (laplace, rr) and each epsilon, the labels
are released once and a freshly initialised CNN (the source's two-conv network) is trained on
them; one more run per task trains on the true labels. Prints a table and writes
benchmarks/results/labeldp_mnist.json: test accuracy (classification; regression: of rounded
predictions), test MSE (regression), the measured fraction of labels kept, its analytic value, the
epsilon computed from the noise drawn and the exact epsilon of the post-processed labels. The
source document reports accuracy 0.9882 and MSE 0.2431 without noise (50 epochs, full MNIST).

Full mode: full MNIST, 10 epochs, epsilon in 0.01 .. 100 (half decades): 38 trainings (a GPU
job). ``--demo``: 2,000 training and 500 test images, 2 epochs, epsilon in {0.1, 1, 10, 100}
(about two minutes on 2 CPU cores), written under the ``demo`` key of benchmarks/results/labeldp_mnist.json.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import demo_parser, environment, log, write_run  # noqa: E402
from dpmech.datasets.splits import load_splits  # noqa: E402
from dpmech.label_dp.trainer import LabelDPConfig, LabelDPTrainer  # noqa: E402

FULL_EPSILONS = (0.01, 0.0316227766, 0.1, 0.316227766, 1.0, 3.16227766, 10.0, 31.6227766, 100.0)
DEMO_EPSILONS = (0.1, 1.0, 10.0, 100.0)
SOURCE = {"acc_clean_no_noise": 0.9882, "mse_no_noise": 0.2431}


def run_one(cfg: LabelDPConfig, x, y, xt, yt, device) -> dict:
    t0 = time.perf_counter()
    trainer = LabelDPTrainer(cfg, x, y, device=device)
    for _ in range(cfg.epochs):
        loss = trainer.train_epoch()["train_loss"]
    seconds = time.perf_counter() - t0
    p = trainer.privacy()
    out = {"task": cfg.task, "mechanism": cfg.mechanism if cfg.private else "none",
           "postprocess": cfg.postprocess, "epsilon_config": cfg.epsilon,
           "acc_clean": trainer.accuracy(xt, yt),
           "mse": trainer.mse(xt, yt) if cfg.task == "regression" else None,
           "label_keep_rate": p["label_keep_rate"], "analytic_keep_prob": p["analytic_keep_prob"],
           "epsilon": p["epsilon"] if math.isfinite(p["epsilon"]) else None,
           "label_epsilon": p["label_epsilon"] if math.isfinite(p["label_epsilon"]) else None,
           "noise_scale": p["noise_scale"], "final_train_loss": loss, "train_seconds": seconds}
    return out


def _fmt(v, spec=".4f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv=None) -> dict:
    ap = demo_parser(__doc__)
    ap.add_argument("--test-size", type=int, default=None)
    ap.add_argument("--epsilons", type=float, nargs="+", default=None)
    ap.add_argument("--postprocess", choices=("argmax", "clamp_round"), default="argmax",
                    help="classification + laplace: argmax, or the source's clamp-and-round")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the report's figure to this PNG")
    args = ap.parse_args(argv)
    demo = args.demo
    epochs = args.epochs or (2 if demo else 10)
    train_size = args.train_size or (2000 if demo else None)
    test_size = args.test_size or (500 if demo else None)
    epsilons = tuple(args.epsilons or (DEMO_EPSILONS if demo else FULL_EPSILONS))
    device = torch.device(args.device)

    log(f"Label-DP MNIST benchmark on {device} ({'demo' if demo else 'full'}): loading MNIST ...")
    train, test = load_splits("mnist", train_size=train_size, test_size=test_size, seed=args.seed)
    x, y = train.tensors
    xt, yt = test.tensors
    log(f"  {x.shape[0]} training images, {xt.shape[0]} test images, {epochs} epochs, epsilon {list(epsilons)}")

    results = []
    for task in ("classification", "regression"):
        plans = [("none", None)] + [(m, e) for m in ("laplace", "rr") for e in epsilons]
        for mech, eps in plans:
            post = args.postprocess if (task == "classification" and mech == "laplace") else "argmax"
            cfg = LabelDPConfig(dataset="mnist", task=task, mechanism=mech, epsilon=eps, postprocess=post,
                                epochs=epochs, batch_size=100, lr=1e-3, seed=args.seed)
            r = run_one(cfg, x, y, xt, yt, device)
            results.append(r)
            log(f"  {task:14s} {r['mechanism']:7s} eps {_fmt(eps, '<8.4g'):8s} acc {r['acc_clean']:.4f}  "
                f"mse {_fmt(r['mse'])}  kept {r['label_keep_rate']:.4f} (analytic {r['analytic_keep_prob']:.4f})  "
                f"{r['train_seconds']:.1f} s")

    base = {t: next(r for r in results if r["task"] == t and r["mechanism"] == "none")
            for t in ("classification", "regression")}
    result = {
        "benchmark": "labeldp_mnist",
        "mode": "demo" if demo else "full",
        "train_images": int(x.shape[0]),
        "test_images": int(xt.shape[0]),
        "epochs": epochs,
        "batch_size": 100,
        "lr": 1e-3,
        "seed": args.seed,
        "postprocess": args.postprocess,
        "epsilons": list(epsilons),
        "baseline": {"acc_clean": base["classification"]["acc_clean"], "mse": base["regression"]["mse"]},
        "source_reported": SOURCE,
        "results": results,
        "environment": environment(device),
    }

    log("")
    log("task            mechanism  epsilon    acc_clean  mse       kept    analytic  label_eps")
    for r in results:
        log(f"{r['task']:15s} {r['mechanism']:10s} {_fmt(r['epsilon_config'], '<10.4g'):10s} {r['acc_clean']:.4f}     "
            f"{_fmt(r['mse']):9s} {r['label_keep_rate']:.4f}  {r['analytic_keep_prob']:.4f}    "
            f"{_fmt(r['label_epsilon'], '.4g')}")
    log(f"non-private baseline: accuracy {result['baseline']['acc_clean']:.4f} (source 0.9882), "
        f"MSE {result['baseline']['mse']:.4f} (source 0.2431)")
    if args.plot:
        from sweeps.report.labeldp import plot_labeldp

        rows = [{**r, "epsilon": r["epsilon_config"]} for r in results]
        plot_labeldp(rows, args.plot)
        log(f"wrote {args.plot}")
    write_run("labeldp_mnist", result, demo, args.out)
    return result


if __name__ == "__main__":
    main()
