"""CERTIFY's cost on CPU, side by side in one run: what FastMaxPool2d and the CPU batch size buy.

Randomized smoothing (Cohen et al. 2019, CERTIFY) classifies n0 + N noisy copies of every certified
image; with N = 100,000 the base classifier's noisy-image throughput decides the cost. Three
variants of Tramer & Boneh's MNIST CNN (``tb_cnn``, the same weights) certify the same images with
the same generator seed:

* ``maxpool2d_batch4096``: PyTorch's ``nn.MaxPool2d`` pools, 4,096 noisy images a pass (dpsweep before);
* ``fast_batch4096``: :class:`dpmech.networks.pooling.FastMaxPool2d`, 4,096 a pass;
* ``fast_batch256``: FastMaxPool2d, 256 a pass (``smoothing.default_batch_size`` on a CPU).

The first two draw the same noise (same seed and batch), so their counts must be equal: the check
``same_counts`` (FastMaxPool2d computes the same function). Each variant is timed ``--repeats``
times in turn (interleaved, so load drifts hit all alike) and its best is kept; ``speedup`` is
against the first.

    python benchmarks/smoothing_speed.py                  # 20 images, N 10,000, one thread
    python benchmarks/smoothing_speed.py --demo --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, log, write_run  # noqa: E402

NAME = "smoothing_speed"


def variants(seed: int = 0) -> dict[str, tuple[torch.nn.Module, int]]:
    from dpmech.dpsgd.trainer import build_dpsgd_model
    from dpmech.networks.pooling import FastMaxPool2d

    fast = build_dpsgd_model("mnist", seed, "tb_cnn").eval()
    plain = copy.deepcopy(fast)
    for i, layer in enumerate(plain.features):
        if isinstance(layer, FastMaxPool2d):
            plain.features[i] = torch.nn.MaxPool2d(layer.kernel_size, stride=layer.stride)
    return {"maxpool2d_batch4096": (plain, 4096), "fast_batch4096": (fast, 4096), "fast_batch256": (fast, 256)}


def run(images: int, n: int, repeats: int, threads: int) -> dict:
    from dpmech.robustness import smoothing

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(images, 1, 28, 28, generator=g) * 2 - 1
    vs = variants()
    best = {k: float("inf") for k in vs}
    counts = {}
    for rep in range(repeats):
        for name, (model, batch) in vs.items():
            t0 = time.perf_counter()
            res = smoothing.certify(model, 1.0, x, n0=100, n=n, alpha=0.001,
                                    generator=torch.Generator().manual_seed(7), batch_size=batch)
            best[name] = min(best[name], time.perf_counter() - t0)
            counts[name] = res.counts
        log(f"[{rep + 1}/{repeats}] " + ", ".join(f"{k} {images * (n + 100) / best[k]:,.0f} noisy img/s" for k in vs))
    base = best["maxpool2d_batch4096"]
    return {"benchmark": NAME, "model": "tb_cnn (mnist)", "images": images, "n": n, "n0": 100, "sigma_pm1": 1.0,
            "repeats": repeats, "threads": threads, "load_average_1min_at_end": os.getloadavg()[0],
            "variants": {k: {"seconds": best[k], "noisy_img_s": images * (n + 100) / best[k],
                             "certified_img_s": images / best[k], "speedup": base / best[k],
                             "hours_500_images_n100000": 500 * 100_100 / (images * (n + 100) / best[k]) / 3600}
                         for k in vs},
            "same_counts": bool((counts["maxpool2d_batch4096"] == counts["fast_batch4096"]).all()),
            **{k: v for k, v in environment(torch.device("cpu")).items() if k in ("device", "versions", "date")}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--demo", action="store_true", help="2 images, N 1,000, one repeat (seconds)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.demo:
        args.images, args.n, args.repeats = 2, 1000, 1
    out = run(args.images, args.n, args.repeats, args.threads)
    write_run(NAME, out, args.demo, args.out)
    return out


if __name__ == "__main__":
    main()
