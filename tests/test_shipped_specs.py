"""Every spec shipped in sweeps/ validates and expands, as is and with the local subset its
comment suggests (the trial schemas of every trainable it names accept every candidate value)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sweeps.spec import expand_trials, load_spec
from trainables.registry import REGISTRY

SPECS = sorted((Path(__file__).resolve().parent.parent / "sweeps").glob("*.yaml"))


def test_specs_are_shipped():
    names = {p.name for p in SPECS}
    assert {"quickstart.yaml", "dpal_paper_baselines.yaml"} <= names


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_shipped_spec_validates_and_expands(path):
    spec = load_spec(path)
    trials = expand_trials(spec)
    assert trials, f"{path.name} expands to no trial"
    for t in spec.trainables:
        assert t.name in REGISTRY


def test_every_registered_trainable_has_a_shipped_spec():
    used = {t.name for p in SPECS for t in load_spec(p).trainables}
    assert set(REGISTRY) <= used, f"no shipped spec runs {sorted(set(REGISTRY) - used)}"
