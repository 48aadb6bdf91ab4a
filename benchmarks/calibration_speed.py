"""Noise and tuning calibration, side by side in one run: dp-accounting's order-by-order RDP against
the vectorised one (:mod:`dpmech.privacy.sampled_gaussian_rdp`) that now drives the searches.

* ``noise``: the noise multiplier of DP-SGD (q 256/60,000, 60 epochs, delta 1e-5) at epsilons
  0.5, 1, 3 and 8, the bisection of :func:`dpmech.privacy.accounting.noise_multiplier_for` run with
  dp-accounting's curve at every step (``exact``) and with the vectorised curve plus the final
  dp-accounting check (``fast``, what dpsweep does). ``same_sigmas``: both searches returned the same
  sigma to the last bit.
* ``tuning``: the per-trial epsilon of ``sweeps/dpsgd_mnist_scatternet_tuned_eps3.yaml`` (9 privacy
  configurations, K ~ Logarithmic(mean 20), end to end epsilon 3), once with dp-accounting's curves
  everywhere, once as dpsweep does (vectorised search, exact check). ``same_trial_epsilon`` compares
  the two to 1e-12.

Each variant runs ``--repeats`` times in turn and keeps its best time; ``speedup`` is exact / fast.

    python benchmarks/calibration_speed.py                  # about 4 minutes on one core
    python benchmarks/calibration_speed.py --demo --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, log, write_run  # noqa: E402

NAME = "calibration_speed"
ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def exact_curves():
    """dp-accounting everywhere: the noise search and the tuning's curves without the vectorised RDP."""
    from dpmech.privacy import accounting

    fast_curve, fast_rdp = accounting._fast_curve, accounting._fast_rdp_epsilon  # noqa: SLF001
    accounting._fast_curve = lambda event: None  # noqa: SLF001
    accounting._fast_rdp_epsilon = lambda q, steps, delta, before: accounting._search_epsilon(  # noqa: SLF001
        q, steps, delta, before, "rdp")
    try:
        yield
    finally:
        accounting._fast_curve, accounting._fast_rdp_epsilon = fast_curve, fast_rdp  # noqa: SLF001


def _noise(epsilons, steps):
    from dpmech.privacy import accounting

    return [accounting._calibrate(e, 1e-5, 256 / 60000, steps, "rdp", 1e-4, None)  # noqa: SLF001
            for e in epsilons]


def _tuning(spec_path: Path) -> float:
    import tempfile

    from dpmech.privacy import accounting
    from sweeps.spec import load_spec, tuning

    from dpmech.dpsgd.trainer import calibrated_noise_multiplier

    for memo in (tuning._CALIBRATED, accounting._SIGMA_MEMO, accounting._EPSILON_MEMO):  # noqa: SLF001
        memo.clear()                      # a new process: nothing calibrated in memory
    calibrated_noise_multiplier.cache_clear()
    with tempfile.TemporaryDirectory() as cache:
        old = os.environ.get("DPSWEEP_CACHE")
        os.environ["DPSWEEP_CACHE"] = cache
        try:
            with contextlib.redirect_stderr(open(os.devnull, "w")):
                spec = load_spec(spec_path)
        finally:
            if old is None:
                os.environ.pop("DPSWEEP_CACHE")
            else:
                os.environ["DPSWEEP_CACHE"] = old
    return spec.trainables[0].search["epsilon"]


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def run(epsilons: list[float], epochs: int, repeats: int, tuning_spec: Path | None) -> dict:
    steps = int(epochs * 60000 / 256)
    parts = {"noise": (_noise, (epsilons, steps))}
    if tuning_spec is not None:
        parts["tuning"] = (_tuning, (tuning_spec,))
    best = {(p, v): float("inf") for p in parts for v in ("exact", "fast")}
    answers = {}
    for rep in range(repeats):
        for part, (fn, args) in parts.items():
            for variant in ("exact", "fast"):
                ctx = exact_curves() if variant == "exact" else contextlib.nullcontext()
                with ctx:
                    seconds, answers[part, variant] = _timed(fn, *args)
                best[part, variant] = min(best[part, variant], seconds)
                log(f"[{rep + 1}/{repeats}] {part} {variant}: {seconds:.2f}s")
    out = {"benchmark": NAME, "repeats": repeats, "threads": torch.get_num_threads(),
           "load_average_1min_at_end": os.getloadavg()[0],
           "noise": {"epsilons": epsilons, "delta": 1e-5, "sampling_rate": 256 / 60000, "steps": steps,
                     "sigmas": answers["noise", "fast"],
                     "exact_seconds": best["noise", "exact"], "fast_seconds": best["noise", "fast"],
                     "speedup": best["noise", "exact"] / best["noise", "fast"],
                     "same_sigmas": answers["noise", "exact"] == answers["noise", "fast"]}}
    if tuning_spec is not None:
        a, b = answers["tuning", "exact"], answers["tuning", "fast"]
        out["tuning"] = {"spec": str(tuning_spec.relative_to(ROOT)) if tuning_spec.is_relative_to(ROOT) else str(tuning_spec),
                         "trial_epsilon": b, "exact_seconds": best["tuning", "exact"],
                         "fast_seconds": best["tuning", "fast"],
                         "speedup": best["tuning", "exact"] / best["tuning", "fast"],
                         "same_trial_epsilon": abs(a - b) <= 1e-12 * a}
    return {**out, **{k: v for k, v in environment(torch.device("cpu")).items() if k in ("device", "versions", "date")}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--demo", action="store_true", help="two epsilons, 5 epochs, no tuning spec (seconds)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.demo:
        out = run([1.0, 3.0], 5, 1, None)
    else:
        out = run([0.5, 1.0, 3.0, 8.0], args.epochs, args.repeats,
                  ROOT / "sweeps" / "dpsgd_mnist_scatternet_tuned_eps3.yaml")
    write_run(NAME, out, args.demo, args.out)
    return out


if __name__ == "__main__":
    main()
