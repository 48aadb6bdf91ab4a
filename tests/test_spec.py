"""Sweep specs: the shipped specs, expansion, overrides and at least 20 invalid specs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from sweeps.spec import SpecError, apply_overrides, expand_trials, load_spec, spec_to_flat_params, validate_spec

ROOT = Path(__file__).resolve().parent.parent
BASE = {
    "name": "t",
    "common": {"train_size": 100, "test_size": 50},
    "trainables": [{"name": "pixeldp", "search": {"epsilon": [0.5, 1.0], "attack_bound": [0.1, 0.3, 1.0]}}],
}


def _with(path: str, value):
    raw = copy.deepcopy(BASE)
    return apply_overrides(raw, [f"{path}={yaml.safe_dump(value, default_flow_style=True).strip()}"]) \
        if not isinstance(value, _Delete) else _delete(raw, path)


class _Delete:
    pass


def _delete(raw, path):
    node = raw
    parts = path.split(".")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    del node[parts[-1]]
    return raw


@pytest.mark.parametrize("name,count", [("quickstart.yaml", 4), ("pixeldp_mnist_certified.yaml", 4)])
def test_shipped_specs_validate(name, count):
    spec = load_spec(ROOT / "sweeps" / name)
    trials = expand_trials(spec)
    assert len(trials) == count
    for t in trials:
        assert t["trainable"] == "pixeldp"
        assert "certify_n" in t and "lr" in t  # defaults resolved


def test_certified_spec_sweeps_the_papers_bounds():
    trials = expand_trials(load_spec(ROOT / "sweeps" / "pixeldp_mnist_certified.yaml"))
    assert sorted(t["attack_bound"] for t in trials) == [0.03, 0.1, 0.3, 1.0]


def test_grid_expansion_is_a_product_times_samples_in_order():
    spec = validate_spec({**BASE, "search": {"num_samples": 2}})
    trials = expand_trials(spec)
    assert len(trials) == 2 * 3 * 2
    assert [(t["epsilon"], t["attack_bound"]) for t in trials[:3]] == [(0.5, 0.1), (0.5, 0.3), (0.5, 1.0)]


def test_random_sampling_is_deterministic_and_in_bounds():
    raw = copy.deepcopy(BASE)
    raw["trainables"][0]["search"] = {"lr": {"loguniform": [1e-4, 1e-2]}, "weight_decay": {"uniform": [0.0, 0.1]},
                                      "optimizer": {"choice": ["adam", "sgd"]}}
    raw["search"] = {"algorithm": "random", "num_samples": 50, "seed": 3}
    a = expand_trials(validate_spec(raw))
    b = expand_trials(validate_spec(raw))
    assert a == b and len(a) == 50
    assert all(1e-4 <= t["lr"] <= 1e-2 and 0 <= t["weight_decay"] <= 0.1 for t in a)
    assert {t["optimizer"] for t in a} == {"adam", "sgd"}
    raw["search"]["seed"] = 4
    assert expand_trials(validate_spec(raw)) != a


def test_list_typed_keys_take_lists_as_values_and_grid_sweeps_them():
    raw = copy.deepcopy(BASE)
    raw["trainables"][0]["search"] = {"certify_sizes": [0.1, 0.2], "attacks": {"grid": [{"pgd": [0.1]}, {"fgsm": [0.2]}]}}
    trials = expand_trials(validate_spec(raw))
    assert len(trials) == 2 and trials[0]["certify_sizes"] == [0.1, 0.2]
    assert trials[1]["attacks"] == {"fgsm": [0.2]}


def test_overrides():
    spec = load_spec(ROOT / "sweeps" / "quickstart.yaml",
                     ["trainables.0.search.epsilon=[0.25, 2.0, 4.0]", "common.train_size=500", "name=other"])
    assert spec.name == "other"
    trials = expand_trials(spec)
    assert len(trials) == 6 and {t["train_size"] for t in trials} == {500}


@pytest.mark.parametrize("bad", ["novalue", "=3", "a..b=1", "trainables.5.name=x", "name.sub=1", "common=[1"])
def test_malformed_overrides(bad):
    with pytest.raises(SpecError, match="--set"):
        load_spec(ROOT / "sweeps" / "quickstart.yaml", [bad])


def test_flat_params():
    flat = spec_to_flat_params(validate_spec(BASE))
    assert flat["trainables.0.name"] == "pixeldp" and flat["common.train_size"] == "100"


BAD = [
    ("nme", "x", "nme: unknown key (did you mean 'name'?)"),
    ("trainables.0.search.epsilonn", [1.0], "trainables[0].search.epsilonn: unknown key (did you mean 'epsilon'?)"),
    ("trainables.0.name", "pixldp", "trainables[0].name: unknown trainable 'pixldp' (did you mean 'pixeldp'?)"),
    ("trainables.0.search.epsilon", "abc", "trainables[0].search.epsilon: must be a finite number"),
    ("trainables.0.search.epsilon", [0.5, 1.0, -1.0], "trainables[0].search.epsilon[2]: must be > 0"),
    ("trainables.0.search.epsilon", 0, "trainables[0].search.epsilon: must be > 0"),
    ("trainables.0.search.epsilon", True, "trainables[0].search.epsilon: must be a finite number"),
    ("trainables.0.search.delta", 0.0, "trainables[0].search.delta: must be > 0"),
    ("trainables.0.search.delta", {"grid": [0.1, 1.5]}, "trainables[0].search.delta.grid[1]: must be < 1"),
    ("common.attacks", {"deepfool": [0.1]}, "common.attacks: unknown attack 'deepfool'"),
    ("common.dataset", "svhn", "common.dataset: must be one of"),
    ("common.trainsize", 10, "common.trainsize: unknown key for trainable 'pixeldp' (did you mean 'train_size'?)"),
    ("trainables.0.search.epsilon", [], "trainables[0].search.epsilon: must not be empty"),
    ("trainables.0.search.epsilon", {"choice": []}, "trainables[0].search.epsilon: must not be empty"),
    ("trainables.0.search.lr", {"uniform": [0.1, 0.01]}, "trainables[0].search.lr: uniform needs search.algorithm"),
    ("trainables.0.search.norm", {"choice": ["l2", "l3"]}, "trainables[0].search.norm.choice[1]: must be one of"),
    ("resources.cpu", -1, "resources.cpu: must be > 0"),
    ("resources.gpu", -0.5, "resources.gpu: must be >= 0"),
    ("max_concurrent_trials", 0, "max_concurrent_trials: must be >= 1"),
    ("failure.max_retries", -1, "failure.max_retries: must be >= 0"),
    ("search.algorithm", "bayes", "search.algorithm: must be one of"),
    ("search.num_samples", 0, "search.num_samples: must be >= 1"),
    ("scheduler.tipe", "asha", "scheduler.tipe: unknown key (did you mean 'type'?)"),
    ("scheduler.type", "asha", "scheduler.metric: required for asha"),
    ("name", "has space", "name: must match"),
    ("trainables", [], "trainables: must not be empty"),
    ("common.epochs", 2.5, "common.epochs: must be an integer"),
    ("trainables.0.search.certify_eta", 1.0, "trainables[0].search.certify_eta: must be < 1"),
    ("common.certify_sizes", [0.1, -0.2], "common.certify_sizes: certify sizes must be finite and >= 0"),
]


@pytest.mark.parametrize("path,value,message", BAD, ids=[b[0] + "=" + str(b[1])[:20] for b in BAD])
def test_invalid_specs(path, value, message):
    raw = _with(path, value)
    with pytest.raises(SpecError) as info:
        validate_spec(raw)
    text = str(info.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_random_distribution_rules():
    raw = copy.deepcopy(BASE)
    raw["search"] = {"algorithm": "random"}
    raw["trainables"][0]["search"] = {"lr": {"loguniform": [0.0, 0.1]}}
    with pytest.raises(SpecError, match=r"trainables\[0\].search.lr.loguniform: low must be > 0"):
        validate_spec(raw)
    raw["trainables"][0]["search"] = {"norm": {"uniform": [0.0, 0.1]}}
    with pytest.raises(SpecError, match="needs a numeric key"):
        validate_spec(raw)


def test_optuna_rules():
    raw = copy.deepcopy(BASE)
    raw["search"] = {"algorithm": "optuna", "num_samples": 4}
    with pytest.raises(SpecError, match="search.metric: optuna needs"):
        validate_spec(raw)
    raw["search"]["objectives"] = [{"metric": "cert_acc_0.1", "mode": "max"}, {"metric": "epsilon", "mode": "min"}]
    validate_spec(raw)
    raw["trainables"].append({"name": "pixeldp"})
    with pytest.raises(SpecError, match="search.algorithm: optuna needs exactly one trainable"):
        validate_spec(raw)


def test_file_errors(tmp_path):
    with pytest.raises(SpecError, match="file not found"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrainables: [\n  {name: pixeldp\n")
    with pytest.raises(SpecError, match="line"):
        load_spec(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="mapping"):
        load_spec(lst)


def test_cli_exit_code_2_before_anything_runs(tmp_path, monkeypatch, capsys):
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(_with("trainables.0.search.epsilon", [0.5, -1.0])))
    assert main(["run", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "trainables[0].search.epsilon[1]: must be > 0" in err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ray_results").exists()
    assert main(["run", str(ROOT / "sweeps" / "quickstart.yaml"), "--set", "oops"]) == 2
    assert main(["validate", str(ROOT / "sweeps" / "quickstart.yaml")]) == 0
    assert main(["run", str(ROOT / "sweeps" / "quickstart.yaml"), "--dry-run"]) == 0
    assert "0.3" in capsys.readouterr().out
    assert not (tmp_path / "mlflow.db").exists()
