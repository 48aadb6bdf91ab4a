"""Scaling over nodes: the same sweep on one worker node and on two, on a local multi-node Ray
cluster (docs/cluster.md), logging over HTTP to an ``mlflow server`` on 127.0.0.1.

The cluster is the one the cluster tests use: a head with no CPUs and worker nodes with
``--node-cpus`` CPUs each (1 on a 2-core machine: two nodes then use both cores). The sweep is
``--trials`` PixelDP trials (different seeds, the same size) run by ``dpsweep run`` in this
process, once with one worker node and once after a second has joined. Prints and writes to
benchmarks/results/cluster_scaling.json:

    speed-up                 = wall(1 node) / wall(2 nodes)
    per-trial overhead       = (wall x slots - sum of the trials' compute_seconds) / trials

where ``slots`` is the number of trials that can run at once and ``compute_seconds`` is what each
trial measured inside itself (training and evaluation, without logging, checkpointing, start-up
and scheduling). The wall time is the whole ``dpsweep run`` with Ray and the server already up.
``--demo`` runs 6 tiny trials (under 2 minutes on a quiet 2-core machine).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, log, write_result  # noqa: E402

TRIAL = {"dataset": "mnist", "train_size": 2000, "test_size": 200, "epochs": 3, "batch_size": 64,
         "certify_images": 50, "certify_n": 100, "attacks": {"pgd": [0.5]}, "attack_steps": 3,
         "certify_sizes": [0.1]}
DEMO = {**TRIAL, "train_size": 300, "test_size": 50, "epochs": 2, "certify_images": 8, "certify_n": 20,
        "attack_steps": 2}


def run_sweep(uri: str, root: Path, name: str, trial: dict, trials: int, slots: int) -> dict:
    """One ``dpsweep run`` in this process; its wall time and the trials' own compute time."""
    from mlflow.tracking import MlflowClient

    from sweeps.cli import main
    from tests.cluster_helpers import write_spec

    spec = write_spec(root / f"{name}.yaml", name, root / "ray_results", trial, {"seed": list(range(trials))},
                      max_concurrent_trials=slots, failure={"max_retries": 0})
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["run", str(spec), "--tracking-uri", uri])
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"sweep {name} failed (exit {rc}):\n{out.getvalue()[-3000:]}")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=1000) if "mlflow.parentRunId" in r.data.tags]
    compute = [r.data.metrics["compute_seconds"] for r in runs]
    if len(compute) != trials:
        raise RuntimeError(f"sweep {name}: {len(compute)} child runs with compute_seconds, expected {trials}")
    return {"wall_seconds": wall, "trials": trials, "slots": slots, "compute_seconds_sum": sum(compute),
            "compute_seconds_mean": sum(compute) / trials,
            "overhead_per_trial_seconds": (wall * slots - sum(compute)) / trials}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--node-cpus", type=int, default=1, help="CPUs of each worker node")
    ap.add_argument("--demo", action="store_true", help="6 tiny trials (< 2 min)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    trial, trials = (DEMO, 6) if args.demo else (TRIAL, args.trials)
    torch.set_num_threads(1)
    os.environ["DPSWEEP_SHARED_STORAGE"] = "1"  # every node of this cluster is on this machine
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray

    from dpmech.datasets.splits import ensure_available
    from tests.cluster_helpers import MlflowServer, start_cluster

    ensure_available("mnist")
    with tempfile.TemporaryDirectory(prefix="cluster_scaling_") as tmp:
        root = Path(tmp)
        server = MlflowServer(root / "mlflow")
        server.launch()
        cluster = None
        try:
            cluster, _ = start_cluster(worker_cpus=args.node_cpus)
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            server.wait()
            log(f"cluster up: head (0 CPUs) + 1 worker node ({args.node_cpus} CPU); MLflow {server.uri}")
            one = run_sweep(server.uri, root, "scaling-1node", trial, trials, slots=args.node_cpus)
            log(f"1 node : {one['wall_seconds']:.1f} s wall, {one['compute_seconds_mean']:.1f} s compute per trial, "
                f"overhead {one['overhead_per_trial_seconds']:.2f} s per trial")
            cluster.add_node(num_cpus=args.node_cpus, resources={"worker": args.node_cpus})
            cluster.wait_for_nodes()
            two = run_sweep(server.uri, root, "scaling-2nodes", trial, trials, slots=2 * args.node_cpus)
            log(f"2 nodes: {two['wall_seconds']:.1f} s wall, {two['compute_seconds_mean']:.1f} s compute per trial, "
                f"overhead {two['overhead_per_trial_seconds']:.2f} s per trial")
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
            server.stop()
    speedup = one["wall_seconds"] / two["wall_seconds"]
    log(f"speed-up 2 nodes / 1 node: {speedup:.2f}x (ideal 2.00x)")
    payload = {
        "benchmark": "cluster_scaling", "demo": args.demo, "trial": trial, "trials": trials,
        "node_cpus": args.node_cpus, "one_node": one, "two_nodes": two, "speedup": speedup,
        "cores": os.cpu_count(), **environment(torch.device("cpu")),
    }
    if not args.demo or args.out:
        path = write_result("cluster_scaling", payload, args.out)
        log(f"written to {path}")
    return payload


if __name__ == "__main__":
    main()
