"""Repeats of a trial (issue 13 point 9): each ``search.num_samples`` repeat gets its own seed,
derived deterministically from the configured seed and the repeat index, and the report
aggregates repeats by their configured parameters (mean, standard deviation and n)."""

from __future__ import annotations

import copy
import math

import pytest

from sweeps.spec import expand_trials, validate_spec
from sweeps.spec_space import REPEAT_SEED_STRIDE, repeat_seed

BASE = {
    "name": "t",
    "common": {"train_size": 100, "test_size": 50},
    "trainables": [{"name": "pixeldp", "search": {"epsilon": [0.5, 1.0]}}],
}


def trials_of(search=None, seed=None, **spec_search):
    raw = copy.deepcopy(BASE)
    raw["trainables"][0]["search"].update(search or {})
    if seed is not None:
        raw["common"]["seed"] = seed
    raw["search"] = spec_search
    return expand_trials(validate_spec(raw))


def test_single_repeat_sweeps_are_unchanged():
    trials = trials_of()
    assert [t["seed"] for t in trials] == [0, 0]
    assert all("repeat" not in t for t in trials)


def test_each_repeat_has_its_own_reproducible_seed():
    trials = trials_of(num_samples=3, seed=7)
    assert [(t["epsilon"], t["repeat"], t["seed"]) for t in trials] == [
        (0.5, 0, 7), (1.0, 0, 7),
        (0.5, 1, 7 + REPEAT_SEED_STRIDE), (1.0, 1, 7 + REPEAT_SEED_STRIDE),
        (0.5, 2, 7 + 2 * REPEAT_SEED_STRIDE), (1.0, 2, 7 + 2 * REPEAT_SEED_STRIDE)]
    assert trials == trials_of(num_samples=3, seed=7)  # deterministic
    # the seeds of one configuration differ across repeats
    assert len({t["seed"] for t in trials if t["epsilon"] == 0.5}) == 3
    assert repeat_seed(7, 0) == 7


def test_random_search_samples_get_their_own_seeds_too():
    trials = trials_of({"lr": {"loguniform": [1e-4, 1e-2]}}, algorithm="random", num_samples=2)
    assert [t["seed"] for t in trials] == [0, 0, REPEAT_SEED_STRIDE, REPEAT_SEED_STRIDE]


def test_an_explicitly_swept_seed_is_left_alone():
    trials = trials_of({"seed": [3, 4]}, num_samples=2)
    assert [t["seed"] for t in trials] == [3, 4, 3, 4] * 2
    assert [t["repeat"] for t in trials] == [0] * 4 + [1] * 4
