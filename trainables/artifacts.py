"""Artifacts of a finished trial: weights, the per-example certification table, a plot.

* ``model/weights.pt``: the model's ``state_dict`` (load with ``torch.load(weights_only=True)``);
* ``certification/certification.parquet``: one row per certified test example (index, label,
  prediction, lower/upper bounds, certified size), written with pyarrow;
* ``certification/cert_acc.png``: certified accuracy against attack size;
* with ``certifier: smoothing`` or ``both``: ``certification/smoothing.parquet`` (index, label,
  prediction (-1 = abstain), abstained, count_a, p_a_lower, radius, smoothed_prediction; see
  docs/smoothing.md) and ``certification/smooth_cert_acc.png`` (certified accuracy against l2 radius);
* whatever the mechanism adds with ``mech.extra_artifacts(directory) -> [(path, artifact_dir)]``
  (e.g. DPGAN's grid of generated digits); it must never write a raw training example.

No raw training example is ever logged.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch


def certification_table(result):
    """The per-example certification results as a pyarrow Table."""
    import pyarrow as pa

    cols = result.as_columns()
    table = pa.table({k: pa.array(np.asarray(val)) for k, val in cols.items()})
    keys = ("noise_scale", "sensitivity", "norm", "n", "eta", "bounds", "psi", "mu_a", "sigma", "n0", "alpha")
    meta = {k: str(getattr(result, k)) for k in keys if hasattr(result, k)}
    return table.replace_schema_metadata({f"dpsweep.{k}": v for k, v in meta.items()})


def plot_certified_accuracy(result, path: Path, title: str = "") -> None:
    """Certified accuracy against attack size, from 0 to the largest certified size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result.certified_size
    top = float(max(sizes.max(initial=0.0), 0.05)) * 1.05
    grid = np.linspace(0, top, 200)
    ok = result.correct & (sizes > 0)
    acc = [(ok & (sizes >= t)).mean() for t in grid]
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    ax.plot(grid, acc, lw=2)
    ax.set_xlabel("attack size ([-1, 1] input domain)")
    ax.set_ylabel("certified accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def log_final_artifacts(tracker, mech, final: dict, cfg) -> None:
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        weights = tmp / "weights.pt"
        torch.save({k: v.detach().cpu() for k, v in mech.model.state_dict().items()}, weights)
        tracker.log_artifact(str(weights), "model")
        result = final.get("certification")
        if result is not None:
            pq.write_table(certification_table(result), tmp / "certification.parquet")
            tracker.log_artifact(str(tmp / "certification.parquet"), "certification")
            eps = final["metrics"].get("epsilon")
            title = f"{tracker.run_id[:8]}  epsilon={eps:.3g}" if eps is not None else ""
            plot_certified_accuracy(result, tmp / "cert_acc.png", title)
            tracker.log_artifact(str(tmp / "cert_acc.png"), "certification")
        smooth = final.get("smoothing")
        if smooth is not None:
            pq.write_table(certification_table(smooth), tmp / "smoothing.parquet")
            tracker.log_artifact(str(tmp / "smoothing.parquet"), "certification")
            title = f"{tracker.run_id[:8]}  randomized smoothing, sigma={smooth.sigma:.3g}"
            plot_certified_accuracy(smooth, tmp / "smooth_cert_acc.png", title)
            tracker.log_artifact(str(tmp / "smooth_cert_acc.png"), "certification")
        if hasattr(mech, "extra_artifacts"):
            extra = tmp / "extra"
            extra.mkdir()
            for path, artifact_dir in mech.extra_artifacts(extra):
                tracker.log_artifact(str(path), artifact_dir)
