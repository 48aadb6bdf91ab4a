"""The report's sample grids: every trial of a generative mechanism (``dpgan``, ``dp_merf``) logs
``samples/samples.png`` (10 generated images per class, one row per class, no training image); the
report copies each into its folder as ``samples_<run>.png`` with a figure per trial (docs/dpgan.md,
docs/dp_merf.md)."""

from __future__ import annotations

import math
import re
import shutil
import tempfile
from pathlib import Path

GENERATIVE = ("dpgan", "dp_merf")
ARTIFACT = "samples/samples.png"


def _eps(value) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "non-private"
    return "non-private" if math.isnan(v) or math.isinf(v) else f"epsilon {v:.3g}"


def sample_grid_figures(sweep, out: Path) -> list[tuple[str, str, str]]:
    """(title, file, caption) for every finished generative trial whose sample grid was logged."""
    from trainables.tracking import retry

    trials = sweep.trials
    if trials.empty or "trainable" not in trials:
        return []
    figs = []
    with tempfile.TemporaryDirectory() as tmp:
        for _, row in trials[trials["trainable"].isin(GENERATIVE)].iterrows():
            run_id = row["run_id"]
            listed = {a.path for a in retry(lambda: sweep.client.list_artifacts(run_id, "samples"),
                                            what="list_artifacts")}
            if ARTIFACT not in listed:
                continue
            local = retry(lambda: sweep.client.download_artifacts(run_id, ARTIFACT, tmp), what="download_artifacts")
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(row.get("run") or run_id))
            fname = f"samples_{name}.png"
            shutil.copyfile(local, out / fname)
            eps = _eps(row.get("epsilon", row.get("param.epsilon")))
            tstr = row.get("tstr_acc")
            acc = "" if tstr is None or (isinstance(tstr, float) and math.isnan(tstr)) else f", tstr_acc {float(tstr):.3f}"
            figs.append((f"Generated samples: {row['trainable']} {name} ({eps}{acc})", fname,
                         "One row per class, 10 samples each (generated; no training image is logged)."))
    return figs
