"""What a study reads and runs (issue 34, points 10, 11, 12): ``--dry-run`` puts the swept keys
first and hides unchanged defaults (``--all`` shows everything); ``trials_aggregated.csv`` spells
booleans like ``trials.csv``; counts read as a person writes them; the README's own-Tuner recipe
starts a Ray of its own; with Optuna the ``_mlflow`` mapping stays out of Ray's trial directory
names; dpmech used directly drops dp-accounting's convergence warnings as the CLI does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ point 12: dpmech alone

_LEDGER = ("from dpmech import PrivacyLedger\n"
           "ledger = PrivacyLedger()\n"
           "ledger.record(0.1, 1.0, 50)\n"
           "print('epsilon', ledger.epsilon(1e-5))\n"
           "import logging; logging.getLogger('absl').warning('another absl warning')\n")


def _stderr(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "epsilon" in proc.stdout
    return proc.stderr


def test_dpmech_used_directly_drops_the_convergence_warnings():
    # negative control: the same ledger with the filter taken off again warns for several orders
    loud = _stderr("import logging\nimport dpmech.privacy.accounting\n"
                   "logging.getLogger('absl').filters.clear()\n" + _LEDGER)
    assert loud.count("_compute_log_a_frac failed to converge") >= 3
    quiet = _stderr(_LEDGER)
    assert "failed to converge" not in quiet
    assert "another absl warning" in quiet          # only that message is dropped
    assert "import ray" not in _LEDGER and "trainables" not in _LEDGER


# ------------------------------------------------------------------ point 11: the recipe and Optuna


class _Fit(Exception):
    """Raised instead of running the recipe's trials."""


def test_the_readme_tuner_recipe_starts_a_local_ray_of_its_own_before_the_tuner(monkeypatch):
    import ray
    from ray import tune

    import sweeps.tracking
    from tests.test_readme_doc import section_blocks

    calls: list = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append(("init", a, k)))
    monkeypatch.setattr(sweeps.tracking, "start_parent_run",
                        lambda *a, **k: {"tracking_uri": "sqlite:////nowhere/mlflow.db", "experiment_id": "1",
                                         "parent_run_id": "p"})

    def fit(self):
        calls.append(("fit",))
        raise _Fit

    monkeypatch.setattr(tune.Tuner, "fit", fit)
    (code,) = section_blocks("Using a trainable in your own Tuner")
    try:
        exec(compile(code, "README.md", "exec"), {"__name__": "recipe"})
    except _Fit:
        pass
    assert [c[0] for c in calls] == ["init", "fit"], calls
    _, args, kwargs = calls[0]
    assert kwargs.get("address", args[0] if args else None) == "local"   # never a bare ray.init()
    block = code[:code.index("ray.init(address=")]
    assert "joins any Ray already" in block      # and says why


def _first_trial_dirname(creator, space, searcher) -> str:
    from ray.tune.experiment import Experiment
    from ray.tune.search import SearchGenerator

    def study(config):
        pass

    searcher.set_search_properties("acc_clean", "max", space)
    gen = SearchGenerator(searcher)
    gen.add_configurations([Experiment("e", run=study, config=space, storage_path="/tmp/dpsweep-unused",
                                       trial_dirname_creator=creator)])
    return gen.next_trial()._generate_dirname()


def test_optuna_trial_directories_are_named_after_the_drawn_values_not_mlflow(tmp_path):
    from ray import tune

    from sweeps.runner import build_tuner
    from sweeps.spec import load_spec, ray_param_space
    from trainables.search import FinalMetricOptunaSearch

    spec = load_spec(ROOT / "sweeps/quickstart.yaml", ["search.algorithm=optuna", "search.metric=acc_clean",
                                                       "search.mode=max", "search.num_samples=2"])
    info = {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment_id": "7", "parent_run_id": "f00d" * 8}
    tuner = build_tuner(spec, storage=str(tmp_path / "ray_results"), run_name="q", mlflow_info=info,
                        param_space=ray_param_space(spec), total=2)
    creator = tuner._local_tuner._tune_config.trial_dirname_creator
    assert creator is not None
    space = {"epsilon": tune.loguniform(0.5, 8.0), "attack_bound": 0.1, "_mlflow": info}
    # negative control: Ray's own name starts with the _mlflow mapping
    assert "parent_run_id" in _first_trial_dirname(None, dict(space), FinalMetricOptunaSearch(seed=0))
    name = _first_trial_dirname(creator, dict(space), FinalMetricOptunaSearch(seed=0))
    assert "parent_run_id" not in name and "tracking_uri" not in name and "f00d" not in name
    assert "epsilon=" in name and "attack_bound" not in name      # the drawn value, not the constant
    assert len(name) <= 130 and "/" not in name
