"""What a study reads and runs (issue 34, points 10, 11, 12): ``--dry-run`` puts the swept keys
first and hides unchanged defaults (``--all`` shows everything); ``trials_aggregated.csv`` spells
booleans like ``trials.csv``; counts read as a person writes them; the README's own-Tuner recipe
starts a Ray of its own; with Optuna the ``_mlflow`` mapping stays out of Ray's trial directory
names; dpmech used directly drops dp-accounting's convergence warnings as the CLI does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


# ------------------------------------------------------------------ point 10: what a study reads


def test_counts_and_ranges_read_as_a_person_writes_them():
    from sweeps.words import all_of, best_of, counted, span

    assert [counted(n, "trial") for n in (0, 1, 2)] == ["0 trials", "1 trial", "2 trials"]
    assert [all_of(n, "trial") for n in (1, 2, 12)] == ["the one trial", "both trials", "all 12 trials"]
    assert [best_of(n, "trial") for n in (1, 3)] == ["the only trial", "the best of 3 trials"]
    assert span(8.0, 8.0) == "8" and span(1.0, 8.0) == "1 to 8" and span(2.00001, 2.00002) == "2"


def _dry_run(capsys, *extra) -> list[str]:
    from sweeps.cli import main

    assert main(["run", str(ROOT / "sweeps/quickstart.yaml"), "--dry-run",
                 "--set", "trainables.0.search.epochs=3", *extra]) == 0
    out = capsys.readouterr().out.splitlines()
    i = next(j for j, ln in enumerate(out) if ln.startswith("trainable "))
    return out[i - 1: i + 2]


def test_dry_run_shows_the_swept_keys_first_and_hides_unchanged_defaults(capsys):
    groups, header, _ = _dry_run(capsys)
    cols = header.split()
    assert cols[:3] == ["trainable", "epsilon", "attack_bound"]          # the swept keys, in spec order
    assert "epochs" in cols and "train_size" in cols                      # set away from their defaults
    for default in ("seed", "data_seed", "attack_norm", "certify_eta", "noise_source"):
        assert default not in cols
    assert groups.startswith("swept: epsilon, attack_bound; set: ") and "not shown (--all shows them)" in groups
    groups, header, _ = _dry_run(capsys, "--all")
    cols = header.split()
    assert cols[:3] == ["trainable", "epsilon", "attack_bound"]
    assert {"seed", "data_seed", "attack_norm", "certify_eta", "noise_source"} <= set(cols)
    assert "(shown last)" in groups


def test_dry_run_shows_a_swept_mapping_compactly(tmp_path, capsys):
    from sweeps.cli import main

    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\ncommon: {train_size: 500, test_size: 100}\n"
                    "trainables:\n- name: dpsgd\n  search: {epsilon: 2.0, attacks: {grid: [{pgd: [0.1]}, {fgsm: [0.1, 0.2]}]}}\n")
    assert main(["run", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "swept: attacks; set: " in out and '{"fgsm":[0.1,0.2]}' in out
    header = next(ln for ln in out.splitlines() if ln.startswith("trainable "))
    assert header.split()[1] == "attacks"


def test_a_multi_trainable_dry_run_does_not_call_the_trainables_own_defaults_swept():
    """Issue 51.5: keys that are constant within each trainable and only differ between trainables' defaults
    (DP-SGD's lr 0.1 against PixelDP's, their attack lists) are not "swept"; what varies within a trainable is,
    whatever the other trainables hold; the control: a key varied within one trainable is swept."""
    from sweeps.cli import dry_run_listing

    trials = [{"trainable": "dpsgd", "epsilon": e, "lr": 0.5, "attacks": {}, "seed": 0} for e in (1.0, 3.0, None)]
    trials += [{"trainable": "pixeldp", "attack_bound": b, "lr": 0.05, "attacks": {"pgd": [0.1]}, "seed": 0}
               for b in (0.1, 0.3)]
    groups = dry_run_listing(trials).splitlines()[0]
    swept = groups.split(";")[0]
    assert swept == "swept: epsilon, attack_bound"            # not lr, not attacks (they only tell trainables apart)
    trials[0]["lr"] = 0.25                                     # control: lr now varies within dpsgd
    assert dry_run_listing(trials).splitlines()[0].split(";")[0] == "swept: epsilon, lr, attack_bound"


@pytest.fixture(scope="module")
def one_trial_sweep(tmp_path_factory):
    """An MLflow store with a finished one-trial DP-SGD sweep (epsilon 8), selected on acc_clean."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from sweeps.spec import spec_to_flat_params, validate_spec
    from trainables.tracking import TAG_PARENT, TAG_TRAINABLE

    raw = {"name": "one", "common": {"train_size": 500, "test_size": 50},
           "trainables": [{"name": "dpsgd", "search": {"epsilon": 8.0}}],
           "search": {"metric": "acc_clean", "mode": "max"}}
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("one")
    parent = client.create_run(exp, tags={"dpsweep.kind": "sweep"}, run_name="sweep")
    client.log_batch(parent.info.run_id,
                     params=[Param(k, v) for k, v in spec_to_flat_params(validate_spec(raw)).items()])
    run = client.create_run(exp, run_name="dpsgd-8", tags={TAG_PARENT: parent.info.run_id, TAG_TRAINABLE: "dpsgd"})
    client.log_batch(run.info.run_id,
                     params=[Param("epsilon", "8.0"), Param("seed", "0"), Param("diagnostics", "True"),
                             Param("attack_labels", "true"), Param("trainable", "dpsgd")],
                     metrics=[Metric("epsilon", 7.9999, 0, 0), Metric("acc_clean", 0.91, 0, 0)])
    client.set_terminated(run.info.run_id, "FINISHED")
    client.set_terminated(parent.info.run_id, "FINISHED")
    return uri


def test_a_one_trial_report_reads_as_written_and_its_csvs_spell_booleans_alike(one_trial_sweep, tmp_path):
    import csv

    from sweeps.report import make_report

    out = tmp_path / "report"
    text = make_report("one", one_trial_sweep, out).read_text()
    assert "Per-trial epsilon: 8 (it holds for that trial only)." in text
    assert "8 to 8" not in text
    assert "1 trials" not in text and "best of 1 " not in text
    assert "the only trial" in text
    for name in ("trials.csv", "trials_aggregated.csv"):
        rows = list(csv.DictReader((out / name).open()))
        values = {v for r in rows for v in r.values()}
        assert "true" in values, name
        assert not values & {"True", "False"}, name
