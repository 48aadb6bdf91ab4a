"""The ``label_attack`` trial key (issue 52, part 5; docs/mia.md, "Label DP in a sweep"): a label_dp trial
draws its audited examples' labels from the uniform prior with its own noise key, the attacker guesses
them from the trained model's outputs, and the trial logs the advantage and the epsilon lower bound
beside its label epsilon. Controls: a non-private model is found; at a small label epsilon the bound
never exceeds the claim over repeated fixed-key runs (library: the strongest attacker on the release
itself; trials: the trained model); the key's rules are one-line errors; the secret labels stay out of
the attack's reach."""

from __future__ import annotations

import inspect
import pickle
import types

import pytest
import torch

from dpmech.privacy.mia.labels import LabelGame, label_guess_outputs
from dpmech.privacy.secret import NoiseKey

pytestmark = [pytest.mark.usefixtures("one_thread")]

K = 10
TINY = {"trainable": "label_dp", "dataset": "mnist", "train_size": 100, "test_size": 100, "batch_size": 25,
        "epochs": 12, "lr": 3e-3, "certify_images": 0, "noise_source": "seed", "seed": 0,
        "label_attack": {"examples": 100}}
LABEL_METRICS = ("label_inference_accuracy", "label_inference_prior_accuracy", "label_inference_advantage",
                 "label_inference_eps_lb", "label_inference_examples", "label_inference_correct",
                 "label_inference_confidence", "label_attack_seconds")


def _run(monkeypatch, config: dict) -> dict:
    from ray import tune

    from trainables.registry import get_trainable

    results = []
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: types.SimpleNamespace(get_trial_id=lambda: "t0"))
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: results.append(dict(metrics)))
    get_trainable(config["trainable"]).fn(config)
    return results[-1]


class _Lookup(torch.nn.Module):
    """The strongest attacker on a label release: a 'model' that outputs each audited input's released
    label (as if it had memorised the release perfectly)."""

    def __init__(self, released: torch.Tensor):
        super().__init__()
        self.register_buffer("released", released)

    def forward(self, idx):
        return torch.nn.functional.one_hot(self.released[idx[:, 0].long()], K).float()


def _release_game(seed: int, mechanism: str, eps: float, n: int = 1000):
    from dpmech.label_dp.release import release_labels

    key = NoiseKey(bytes([seed % 256]) * 32)
    game = LabelGame(torch.arange(n), K, generator=key.generator("label_attack.labels", seed))
    y = game.training_labels(torch.zeros(n, dtype=torch.int64))
    rel = release_labels(y, num_classes=K, task="classification", mechanism=mechanism, epsilon=eps,
                         generator=key.generator("label_dp.release", seed))
    x = torch.arange(n, dtype=torch.float32)[:, None]
    return game, label_guess_outputs(_Lookup(rel.labels), x), rel.label_epsilon()


def test_at_a_small_label_epsilon_the_bound_never_exceeds_the_claim_and_more_leakage_is_refuted():
    runs = 20
    for mechanism in ("rr", "laplace"):
        for seed in range(runs):
            game, outputs, claim = _release_game(seed, mechanism, 1.0)
            res = game.evaluate(outputs, confidence=1 - 0.05 / runs)      # Bonferroni over the runs
            assert res.eps_lb <= claim, (mechanism, seed, res.eps_lb, claim)
    # the negative control: the same attacker on a release at epsilon 3 refutes a claim of 1
    refuted = 0
    for seed in range(10):
        game, outputs, claim = _release_game(100 + seed, "rr", 3.0)
        res = game.evaluate(outputs, confidence=0.95)
        refuted += res.eps_lb > 1.0
        assert res.eps_lb <= claim
    assert refuted >= 9


def test_the_secret_labels_are_out_of_the_attacks_reach():
    game = LabelGame(torch.arange(50), K, generator=NoiseKey.reproducible(0).generator("label_attack.labels", 0))
    # the attack's view takes a model and inputs, no label
    assert list(inspect.signature(label_guess_outputs).parameters) == ["model", "x", "batch_size"]
    assert not hasattr(game, "labels") and not hasattr(game, "__dict__")
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(game)
    with pytest.raises(TypeError, match="generator"):
        LabelGame(torch.arange(5), K, generator=0)
    # the drawn labels are uniform draws from the generator, not the data's labels
    y = torch.full((50,), 3)
    drawn = game.training_labels(y)
    assert (drawn != 3).any() and drawn.shape == y.shape and (y == 3).all()   # a copy
    # an output independent of the labels scores at the prior (no advantage)
    res = game.evaluate(torch.zeros(50, K))
    assert res.eps_lb == 0.0 and res.prior_accuracy == pytest.approx(0.1)


def test_a_non_private_label_model_is_found_and_a_private_one_is_not_refuted(monkeypatch):
    # positive control: the true labels (mechanism none, the non-private baseline): the model memorises
    # the audited examples' random labels
    for mechanism, eps in (("none", None),):
        final = _run(monkeypatch, {**TINY, "mechanism": mechanism, "epsilon": eps})
        for key in LABEL_METRICS:
            assert key in final, key
        assert final["label_inference_examples"] == 100
        assert final["label_inference_prior_accuracy"] == pytest.approx(0.1)
        assert final["label_inference_advantage"] > 0.5 and final["label_inference_eps_lb"] > 2.0, final
        assert final["label_inference_eps_lb"] <= final["label_epsilon"]
    # at label epsilon 0.5, over fixed seeds (each its own draw of the labels and of the release)
    for seed in (0, 1):
        final = _run(monkeypatch, {**TINY, "mechanism": "rr", "epsilon": 0.5, "seed": seed, "epochs": 6})
        assert final["label_inference_eps_lb"] <= final["label_epsilon"] == pytest.approx(0.5)


def test_the_trial_draws_the_labels_from_its_own_key(monkeypatch):
    import dpmech.privacy.mia.labels as labels_lib

    seeds = []
    real = labels_lib.LabelGame

    def spy(index, num_classes, *, generator):
        seeds.append(generator.initial_seed())
        return real(index, num_classes, generator=generator)

    monkeypatch.setattr(labels_lib, "LabelGame", spy)
    from trainables.label_attack import _public_seed
    from trainables.label_dp import LabelDPTrialConfig

    cfg = LabelDPTrialConfig(**{k: v for k, v in TINY.items() if k != "trainable"}, mechanism="rr", epsilon=1.0)
    from trainables.label_attack import LabelAttackTrial

    x, y = torch.zeros(100, 1, 28, 28), torch.zeros(100, dtype=torch.int64)
    secret = NoiseKey(b"\x07" * 32)
    LabelAttackTrial(cfg, x, y, secret)
    LabelAttackTrial(cfg, x, y, NoiseKey.reproducible(0))
    assert seeds == [secret.stream_seed("label_attack.labels", _public_seed(cfg)), _public_seed(cfg)]
    assert seeds[0] != seeds[1]


@pytest.mark.parametrize("config, message", [
    ({"label_attack": {"examples": 0}}, "label_attack.examples: Input should be greater than or equal to 1"),
    ({"label_attack": {"examples": 10, "candidates": 5}}, "label_attack.candidates: Extra inputs"),
    ({"label_attack": {"confidence": 1.0}}, "label_attack.confidence: Input should be less than 1"),
    ({"label_attack": 5}, "label_attack: must be a mapping"),
    ({"label_attack": {"examples": 101}}, "label_attack.examples: must be <= the training set's 100"),
    ({"label_attack": {"examples": 10}, "task": "regression", "mechanism": "laplace"},
     "label_attack: the attack guesses a class"),
    ({"label_attack": {"examples": 10}, "mechanism": "labeldp_pro"}, "label_attack: its bound holds for pure"),
])
def test_bad_values_are_one_line_errors(config, message):
    from trainables.label_dp import LabelDPTrialConfig

    base = {k: v for k, v in TINY.items() if k != "trainable"}
    with pytest.raises(ValueError) as err:
        LabelDPTrialConfig(**{**base, "mechanism": "rr", "epsilon": 1.0, **config})
    assert message in str(err.value)
    assert any(message in line for line in str(err.value).splitlines())


def test_other_trainables_refuse_the_key():
    from trainables.dpsgd import DPSGDTrialConfig

    with pytest.raises(ValueError, match="label_attack: the label-inference attack runs on label DP trials"):
        DPSGDTrialConfig(dataset="mnist", train_size=1000, label_attack={"examples": 10})
    assert DPSGDTrialConfig(dataset="mnist", train_size=1000, label_attack=None).epsilon is not None
