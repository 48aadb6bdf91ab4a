"""Sweep specs (sweeps/spec/sweep_spec.py, sweeps/spec/space.py): the shipped specs, expansion, overrides,
the Ray param space, MLflow params, and invalid specs with the exact field path of the error."""

from __future__ import annotations

import copy
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import Field, model_validator

from sweeps.spec import (
    MAX_TRIALS,
    SpecError,
    apply_overrides,
    expand_trials,
    load_spec,
    ray_param_space,
    spec_to_flat_params,
    validate_spec,
)
from trainables.pixeldp import PixelDPTrialConfig
from trainables.registry import REGISTRY, TrainableEntry

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "sweeps" / "quickstart.yaml"
CERTIFIED = ROOT / "sweeps" / "pixeldp_mnist_certified.yaml"
PIXELDP_KEYS = set(PixelDPTrialConfig.model_fields)

BASE = {
    "name": "t",
    "common": {"train_size": 100, "test_size": 50},
    "trainables": [{"name": "pixeldp", "search": {"epsilon": [0.5, 1.0], "attack_bound": [0.1, 0.3, 1.0]}}],
}
DELETE = object()


def _spec(changes: dict | None = None, base: dict = BASE) -> dict:
    """A copy of ``base`` with ``{"dotted.path": value}`` set (DELETE removes the key)."""
    raw = copy.deepcopy(base)
    for path, value in (changes or {}).items():
        node = raw
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        last = int(parts[-1]) if isinstance(node, list) else parts[-1]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list) and last == len(node):
            node.append(value)
        else:
            node[last] = value
    return raw


def _search(**search) -> dict:
    return _spec({"trainables.0.search": search})


def _error(raw) -> str:
    with pytest.raises(SpecError) as info:
        validate_spec(raw)
    text = str(info.value)
    assert "\n" not in text
    return text


# --------------------------------------------------------------------------- shipped specs


def test_quickstart_validates_and_expands_with_defaults_resolved():
    spec = load_spec(QUICKSTART)
    trials = expand_trials(spec)
    assert len(trials) == 4 == spec.num_trials
    assert [(t["epsilon"], t["attack_bound"]) for t in trials] == [(0.5, 0.1), (0.5, 0.3), (1.0, 0.1), (1.0, 0.3)]
    for t in trials:
        assert set(t) == PIXELDP_KEYS | {"trainable"}  # every default explicit
        assert t["trainable"] == "pixeldp"
        assert t["lr"] == 1e-3 and t["delta"] == 0.05 and t["attack_norm"] == "l2"
        PixelDPTrialConfig(**{k: v for k, v in t.items() if k != "trainable"})
    assert spec.resources.cpu == 1 and spec.max_concurrent_trials == 2 and spec.failure.max_retries == 1
    assert spec.mlflow.experiment == "dpsweep-quickstart"
    assert spec.raw["name"] == "quickstart"


def test_certified_spec_sweeps_the_papers_bounds():
    spec = load_spec(CERTIFIED)
    trials = expand_trials(spec)
    # the paper's L in {0.03, 0.1, 0.3, 1.0} on inputs spanning 1; ours span 2 (docs/pixeldp.md)
    assert [t["attack_bound"] for t in trials] == [0.06, 0.2, 0.6, 2.0]
    for t in trials:
        assert (t["epsilon"], t["delta"], t["norm"], t["train_size"]) == (1.0, 0.05, "l2", None)
        # the reference's one-sided 95% bounds and its delta' grid
        assert t["certify_eta"] == 0.90 and t["certify_calibration"] == "classic"
        assert t["certify_n"] == t["certify_images"] == t["test_size"] == 1000 and t["epochs"] == 10
        assert t["certify_sizes"][:3] == [0.0, 0.05, 0.1] and max(t["certify_sizes"]) >= 1.0


# --------------------------------------------------------------------------- expansion


def test_grid_is_a_product_times_num_samples_in_row_major_order():
    trials = expand_trials(validate_spec(_spec({"search": {"num_samples": 2}})))
    assert len(trials) == 2 * 3 * 2
    pairs = [(t["epsilon"], t["attack_bound"]) for t in trials]
    assert pairs[:6] == [(0.5, 0.1), (0.5, 0.3), (0.5, 1.0), (1.0, 0.1), (1.0, 0.3), (1.0, 1.0)]
    assert pairs[6:] == pairs[:6]
    # the order of the keys as written decides the order of the grid
    trials = expand_trials(validate_spec(_search(attack_bound=[0.1, 0.3], epsilon=[0.5, 1.0])))
    assert [(t["attack_bound"], t["epsilon"]) for t in trials] == [(0.1, 0.5), (0.1, 1.0), (0.3, 0.5), (0.3, 1.0)]


def test_explicit_grid_fixed_values_and_common_precedence():
    raw = _spec({"common.seed": 7, "common.epochs": 3})
    raw["trainables"][0]["search"] = {"seed": {"grid": [0, 1]}, "epochs": 2, "lr": 0.01}
    trials = expand_trials(validate_spec(raw))
    assert [t["seed"] for t in trials] == [0, 1]  # search overrides common
    assert all(t["epochs"] == 2 and t["lr"] == 0.01 and t["train_size"] == 100 for t in trials)


def test_random_sampling_is_deterministic_and_in_bounds():
    raw = _search(lr={"loguniform": [1e-4, 1e-2]}, weight_decay={"uniform": [0.0, 0.1]},
                  optimizer={"choice": ["adam", "sgd"]}, epochs={"uniform": [1, 3]})
    raw["search"] = {"algorithm": "random", "num_samples": 200, "seed": 3}
    a = expand_trials(validate_spec(raw))
    assert a == expand_trials(validate_spec(raw)) and len(a) == 200
    assert all(1e-4 <= t["lr"] <= 1e-2 and 0 <= t["weight_decay"] <= 0.1 for t in a)
    assert {t["optimizer"] for t in a} == {"adam", "sgd"}
    assert {t["epochs"] for t in a} == {1, 2, 3}  # an integer key draws integers, bounds inclusive
    assert all(isinstance(t["epochs"], int) and isinstance(t["lr"], float) for t in a)
    # log-uniform: about half the draws below the geometric mean of the bounds
    below = sum(t["lr"] < 1e-3 for t in a) / len(a)
    assert 0.38 < below < 0.62
    raw["search"]["seed"] = 4
    assert expand_trials(validate_spec(raw)) != a


def test_loguniform_stays_in_range_at_narrow_and_integer_bounds():
    raw = _search(lr={"loguniform": [0.001, 0.0010001]}, batch_size={"loguniform": [16, 17]})
    raw["search"] = {"algorithm": "random", "num_samples": 300}
    trials = expand_trials(validate_spec(raw))
    assert all(0.001 <= t["lr"] <= 0.0010001 for t in trials)
    assert {t["batch_size"] for t in trials} == {16, 17}


def test_grid_times_samples_with_draws_per_trial():
    raw = _search(epsilon=[0.5, 1.0], seed={"choice": list(range(1000))})
    raw["search"] = {"algorithm": "grid", "num_samples": 3}  # choice is allowed in a grid
    trials = expand_trials(validate_spec(raw))
    assert [t["epsilon"] for t in trials] == [0.5, 1.0] * 3
    assert len({t["seed"] for t in trials}) > 1  # each repeat draws anew


def test_list_typed_keys_take_lists_as_values_and_grid_sweeps_them():
    raw = _search(certify_sizes=[0.1, 0.2], attacks={"grid": [{"pgd": [0.1]}, {"fgsm": [0.2, 0.4]}]})
    trials = expand_trials(validate_spec(raw))
    assert len(trials) == 2
    assert all(t["certify_sizes"] == [0.1, 0.2] for t in trials)
    assert [t["attacks"] for t in trials] == [{"pgd": [0.1]}, {"fgsm": [0.2, 0.4]}]
    raw = _search(certify_sizes={"grid": [[0.1], [0.2, 0.3]]})
    assert [t["certify_sizes"] for t in expand_trials(validate_spec(raw))] == [[0.1], [0.2, 0.3]]


def test_expanded_trials_are_fresh_copies():
    spec = validate_spec(_search(attacks={"pgd": [0.1]}))
    first = expand_trials(spec)
    first[0]["attacks"]["pgd"].append(9.0)
    first[0]["epsilon"] = 99.0
    assert expand_trials(spec)[0]["attacks"] == {"pgd": [0.1]}
    assert expand_trials(spec)[0]["epsilon"] == 1.0


def test_empty_sections_take_defaults_and_experiment_defaults_to_name():
    spec = validate_spec({"name": "x", "common": None, "mlflow": None, "search": None,
                          "trainables": [{"name": "pixeldp", "search": None}]})
    assert spec.mlflow.experiment == "x" and spec.storage == "./ray_results"
    assert spec.search.algorithm == "grid" and spec.resources.gpu == "auto" and spec.failure.max_retries == 0
    (trial,) = expand_trials(spec)
    assert trial == {"trainable": "pixeldp", **PixelDPTrialConfig().model_dump()}


# --------------------------------------------------------------------------- other trainables and model-level rules


class ToyConfig(PixelDPTrialConfig):
    """A second schema: one extra key and a rule between two keys."""

    knob: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _laplace_has_no_delta(self):
        if self.norm == "l1" and self.delta != 0.05:
            raise ValueError("l1 (Laplace) noise has no delta; leave delta at its default")
        return self


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(REGISTRY, "toy", TrainableEntry("toy", "tests.test_spec:nothing", ToyConfig, "toy"))


def test_several_trainables_expand_in_spec_order(toy):
    raw = _spec({"trainables": [{"name": "pixeldp", "search": {"epsilon": [0.5, 1.0]}},
                                {"name": "toy", "search": {"knob": [1, 2, 3]}}]})
    trials = expand_trials(validate_spec(raw))
    assert [t["trainable"] for t in trials] == ["pixeldp"] * 2 + ["toy"] * 3
    assert "knob" not in trials[0] and [t["knob"] for t in trials[2:]] == [1, 2, 3]
    assert all(t["train_size"] == 100 for t in trials)
    raw["common"]["knob"] = 1
    assert _error(raw).startswith("common.knob: not a parameter of trainable 'pixeldp'")


def test_every_combination_is_validated(toy):
    raw = _spec({"trainables": [{"name": "toy", "search": {"norm": ["l2", "l1"], "delta": [0.05, 0.1]}}]})
    assert _error(raw) == ("trainables[0].search: l1 (Laplace) noise has no delta; leave delta at its default "
                           "(trial 3: norm='l1', delta=0.1)")
    raw["trainables"][0]["search"]["delta"] = [0.05]
    assert len(expand_trials(validate_spec(raw))) == 2


def test_optuna_probes_validate_the_combinations(toy):
    raw = _spec({"common": {"norm": "l1"}, "search": {"algorithm": "optuna", "metric": "acc_clean", "mode": "max"},
                 "trainables": [{"name": "toy", "search": {"delta": {"choice": [0.05, 0.2]}, "lr": {"uniform": [0.001, 0.01]}}}]})
    assert _error(raw).startswith("trainables[0].search: l1 (Laplace) noise has no delta")


# --------------------------------------------------------------------------- optuna, asha, metrics, Ray space


def _optuna(**search) -> dict:
    raw = _search(**search)
    raw["search"] = {"algorithm": "optuna", "num_samples": 8, "metric": "cert_acc_0.1", "mode": "max"}
    return raw


def test_optuna_param_space():
    from ray import tune
    from ray.tune.search.sample import Categorical, Float, Integer

    raw = _optuna(epsilon=[0.5, 1.0], lr={"loguniform": [1e-4, 1e-2]}, weight_decay={"uniform": [0.0, 1e-4]},
                  optimizer={"choice": ["adam", "sgd"]}, batch_size={"uniform": [32, 256]}, epochs=2,
                  certify_sizes=[0.1, 0.2])
    spec = validate_spec(raw)
    assert spec.num_trials == 8
    space = ray_param_space(spec)
    assert space["trainable"] == "pixeldp" and space["train_size"] == 100 and space["epochs"] == 2
    assert space["certify_sizes"] == [0.1, 0.2]
    assert isinstance(space["epsilon"], Categorical) and space["epsilon"].categories == [0.5, 1.0]
    assert isinstance(space["optimizer"], Categorical)
    assert isinstance(space["lr"], Float) and (space["lr"].lower, space["lr"].upper) == (1e-4, 1e-2)
    assert "LogUniform" in type(space["lr"].get_sampler()).__name__
    assert isinstance(space["weight_decay"], Float) and type(space["weight_decay"].get_sampler()).__name__.endswith("_Uniform")
    assert isinstance(space["batch_size"], Integer) and (space["batch_size"].lower, space["batch_size"].upper) == (32, 257)
    with pytest.raises(SpecError, match="search.algorithm: optuna"):
        expand_trials(spec)
    if importlib.util.find_spec("optuna"):  # Ray converts the space to Optuna distributions
        from ray.tune.search.optuna import OptunaSearch

        dists = OptunaSearch.convert_search_space(space)
        assert set(dists) == {"epsilon", "lr", "weight_decay", "optimizer", "batch_size"}
        assert (dists["batch_size"].low, dists["batch_size"].high) == (32, 256) and dists["lr"].log
    grid = ray_param_space(validate_spec(BASE))
    assert set(grid) == {"trial"} and grid["trial"] == tune.grid_search(expand_trials(validate_spec(BASE)))


def test_optuna_multi_objective():
    raw = _optuna(epsilon={"uniform": [0.5, 2.0]})
    raw["search"] = {"algorithm": "optuna", "num_samples": 4,
                     "objectives": [{"metric": "cert_acc_0.1", "mode": "max"},
                                    {"metric": "robustness_epsilon", "mode": "min"}]}
    spec = validate_spec(raw)
    assert [(o.metric, o.mode) for o in spec.search.objectives] == [("cert_acc_0.1", "max"), ("robustness_epsilon", "min")]
    raw["search"]["objectives"][1]["metric"] = "cert_acc_0.1"
    assert _error(raw) == "search.objectives[1].metric: duplicate 'cert_acc_0.1'"
    raw["search"]["objectives"][1] = {"metric": "robustness_epsilon", "mode": "down"}
    assert _error(raw).startswith("search.objectives[1].mode: must be one of 'min', 'max'; got 'down'")


def test_asha_mode_defaults_to_the_metrics_direction():
    spec = validate_spec(_spec({"scheduler": {"type": "asha", "metric": "train_loss"}}))
    assert spec.scheduler.mode == "min" and spec.scheduler.grace_period == 1
    spec = validate_spec(_spec({"scheduler": {"type": "asha", "metric": "test_acc", "grace_period": 2}}))
    assert spec.scheduler.mode == "max" and spec.scheduler.reduction_factor == 2


def test_metric_names_are_checked_against_what_the_trials_report():
    ok = ["acc_clean", "robustness_epsilon", "robustness_epsilon_config", "noise_scale", "acc_pgd_0.5", "acc_pgd_1", "cert_acc_0.2", "acc_clean_expected"]
    for metric in ok:
        validate_spec(_spec({"common.attacks": {"pgd": [0.5, 1.0]}, "common.certify_sizes": [0.1, 0.2],
                             "search": {"metric": metric, "mode": "max"}}))
    raw = _spec({"common.certify_sizes": [0.1, 0.2], "search": {"metric": "cert_acc_0.15", "mode": "max"}})
    assert _error(raw).startswith("search.metric: 'cert_acc_0.15' is not reported by every trial of 'pixeldp'")
    # PixelDP's epsilon is a robustness parameter: no epsilon/delta metric (issue 13 point 2)
    raw = _spec({"search": {"metric": "epsilon", "mode": "min"}})
    assert _error(raw).startswith("search.metric: 'epsilon' is not reported by every trial of 'pixeldp'")
    raw = _spec({"common.certify_images": 0, "search": {"metric": "cert_acc_0.1", "mode": "max"}})
    assert "certify_images > 0" in _error(raw)
    raw = _optuna(certify_images={"choice": [40, 0]})
    assert _error(raw).startswith("search.metric: 'cert_acc_0.1' is not reported")


def test_validation_does_not_import_ray():
    code = ("import sys; from sweeps.spec import load_spec, expand_trials, spec_to_flat_params; "
            "s = load_spec('sweeps/quickstart.yaml'); expand_trials(s); spec_to_flat_params(s); "
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --------------------------------------------------------------------------- overrides and params


def test_overrides():
    spec = load_spec(QUICKSTART, ["trainables.0.search.epsilon=[0.25, 2.0, 4.0]", "common.train_size=500",
                                  "name=other", "trainables[0].search.seed={grid: [0, 1]}",
                                  "scheduler.type=asha", "scheduler.metric=test_acc", "search.metric=acc_clean"])
    assert spec.name == "other" and spec.mlflow.experiment == "dpsweep-quickstart"
    assert spec.scheduler.type == "asha" and spec.scheduler.mode == "max"
    trials = expand_trials(spec)
    assert len(trials) == 3 * 2 * 2 and {t["train_size"] for t in trials} == {500}
    assert sorted({t["epsilon"] for t in trials}) == [0.25, 2.0, 4.0] and {t["seed"] for t in trials} == {0, 1}
    assert spec.raw["common"]["train_size"] == 500  # the raw spec holds the overrides
    raw = copy.deepcopy(BASE)
    out = apply_overrides(raw, ["common.attacks={pgd: [0.1, 0.2]}", "trainables.0.name=x", "description=", "max_concurrent_trials=null"])
    assert raw == BASE  # the input is not changed
    assert out["common"]["attacks"] == {"pgd": [0.1, 0.2]} and out["trainables"][0]["name"] == "x"
    assert out["description"] is None and out["max_concurrent_trials"] is None
    with pytest.raises(SpecError, match=r"^search.algorithm: must be one of"):
        load_spec(QUICKSTART, ["search.algorithm=bayes"])


@pytest.mark.parametrize("bad,message", [
    ("novalue", "--set 'novalue': expected KEY=VALUE"),
    ("=3", "--set '=3': empty key"),
    ("a..b=1", "--set 'a..b=1': empty part in 'a..b'"),
    ("trainables.5.name=x", "--set 'trainables.5.name=x': index 5 is out of range (trainables has 1 item(s))"),
    ("trainables.x.name=x", "--set 'trainables.x.name=x': trainables is a list; use an index, got 'x'"),
    ("trainables.-1.name=x", "--set 'trainables.-1.name=x': trainables is a list; use an index, got '-1'"),
    ("name.sub=1", "--set 'name.sub=1': name is a value ('quickstart'), not a section"),
    ("common=[1", "--set 'common=[1': the value is not valid YAML"),
])
def test_malformed_overrides(bad, message):
    with pytest.raises(SpecError) as info:
        load_spec(QUICKSTART, [bad])
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_flat_params():
    raw = _search(epsilon=[0.5, 1.0], lr={"loguniform": [1e-4, 1e-2]})
    raw["description"] = "x" * 900
    raw["search"] = {"algorithm": "random"}
    flat = spec_to_flat_params(validate_spec(raw))
    assert flat["trainables.0.name"] == "pixeldp" and flat["common.train_size"] == "100"
    assert flat["trainables.0.search.epsilon"] == "[0.5, 1.0]"
    assert flat["trainables.0.search.lr.loguniform"] == "[0.0001, 0.01]"
    assert flat["search.algorithm"] == "random" and len(flat["description"]) == 500
    assert all(isinstance(v, str) for v in flat.values())
    flat = spec_to_flat_params(load_spec(CERTIFIED))
    assert flat["common.train_size"] == "null" and flat["common.attacks.pgd"] == "[0.5, 1.0, 2.0]"


# --------------------------------------------------------------------------- invalid specs

RANDOM = {"search.algorithm": "random"}
OPTUNA = {"search": {"algorithm": "optuna", "metric": "acc_clean", "mode": "max"}}
S = "trainables.0.search."

BAD = [
    ("unknown top-level key", {"nme": "x", "name": DELETE}, "nme: unknown key (did you mean 'name'?)"),
    ("unknown search key", {S + "epsilonn": [1.0]}, "trainables[0].search.epsilonn: unknown key (did you mean 'epsilon'?)"),
    ("unknown trainable", {"trainables.0.name": "pixldp"},
     "trainables[0].name: unknown trainable 'pixldp' (did you mean 'pixeldp'?); known: pixeldp"),
    ("unknown section key", {"scheduler": {"tipe": "asha"}}, "scheduler.tipe: unknown key (did you mean 'type'?)"),
    ("unknown trainable key", {"trainables.0.serch": {}}, "trainables[0].serch: unknown key (did you mean 'search'?)"),
    ("unknown mlflow key", {"mlflow": {"experimnt": "x"}}, "mlflow.experimnt: unknown key (did you mean 'experiment'?)"),
    ("unknown common key", {"common.trainsize": 10}, "common.trainsize: unknown key (did you mean 'train_size'?)"),
    ("string for epsilon", {S + "epsilon": "abc"}, "trainables[0].search.epsilon: must be a number, got 'abc'"),
    ("1e-3 is a YAML string", {S + "lr": "1e-3"}, "trainables[0].search.lr: must be a number, got '1e-3' (YAML reads"),
    ("bool for epsilon", {S + "epsilon": True}, "trainables[0].search.epsilon: must not be a boolean, got True"),
    ("bool in a grid", {S + "epsilon": {"grid": [0.5, True]}}, "trainables[0].search.epsilon.grid[1]: must not be a boolean"),
    ("bool for a 0/1 key", {S + "noise_after": True}, "trainables[0].search.noise_after: must be one of 0, 1; got True"),
    ("negative epsilon in a grid", {S + "epsilon": [0.5, 1.0, -1.0]}, "trainables[0].search.epsilon[2]: must be > 0, got -1.0"),
    ("zero epsilon in a grid", {S + "epsilon": [0.5, 1.0, 0.0]}, "trainables[0].search.epsilon[2]: must be > 0, got 0.0"),
    ("infinite epsilon", {S + "epsilon": math.inf}, "trainables[0].search.epsilon: must be a finite number, got inf"),
    ("delta 0", {S + "delta": 0.0}, "trainables[0].search.delta: must be > 0, got 0.0"),
    ("delta 1.5", {S + "delta": 1.5}, "trainables[0].search.delta: must be < 1, got 1.5"),
    ("delta 1.5 in a grid", {S + "delta": {"grid": [0.1, 1.5]}}, "trainables[0].search.delta.grid[1]: must be < 1, got 1.5"),
    ("bad choice option", {S + "norm": {"choice": ["l2", "l3"]}},
     "trainables[0].search.norm.choice[1]: must be one of 'l2', 'l1'; got 'l3'"),
    ("unknown attack", {"common.attacks": {"deepfool": [0.1]}},
     "common.attacks: unknown attack 'deepfool'; known: fgsm, ifgsm, mim, pgd"),
    ("attack size not a number", {"common.attacks": {"pgd": [0.1, "x"]}}, "common.attacks.pgd[1]: must be a number, got 'x'"),
    ("unknown dataset", {"common.dataset": "svhn"},
     "common.dataset: must be one of 'mnist', 'fashion_mnist', 'cifar10'; got 'svhn'"),
    ("float for an integer", {"common.epochs": 2.5}, "common.epochs: must be an integer, got 2.5"),
    ("list in common", {"common.epsilon": [0.5, 1.0]}, "common.epsilon: common holds fixed values"),
    ("negative certify size", {"common.certify_sizes": [0.1, -0.2]},
     "common.certify_sizes: certify sizes must be finite and >= 0, got -0.2"),
    ("empty grid", {S + "epsilon": []}, "trainables[0].search.epsilon: must not be empty"),
    ("empty explicit grid", {S + "epsilon": {"grid": []}}, "trainables[0].search.epsilon.grid: must not be empty"),
    ("empty choice", {S + "epsilon": {"choice": []}}, "trainables[0].search.epsilon.choice: must not be empty"),
    ("duplicate grid value", {S + "epsilon": [0.5, 0.5]}, "trainables[0].search.epsilon[1]: duplicate of [0]"),
    ("misspelt distribution", {S + "epsilon": {"unifrom": [0.1, 1.0]}},
     "trainables[0].search.epsilon: a mapping here must be one of"),
    ("uniform low >= high", {**RANDOM, S + "lr": {"uniform": [0.01, 0.001]}},
     "trainables[0].search.lr.uniform: low must be < high, got [0.01, 0.001]"),
    ("uniform not a pair", {**RANDOM, S + "lr": {"uniform": [0.01]}},
     "trainables[0].search.lr.uniform: must be a pair [low, high]"),
    ("uniform infinite bound", {**RANDOM, S + "weight_decay": {"uniform": [0.0, math.inf]}},
     "trainables[0].search.weight_decay.uniform[1]: must be a finite number, got inf"),
    ("loguniform low 0", {**RANDOM, S + "weight_decay": {"loguniform": [0.0, 0.1]}},
     "trainables[0].search.weight_decay.loguniform[0]: must be > 0 for loguniform, got 0.0"),
    ("loguniform low < 0", {**RANDOM, S + "lr": {"loguniform": [-1.0, 0.1]}},
     "trainables[0].search.lr.loguniform[0]: must be > 0, got -1.0"),
    ("null range bound", {**RANDOM, S + "train_size": {"uniform": [None, 5000]}},
     "trainables[0].search.train_size.uniform[0]: a bound must be a number, got None"),
    ("uniform on a string key", {**RANDOM, S + "norm": {"uniform": [0, 1]}},
     "trainables[0].search.norm.uniform: needs a numeric key (it takes 'l2', 'l1'; use choice)"),
    ("uniform in a grid search", {S + "lr": {"uniform": [0.001, 0.01]}},
     "trainables[0].search.lr: uniform is not allowed with search.algorithm grid (a grid cannot sample); "
     "use search.algorithm: random or optuna"),
    ("negative cpu", {"resources": {"cpu": -1}}, "resources.cpu: must be > 0, got -1"),
    ("zero cpu", {"resources": {"cpu": 0}}, "resources.cpu: must be > 0, got 0"),
    ("negative gpu", {"resources": {"gpu": -0.5}}, "resources.gpu: must be >= 0, got -0.5"),
    ("fractional gpu above 1", {"resources": {"gpu": 1.5}}, "resources.gpu: above 1 must be a whole number (Ray), got 1.5"),
    ("bool cpu", {"resources": {"cpu": True}}, "resources.cpu: must be a number, got True"),
    ("max_concurrent_trials 0", {"max_concurrent_trials": 0}, "max_concurrent_trials: must be >= 1, got 0"),
    ("max_retries -1", {"failure": {"max_retries": -1}}, "failure.max_retries: must be >= 0, got -1"),
    ("num_samples 0", {"search.num_samples": 0}, "search.num_samples: must be >= 1, got 0"),
    ("unknown algorithm", {"search.algorithm": "bayes"},
     "search.algorithm: must be one of 'grid', 'random', 'optuna'; got 'bayes'"),
    ("optuna with two trainables", {**OPTUNA, "trainables.1": {"name": "pixeldp"}},
     "search.algorithm: optuna searches the space of one trainable, got 2 trainables"),
    ("optuna without metric", {"search": {"algorithm": "optuna"}},
     "search.metric: required for search.algorithm optuna (with search.mode), or give search.objectives"),
    ("optuna choosing among lists", {**OPTUNA, S + "certify_sizes": {"choice": [[0.1], [0.2]]}},
     "trainables[0].search.certify_sizes.choice[0]: Optuna chooses among single values"),
    ("metric without mode", {"search.metric": "acc_clean"}, "search.mode: required with search.metric (min or max)"),
    ("objectives without optuna", {"search.objectives": [{"metric": "acc_clean", "mode": "max"}]},
     "search.objectives: only used by search.algorithm optuna"),
    ("metric not reported", {"search": {"metric": "cert_acc0.1", "mode": "max"}},
     "search.metric: 'cert_acc0.1' is not reported by every trial of 'pixeldp' (did you mean 'cert_acc_0.1'?)"),
    ("asha without metric", {"scheduler": {"type": "asha"}},
     "scheduler.metric: required for scheduler.type asha (a per-epoch metric: train_loss, test_acc; "
     "or acc_clean (compared as test_acc))"),
    ("asha on a final-only metric", {"scheduler": {"type": "asha", "metric": "cert_acc_0.1"}},
     "scheduler.metric: asha compares per-epoch metrics (train_loss, test_acc; or acc_clean (compared as "
     "test_acc)), got 'cert_acc_0.1'; a metric reported once per trial has no value at ASHA's rungs"),
    ("asha maximising a loss", {"scheduler": {"type": "asha", "metric": "train_loss", "mode": "max"}},
     "scheduler.mode: train_loss is better when lower; use min, got 'max'"),
    ("bad name", {"name": "has space"}, "name: must be letters, digits, '_', '.' or '-' only"),
    ("missing name", {"name": DELETE}, "name: required"),
    ("no trainables", {"trainables": []}, "trainables: must not be empty"),
    ("missing trainables", {"trainables": DELETE}, "trainables: required"),
    ("trainables as a mapping", {"trainables": {"pixeldp": {}}}, "trainables: must be a list"),
    ("empty storage", {"storage": ""}, "storage: must not be empty"),
    ("too many trials", {S + "seed": list(range(101)), S + "data_seed": list(range(100))},
     f"search: the spec expands to {101 * 100 * 6} trials (grid product x num_samples), more than {MAX_TRIALS}"),
]


@pytest.mark.parametrize("changes,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_invalid_specs(changes, message):
    text = _error(_spec(changes))
    assert text.startswith(message), text


def test_exact_messages():
    assert _error(_search(epsilon=[0.5, 1.0, -1.0])) == "trainables[0].search.epsilon[2]: must be > 0, got -1.0"
    assert _error(_spec({"scheduler": {"tipe": "asha"}})) == "scheduler.tipe: unknown key (did you mean 'type'?)"


def test_file_errors(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(missing)
    assert str(info.value) == f"{missing}: file not found"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrainables:\n  - name: pixeldp\n    search: {epsilon: [0.5, 1.0}\n")
    with pytest.raises(SpecError) as info:
        load_spec(bad)
    assert str(info.value).startswith(f"{bad}:4:") and "invalid YAML" in str(info.value)
    assert "\n" not in str(info.value)
    tabs = tmp_path / "tabs.yaml"
    tabs.write_text("name: x\n\tcommon: {}\n")
    with pytest.raises(SpecError, match=r"tabs.yaml:2:\d+: invalid YAML"):
        load_spec(tabs)
    for text, message in [("- 1\n- 2\n", "must be a mapping of spec keys"), ("", "empty spec")]:
        path = tmp_path / "other.yaml"
        path.write_text(text)
        with pytest.raises(SpecError, match=message):
            load_spec(path)
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)
    with pytest.raises(SpecError, match="^spec: must be a mapping"):
        validate_spec(["not", "a", "mapping"])


def test_safe_load_refuses_python_tags(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['true']\ntrainables: [{name: pixeldp}]\n")
    with pytest.raises(SpecError, match=r"evil.yaml:1:\d+: invalid YAML"):
        load_spec(path)


def test_cli_reports_invalid_specs_with_exit_code_2(tmp_path, monkeypatch, capsys):
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(_search(epsilon=[0.5, -1.0])))
    assert main(["validate", str(spec)]) == 2
    assert "dpsweep: error: trainables[0].search.epsilon[1]: must be > 0" in capsys.readouterr().err
    assert main(["run", str(spec)]) == 2
    assert main(["run", str(QUICKSTART), "--set", "oops"]) == 2
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ray_results").exists()
    assert main(["validate", str(QUICKSTART)]) == 0
    assert "valid (4 trials" in capsys.readouterr().out
