"""The cost of per-step reseeding (issue 48 §3): DP-SGD's sampling and noise generators reseeded at
every step from HMAC(key, stream, step) (:class:`dpmech.privacy.secret.StepStream`), against the
behaviour before (one running generator per stream), side by side in one run.

* ``reseed_us``: the time of one ``StepStream.at(t)`` at a new step (HMAC-SHA256 and ``manual_seed``
  of a CPU generator), the median over ``--calls`` calls; a DP-SGD step makes two (sampling, noise).
* ``dpsgd``: ``--steps`` DP-SGD steps (book-keeping clipping) of Tramer & Boneh's ``tb_cnn`` on
  random MNIST-shaped inputs, batch ``--batch-size`` (after an untimed warm-up run), one thread, with a
  secret key: ``per_step``
  (the code) and ``running`` (the same key, the streams left running: the code before issue 48,
  simulated by switching the reseeding off). The two run in turn, ``--rounds`` times, the order
  alternating; ``ratio`` is the median over rounds of per_step / running seconds per step.

    python benchmarks/step_stream_cost.py                  # about 1 minute on one core
    python benchmarks/step_stream_cost.py --demo --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, log, write_run  # noqa: E402

NAME = "step_stream_cost"


def reseed_us(calls: int) -> float:
    """Median microseconds of ``StepStream.at(t)`` at a new step t (CPU generator)."""
    from dpmech.privacy.secret import NoiseKey

    stream = NoiseKey.fresh().step_stream("dpsgd.noise", 0)
    times = []
    for t in range(calls):
        t0 = time.perf_counter()
        stream.at(t)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def _trainer(key, n: int, batch_size: int):
    from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer, build_dpsgd_model

    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, 28, 28, generator=g) * 2 - 1
    y = torch.randint(0, 10, (n,), generator=g)
    cfg = DPSGDConfig(epsilon=None, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=batch_size, epochs=1,
                      lr=0.1, clipping="bk", seed=0)
    return DPSGDTrainer(build_dpsgd_model("mnist", 0, "tb_cnn"), x, y, cfg, noise_key=key)


def seconds_per_step(mode: str, key, steps: int, batch_size: int) -> float:
    """Seconds per DP-SGD step (after 3 untimed steps) with the streams reseeded per step or running."""
    from dpmech.privacy.secret import StepStream

    keyed = StepStream.keyed
    if mode == "running":
        StepStream.keyed = property(lambda self: False)
    try:
        tr = _trainer(key, n=batch_size * 100, batch_size=batch_size)
        for _ in range(3):
            tr.train_step()
        t0 = time.perf_counter()
        for _ in range(steps):
            tr.train_step()
        return (time.perf_counter() - t0) / steps
    finally:
        StepStream.keyed = keyed


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", action="store_true", help="a quick version (20 steps, 2 rounds)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.demo:
        a.steps, a.rounds, a.calls = 20, 2, 2000
    from dpmech.privacy.secret import NoiseKey

    torch.set_num_threads(1)
    key = NoiseKey.fresh()
    us = reseed_us(a.calls)
    log(f"StepStream.at(t): {us:.1f} us (median of {a.calls})")
    seconds_per_step("per_step", key, 10, a.batch_size)   # warm-up: the book-keeping routes, the allocator
    rows = {"per_step": [], "running": []}
    for r in range(a.rounds):
        for mode in (("per_step", "running") if r % 2 == 0 else ("running", "per_step")):
            rows[mode].append(seconds_per_step(mode, key, a.steps, a.batch_size))
            log(f"round {r + 1}/{a.rounds} {mode}: {1e3 * rows[mode][-1]:.2f} ms/step")
    ratios = [s / o for s, o in zip(rows["per_step"], rows["running"])]
    per_step, running = statistics.median(rows["per_step"]), statistics.median(rows["running"])
    out = {"benchmark": NAME, **environment(torch.device("cpu")),
           "config": {"model": "tb_cnn", "clipping": "bk", "batch_size": a.batch_size, "steps": a.steps,
                      "rounds": a.rounds, "threads": 1},
           "reseed_us": us, "reseeds_per_step": 2,
           "dpsgd": {"per_step_ms": 1e3 * per_step, "running_ms": 1e3 * running,
                     "per_step_ms_rounds": [1e3 * s for s in rows["per_step"]],
                     "running_ms_rounds": [1e3 * s for s in rows["running"]],
                     "ratio": statistics.median(ratios), "ratios": ratios,
                     "reseed_share": 2 * us * 1e-6 / per_step}}
    log(f"DP-SGD tb_cnn batch {a.batch_size}: per-step reseeding {1e3 * per_step:.2f} ms/step, running streams "
        f"{1e3 * running:.2f} ms/step, ratio {out['dpsgd']['ratio']:.4f}; two reseeds are "
        f"{100 * out['dpsgd']['reseed_share']:.4f}% of a step")
    write_run(NAME, out, a.demo, a.out)
    return out


if __name__ == "__main__":
    main()
