"""Sweep scale: N tiny DP-SGD trials through the whole platform (Ray Tune + MLflow + report).

A study of hundreds of small trials is a normal study. For each N (default 60, 240, 960) this runs
``dpsweep run`` as a user would (a subprocess, default concurrency: one trial per CPU core) on N
DP-SGD trials of seconds of compute each (500 MNIST images, one epoch, seeds 0..N-1), then
``dpsweep report`` on the result, and records in ``benchmarks/results/sweep_scale.json``:

``n_<N>.wall_s``
    the whole ``dpsweep run`` (Ray start, the parent run, every trial, the summary);
``n_<N>.compute_s``
    the trials' own compute (``compute_seconds``: training and evaluation measured inside each
    trial, so under the sweep's contention) summed and divided by the concurrency: the wall time a
    platform with no cost at all would need;
``n_<N>.overhead_per_trial_s``
    ``(wall_s - compute_s) / N``: what the platform adds per trial (scheduling, checkpoints, MLflow
    runs, metrics and artifacts, the summary), in wall-clock seconds;
``n_<N>.report_s``
    ``dpsweep report`` on the finished sweep (tables, plots);
``n_<N>.closing_s``, ``n_<N>.closing_per_trial_ms``
    from the last trial's run closing to the command's exit: the summary, the best configuration and
    its comparisons, the parent run, the table (issue 49.8: 150 s for 200 trials on a loaded machine);
``n_<N>.driver_rss_mb``
    the peak resident memory of the ``dpsweep run`` process (sampled from /proc every 0.2 s);
``n_<N>.mlflow_store_mb``
    the SQLite store plus the artifact directory after the sweep.

Targets (issue 24): overhead per trial <= 0.5 s at N = 960 on 2 cores and not growing with N;
``dpsweep report`` on 960 trials under 30 s. Run on a quiet machine: the figures are wall-clock.
``--demo`` (N = 10 and 30) writes under the ``demo`` key of the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, log, write_run  # noqa: E402

TRIAL = {"dataset": "mnist", "train_size": 500, "test_size": 200, "epochs": 1, "batch_size": 100,
         "epsilon": 8.0, "model": "tb_cnn"}
TARGETS = {"overhead_per_trial_s": "<= 0.5 at N = 960, not growing with N", "report_s": "< 30 at N = 960",
           "closing_s": "<= 10 at N = 960, the time per trial flat in N (issue 49.8)"}


def _dpsweep() -> str:
    here = Path(sys.executable).parent / "dpsweep"
    return str(here) if here.exists() else "dpsweep"


def _peak_rss_mb(proc: subprocess.Popen, out: list[float], stop: threading.Event) -> None:
    """Sample the process's VmRSS until it exits (or ``stop``); the peak goes in ``out[0]``."""
    status = Path(f"/proc/{proc.pid}/status")
    while not stop.is_set() and proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[0] = max(out[0], int(line.split()[1]) / 1024)
        except OSError:
            break
        time.sleep(0.2)


def _tree_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += (Path(root) / f).stat().st_size
            except OSError:
                pass
    return total / 2**20


def run_one(n: int, workdir: Path, concurrency: int | None) -> dict:
    """One sweep of ``n`` trials in ``workdir`` (its own MLflow store and Ray storage)."""
    name = f"scale{n}"
    spec = {"name": name, "storage": str(workdir / "ray"), "mlflow": {"experiment": name},
            "common": TRIAL, "trainables": [{"name": "dpsgd", "search": {"seed": list(range(n))}}],
            "search": {"algorithm": "grid", "metric": "acc_clean", "mode": "max"},
            "resources": {"cpu": 1, "gpu": 0}}
    if concurrency:
        spec["max_concurrent_trials"] = concurrency
    path = workdir / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    uri = f"sqlite:///{workdir}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    log(f"N = {n}: dpsweep run ...")
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(workdir / "run.log", "w") as out:
        proc = subprocess.Popen([_dpsweep(), "run", str(path), "--tracking-uri", uri], cwd=workdir, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
        peak, stop = [0.0], threading.Event()
        sampler = threading.Thread(target=_peak_rss_mb, args=(proc, peak, stop), daemon=True)
        sampler.start()
        rc = proc.wait()
        ended = time.time()
        stop.set()
        sampler.join()
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = (workdir / "run.log").read_text().splitlines()[-20:]
        raise SystemExit(f"N = {n}: the sweep failed (exit {rc}):\n" + "\n".join(tail))

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`dpsweep.trial_id` != ''",
                              max_results=50000)
    compute = [r.data.metrics["compute_seconds"] for r in runs if "compute_seconds" in r.data.metrics]
    child_s = [(r.info.end_time - r.info.start_time) / 1000 for r in runs if r.info.end_time]
    # the sweep's closing: from the last trial's run closing to the command's exit (the summary, the
    # best configuration and its comparison, the parent run, the table; issue 49.8)
    closing = ended - max(r.info.end_time for r in runs if r.info.end_time) / 1000
    if len(compute) != n:
        raise SystemExit(f"N = {n}: expected {n} trials with compute_seconds, found {len(compute)}")
    used = concurrency or os.cpu_count() or 1
    compute_s = sum(compute) / used

    log(f"N = {n}: dpsweep report ...")
    t0 = time.perf_counter()
    rep = subprocess.run([_dpsweep(), "report", name, "--tracking-uri", uri, "--out", str(workdir / "report")],
                         cwd=workdir, env=env, capture_output=True, text=True)
    report_s = time.perf_counter() - t0
    if rep.returncode != 0:
        raise SystemExit(f"N = {n}: dpsweep report failed (exit {rep.returncode}): {rep.stderr[-2000:]}")
    store = _tree_mb(workdir / "mlruns") + (workdir / "mlflow.db").stat().st_size / 2**20
    row = {"trials": n, "concurrency": used, "wall_s": round(wall, 2), "compute_s": round(compute_s, 2),
           "compute_sum_s": round(sum(compute), 2), "child_run_sum_s": round(sum(child_s), 2),
           "overhead_per_trial_s": round((wall - compute_s) / n, 3), "report_s": round(report_s, 2),
           "closing_s": round(closing, 2), "closing_per_trial_ms": round(1000 * closing / n, 2),
           "driver_rss_mb": round(peak[0], 1), "mlflow_store_mb": round(store, 1),
           # the 1-minute load average before and after: above the core count, something else ran too
           "load_avg_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    log(f"N = {n}: wall {wall:.1f} s, compute {compute_s:.1f} s ({sum(compute):.1f} s over {used} slots), "
        f"overhead {row['overhead_per_trial_s']:.3f} s/trial, report {report_s:.1f} s, driver {peak[0]:.0f} MB, "
        f"store {store:.1f} MB")
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="60,240,960", help="comma-separated N (default 60,240,960)")
    ap.add_argument("--concurrency", type=int, default=None, help="max_concurrent_trials (default: Ray's, one per core)")
    ap.add_argument("--demo", action="store_true", help="N = 10 and 30 only (a few minutes)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sweep_scale.json)")
    ap.add_argument("--keep", default=None, help="keep each sweep's directory under this path")
    args = ap.parse_args(argv)
    sizes = [10, 30] if args.demo else [int(s) for s in args.sizes.split(",") if s.strip()]

    from dpmech.datasets.splits import ensure_available

    ensure_available("mnist")  # data on disk before anything is timed
    result = {"benchmark": "sweep_scale", "trial_config": TRIAL, "targets": TARGETS,
              "definition": "overhead_per_trial_s = (wall_s - compute_s) / N, compute_s = sum of the trials' "
                            "compute_seconds / concurrency"}
    import torch

    result["environment"] = environment(torch.device("cpu"))
    for n in sizes:
        if args.keep:
            workdir = Path(args.keep) / f"n_{n}"
            workdir.mkdir(parents=True, exist_ok=True)
            result[f"n_{n}"] = run_one(n, workdir, args.concurrency)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                result[f"n_{n}"] = run_one(n, Path(tmp), args.concurrency)
    rows = [result[f"n_{n}"] for n in sizes]
    if len(rows) > 1:
        result["overhead_growth"] = round(rows[-1]["overhead_per_trial_s"] - rows[0]["overhead_per_trial_s"], 3)
    out = Path(args.out) if args.out else None
    write_run("sweep_scale", result, args.demo, out)
    log(json.dumps({f"n_{r['trials']}": {k: r[k] for k in ('overhead_per_trial_s', 'report_s', 'driver_rss_mb')}
                    for r in rows}))
    return result


if __name__ == "__main__":
    main()
