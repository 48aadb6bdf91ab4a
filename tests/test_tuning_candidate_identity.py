"""Issue 48.1: a tuning-private release must not name the candidate it came from.

Papernot & Steinke's bound covers the best of K candidates with K random and unobserved; the index of
the released candidate is a lower bound on K (and the argmax's position), which the bound assumes
hidden. Before issue 48, candidate r initialised from the public ``seed + 1,000,003 r``: the cosine
between the released weights and each candidate's public initialisation named r.

The attack here is the review's, with the attacker's best case: it knows every candidate's public
seed (the spec and the derivation are public) and computes each candidate's initialisation; it
names the candidate whose initialisation is closest (cosine) to the released weights. The released
weights stand in for a short training run: the initialisation plus a perturbation as large as the
initialisation itself (a cosine of about 0.7 with it, between the review's 0.84 after part of an
epoch and 0.10 after ten epochs).

Negative control: the same attack on the old derivation (per-candidate seeds) names every candidate.
"""

from __future__ import annotations

import torch

from dpmech.dpsgd.trainer import build_dpsgd_model
from dpmech.privacy.secret import NoiseKey
from sweeps.spec import expand_trials, validate_spec
from sweeps.spec import space as space_mod

RAW = {
    "name": "tuned_identity",
    "common": {"dataset": "mnist", "train_size": 500, "test_size": 100, "diagnostics": False},
    "trainables": [{"name": "dpsgd", "search": {"epsilon": 2.0, "delta": 1.0e-5, "epochs": 1, "model": "tb_cnn",
                                                "lr": {"loguniform": [0.02, 0.5]},
                                                "max_grad_norm": {"choice": [0.5, 1.0]}}}],
    "search": {"algorithm": "random", "seed": 0, "metric": "acc_clean", "mode": "max"},
    "tuning_privacy": {"distribution": "geometric", "mean": 8, "delta": 1.0e-5},
}


def _candidates(min_k: int = 5) -> list[dict]:
    """The candidates of a tuning-private sweep bound to a fixed secret key with at least ``min_k`` of them."""
    spec = validate_spec(RAW)
    for i in range(1, 200):
        spec.bind_noise_key(NoiseKey(bytes([i]) * 32))
        trials = expand_trials(spec)
        if len(trials) >= min_k:
            return trials
    raise AssertionError("no key among 200 gave K >= min_k")


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _released(cfg: dict, which: int) -> torch.Tensor:
    """Candidate ``cfg``'s weights after 'training': its public initialisation plus a perturbation
    of the same size, from a generator the attacker does not know."""
    w0 = _flat(build_dpsgd_model("mnist", cfg["seed"], cfg["model"]))
    g = torch.Generator().manual_seed(10_000 + which)
    noise = torch.randn(w0.shape, generator=g)
    return w0 + noise * (w0.norm() / noise.norm())


def _attack(released: torch.Tensor, public_seeds: list[int], model: str) -> tuple[int, torch.Tensor]:
    """(the index named, the cosines to every candidate's public initialisation)."""
    inits = torch.stack([_flat(build_dpsgd_model("mnist", s, model)) for s in public_seeds])
    cos = torch.nn.functional.cosine_similarity(inits, released.unsqueeze(0), dim=1)
    return int(cos.argmax()), cos


def _identified(trials: list[dict]) -> tuple[int, list[float]]:
    """How many candidates the attack names correctly when each is released in turn, and the
    margin between the best and second-best cosine each time."""
    seeds = [t["seed"] for t in trials]
    hits, margins = 0, []
    for r, cfg in enumerate(trials):
        guess, cos = _attack(_released(cfg, r), seeds, cfg["model"])
        top = cos.sort(descending=True).values
        margins.append(float(top[0] - top[1]))
        # a guess counts only when it is unique: equal cosines name nobody
        hits += int(guess == r and margins[-1] > 1e-6)
    return hits, margins


def test_candidates_share_every_public_seed():
    trials = _candidates()
    assert len({t["repeat"] for t in trials}) == len(trials) >= 5
    assert {t["seed"] for t in trials} == {0}
    assert len({t["data_seed"] for t in trials}) == 1


def test_released_weights_do_not_name_their_candidate():
    trials = _candidates()
    hits, margins = _identified(trials)
    assert hits == 0
    assert max(margins) < 1e-6, "every candidate's public initialisation is the same"


def test_control_old_per_candidate_seeds_name_every_candidate(monkeypatch):
    """The control: with per-candidate public seeds (the derivation before issue 48) the same
    attack names the released candidate every time."""
    original = space_mod.expand

    def old_expand(spaces, num_samples, seed, repeat_seeds=True):
        return original(spaces, num_samples, seed, repeat_seeds=True)

    monkeypatch.setattr("sweeps.spec.sweep_spec.expand", old_expand)
    trials = _candidates()
    assert len({t["seed"] for t in trials}) == len(trials)
    hits, margins = _identified(trials)
    assert hits == len(trials)
    assert min(margins) > 0.3


def test_research_mode_keeps_per_candidate_seeds():
    """noise_source: seed draws the noise from the seed, so its candidates keep distinct seeds (it
    cannot be released: tests/test_release.py)."""
    raw = {**RAW, "common": {**RAW["common"], "noise_source": "seed"}}
    trials = expand_trials(validate_spec(raw))
    if len(trials) > 1:
        assert len({t["seed"] for t in trials}) == len(trials)
