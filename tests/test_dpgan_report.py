"""The report's sample grids (sweeps/report/samples.py): every generative trial's logged
``samples/samples.png`` becomes a figure of the report; other trainables and trials without the
artifact add none."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pandas as pd

from sweeps.report.samples import sample_grid_figures


class FakeClient:
    def __init__(self, root: Path, runs_with_grid):
        self.root, self.runs = root, set(runs_with_grid)

    def list_artifacts(self, run_id, path):
        return [SimpleNamespace(path="samples/samples.png")] if run_id in self.runs and path == "samples" else []

    def download_artifacts(self, run_id, path, dst):
        target = Path(dst) / run_id / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"\x89PNG" + run_id.encode())
        return str(target)


def test_generative_trials_get_their_sample_grid_in_the_report(tmp_path):
    trials = pd.DataFrame([
        {"run_id": "a", "run": "dpgan_eps10", "trainable": "dpgan", "epsilon": 9.8, "tstr_acc": 0.71},
        {"run_id": "b", "run": "merf np", "trainable": "dp_merf", "epsilon": float("inf"), "tstr_acc": 0.85},
        {"run_id": "c", "run": "sgd", "trainable": "dpsgd", "epsilon": 1.0, "tstr_acc": float("nan")},
        {"run_id": "d", "run": "no_grid", "trainable": "dpgan", "epsilon": 1.0, "tstr_acc": 0.5},
    ])
    out = tmp_path / "out"
    out.mkdir()
    sweep = SimpleNamespace(trials=trials, client=FakeClient(tmp_path, {"a", "b", "c"}))
    figs = sample_grid_figures(sweep, out)
    assert [f[1] for f in figs] == ["samples_dpgan_eps10.png", "samples_merf_np.png"]
    assert "epsilon 9.8" in figs[0][0] and "tstr_acc 0.710" in figs[0][0]
    assert "non-private" in figs[1][0]
    assert (out / "samples_dpgan_eps10.png").read_bytes() == b"\x89PNGa"
    assert not (out / "samples_no_grid.png").exists()
    shutil.rmtree(out)
