"""Platform overhead: 8 PixelDP trials of fixed compute through Ray Tune + MLflow.

Prints and writes to benchmarks/results/sweep_overhead.json:

    overhead = sweep wall time / (sum of trial compute time / concurrency)

Trial compute time is what each trial reports as ``compute_seconds``: the time it spent
training and evaluating, measured inside the trial, so it runs under exactly the contention of
the sweep. The sweep wall time is the whole ``dpsweep run``: Ray start-up, the MLflow parent
run, worker start-up, scheduling, per-epoch checkpoints, metric and artifact logging. For
reference the benchmark also times the same work alone, without Ray or MLflow, one thread, one
trial at a time. Target: <= 1.15.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, write_result  # noqa: E402

TRIAL = {"dataset": "mnist", "train_size": 6000, "test_size": 500, "epochs": 4, "batch_size": 64,
         "certify_images": 300, "certify_n": 300, "attacks": {"pgd": [0.5]}, "attack_steps": 5}


def standalone_seconds(seed: int, threads: int) -> float:
    """One trial's work through dpmech alone (what a trial computes, without the platform)."""
    from dpmech.datasets.splits import load_splits
    from trainables.pixeldp import PixelDPTrialConfig
    from trainables.pixeldp import PixelDPMechanism
    from trainables.runtime import evaluate

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    cfg = PixelDPTrialConfig(**TRIAL, seed=seed)
    train, test = load_splits(cfg.dataset, train_size=cfg.train_size, test_size=cfg.test_size, seed=cfg.data_seed)
    mech = PixelDPMechanism(cfg, *train.tensors, torch.device("cpu"))
    xt, yt = test.tensors
    while mech.epoch < cfg.epochs:
        mech.train_epoch()
        mech.test_accuracy(xt, yt)
    evaluate(mech, cfg, xt, yt)
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--standalone-runs", type=int, default=1, help="trials timed without the platform")
    args = ap.parse_args(argv)
    from dpmech.datasets.splits import load_splits

    load_splits("mnist", train_size=10, test_size=10)  # data on disk before anything is timed
    threads_before = torch.get_num_threads()
    print(f"timing {args.standalone_runs} trial(s) without the platform (1 thread each) ...", flush=True)
    solo = [standalone_seconds(seed, 1) for seed in range(args.standalone_runs)]
    torch.set_num_threads(threads_before)
    per_trial = sum(solo) / len(solo)
    print(f"  {per_trial:.1f} s per trial", flush=True)

    from sweeps.cli import main as cli

    with tempfile.TemporaryDirectory() as tmp:
        spec = {"name": "overhead", "storage": f"{tmp}/ray", "mlflow": {"experiment": "overhead"},
                "common": TRIAL, "trainables": [{"name": "pixeldp", "search": {"seed": list(range(args.trials))}}],
                "resources": {"cpu": 1}, "max_concurrent_trials": args.concurrency}
        path = Path(tmp) / "spec.yaml"
        path.write_text(yaml.safe_dump(spec))
        uri = f"sqlite:///{tmp}/mlflow.db"
        t0 = time.perf_counter()
        rc = cli(["run", str(path), "--tracking-uri", uri])
        wall = time.perf_counter() - t0
        if rc != 0:
            raise SystemExit(f"the sweep failed (exit {rc})")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("overhead")
        compute = [r.data.metrics["compute_seconds"] for r in client.search_runs([exp.experiment_id])
                   if "compute_seconds" in r.data.metrics]
    if len(compute) != args.trials:
        raise SystemExit(f"expected {args.trials} trials with compute_seconds, found {len(compute)}")
    ideal = sum(compute) / args.concurrency
    ratio = wall / ideal
    result = {"benchmark": "sweep_overhead", "trials": args.trials, "concurrency": args.concurrency,
              "trial_config": TRIAL, "trial_compute_seconds": compute,
              "standalone_seconds_per_trial": per_trial, "sweep_wall_seconds": wall, "ideal_seconds": ideal,
              "overhead_ratio": ratio, "overhead_ratio_vs_standalone": wall / (args.trials * per_trial / args.concurrency),
              "target": "<= 1.15", "environment": environment(torch.device("cpu"))}
    print(f"sweep wall {wall:.1f} s vs sum of trial compute {sum(compute):.1f} s / {args.concurrency} = {ideal:.1f} s: "
          f"overhead {ratio:.3f}x (vs the work timed alone: {result['overhead_ratio_vs_standalone']:.3f}x)",
          flush=True)
    print(f"wrote {write_result('sweep_overhead', result)}")
    return result


if __name__ == "__main__":
    main()
