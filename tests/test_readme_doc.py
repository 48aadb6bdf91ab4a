"""README.md's python blocks run as written (issue 24, point 3), as a user runs them from the
repository root: in a fresh working directory, with nothing set up beforehand.

The Tuner recipe opens its parent run at ``sqlite:///mlflow.db`` (relative: it must name the
database in the user's directory, not one per trial directory), names a final metric in
``tune.TuneConfig`` (Ray's strict per-result check would stop it at the first epoch) and reads
the best result; its two trials must land as FINISHED child runs in that one database.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def section_blocks(heading: str) -> list[str]:
    """The ```python blocks under the README's ``## heading`` (up to the next ``## ``)."""
    text = README.read_text()
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], flags=re.S)


def test_every_python_block_of_the_readme_is_executed_here():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(section_blocks("Using a trainable in your own Tuner")) == 1
    assert len(section_blocks("Using dpmech in a notebook")) == 1
    assert len(blocks) == 2, "a new README python block needs a test here"


def _user_env(home: Path, ray_tmp: Path) -> dict:
    from dpmech.datasets.splits import data_root

    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "RAY_ADDRESS",
                        "TUNE_DISABLE_STRICT_METRIC_CHECKING", "PYTHONPATH")}
    env.update(HOME=str(home), DPSWEEP_DATA=str(data_root()), RAY_TMPDIR=str(ray_tmp), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    return env


@pytest.mark.slow
def test_tuner_recipe_runs_as_written(tmp_path):
    from mlflow.tracking import MlflowClient

    from trainables.tracking import TAG_PARENT

    (code,) = section_blocks("Using a trainable in your own Tuner")
    work, home = tmp_path / "study", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "recipe.py").write_text(code)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths must stay short
    try:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "recipe.py"], cwd=work, env=_user_env(home, ray_tmp),
                              capture_output=True, text=True, timeout=600)
        elapsed = time.perf_counter() - start
        assert proc.returncode == 0, proc.stderr[-4000:]
        # no trial made its own store, nothing was retried
        stray = [p for p in [*tmp_path.rglob("mlflow.db"), *ray_tmp.rglob("mlflow.db")] if p != work / "mlflow.db"]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert stray == []
    assert "No Experiment with id" not in proc.stderr and "retrying" not in proc.stderr
    assert (work / "mlflow.db").exists()

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("my-pixeldp-study")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("dpsweep.kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get(TAG_PARENT) == parent.info.run_id]
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials_failed"] == 0
    assert sorted(r.data.params["epsilon"] for r in children) == ["0.5", "1.0"]
    assert all(r.info.status == "FINISHED" for r in children)
    assert [m.step for m in client.get_metric_history(children[0].info.run_id, "train_loss")] == [1, 2]

    # the best result is the child with the highest final acc_clean, as printed
    best = max(children, key=lambda r: r.data.metrics["acc_clean"])
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("best: "))
    assert line.startswith(f"best: epsilon {float(best.data.params['epsilon'])}, "
                           f"acc_clean {best.data.metrics['acc_clean']:.3f}")
    assert best.data.metrics["acc_clean"] > 0.5  # the small study learns (chance is 0.1)
    print(f"README Tuner recipe: {elapsed:.0f}s")


@pytest.mark.slow
@pytest.mark.parametrize("heading", ["Using dpmech in a notebook"])
def test_notebook_block_runs_as_written(heading, tmp_path):
    (code,) = section_blocks(heading)
    (tmp_path / "home").mkdir()
    (tmp_path / "block.py").write_text(code)
    proc = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, env=_user_env(tmp_path / "home", tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("train_loss") == 2  # two epochs printed, then the certificate
    assert "0.1" in proc.stdout.splitlines()[-1]
