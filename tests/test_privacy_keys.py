"""Every trainable's ``privacy_keys`` covers every config key its privacy event depends on
(issue 25: DPGAN's omitted ``fake_labels`` and ``histogram_noise``, so ``tuning_privacy``
enumerated one configuration and under-reported). The keys are *derived* here, not listed: each
config key is perturbed over valid values, at the defaults and with each privacy-relevant choice
switched, and any key whose perturbation changes the planned DpEvent must be in privacy_keys."""

from __future__ import annotations

import functools
import hashlib
import typing

import pytest
from pydantic import ValidationError

import dpmech.dp_merf.trainer
import dpmech.dpsgd.trainer
import dpmech.dpgan.config
import dpmech.lipschitz.trainer
from trainables.registry import REGISTRY

PRIVATE = sorted(n for n, e in REGISTRY.items() if e.privacy_event is not None)


@pytest.fixture(autouse=True)
def _fast_calibration(monkeypatch):
    """The question here is which config keys *reach* the event, not the calibrated value: each
    calibration is replaced by a fast stand-in that is a one-to-one (hash) function of all its
    inputs, so the event changes exactly when the real calibration's inputs change (the real
    calibrations, PLD ones especially, would make this sweep over keys take minutes)."""
    def stand_in(*args, **kwargs):
        digest = hashlib.sha256(repr((args, sorted(kwargs.items()))).encode()).digest()
        return 0.5 + int.from_bytes(digest[:6], "big") / 2 ** 48

    monkeypatch.setattr(dpmech.dpsgd.trainer, "calibrated_noise_multiplier", stand_in)
    for module in (dpmech.dpgan.config, dpmech.dp_merf.trainer, dpmech.lipschitz.trainer):
        monkeypatch.setattr(module, "noise_multiplier_for", stand_in)


def _alternatives(annotation, value) -> list:
    """Valid-looking other values of a field: every other Literal option, the other bool, x2 / x0.5
    (and +1) of a number, None where allowed, a number where the default is None."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return [a for a in args if a != value]
    if annotation is bool:
        return [not value]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) or args:
        out = []
        for a in args:
            if a is type(None):
                if value is not None:
                    out.append(None)
            elif typing.get_origin(a) is typing.Annotated:
                out += _alternatives(typing.get_args(a)[0], value)
            else:
                out += _alternatives(a, value)
        return out
    if annotation is int and (value is None or type(value) is int):
        return [1000, 3000] if value is None else [value * 2, value + 1]
    if annotation is float and (value is None or type(value) in (int, float)):
        return [1.0, 0.5] if value is None else [value * 2, value / 2]
    return []


def _event(entry, **cfg):
    try:
        return entry.privacy_event_fn(entry.config_model(**cfg))
    except (ValidationError, ValueError):
        return None


def _dependent_keys(entry, base: dict) -> set[str]:
    ref = _event(entry, **base)
    assert ref is not None, f"{entry.name}: base config {base} is invalid"
    resolved = entry.config_model(**base)
    keys = set()
    for key, field in entry.config_model.model_fields.items():
        current = getattr(resolved, key)
        for alt in _alternatives(field.annotation, current):
            ev = _event(entry, **{**base, key: alt})
            if ev is not None and ev != ref:
                keys.add(key)
                break
    return keys


def _choice_bases(entry, keys: set[str], base: dict) -> list[dict]:
    """The base with one privacy-relevant Literal/bool key switched to each other value (exposes
    keys that matter only then, e.g. histogram_noise when fake_labels is dp_histogram)."""
    out, resolved = [], entry.config_model(**base)
    for key in keys:
        field = entry.config_model.model_fields[key]
        if field.annotation is bool or typing.get_origin(field.annotation) is typing.Literal:
            for alt in _alternatives(field.annotation, getattr(resolved, key)):
                if _event(entry, **{**base, key: alt}) is not None:
                    out.append({**base, key: alt})
    return out


@functools.lru_cache(maxsize=None)
def derived_privacy_keys(name: str) -> frozenset[str]:
    entry = REGISTRY[name]
    base = {}
    keys = _dependent_keys(entry, base)
    for b in _choice_bases(entry, keys, base):
        keys |= _dependent_keys(entry, b)
    return frozenset(keys)


@pytest.mark.parametrize("name", PRIVATE)
def test_privacy_keys_cover_every_key_the_event_depends_on(name):
    derived = derived_privacy_keys(name)
    missing = derived - set(REGISTRY[name].privacy_keys)
    assert not missing, f"{name}: privacy_keys lacks {sorted(missing)} (each changes the planned privacy event)"
    assert {"epsilon", "delta"} <= derived  # the derivation itself sees the obvious keys


def test_dpgan_histogram_keys_are_derived_and_listed():
    """The review's finding, stated directly: fake_labels and histogram_noise change DPGAN's event."""
    derived = derived_privacy_keys("dpgan")
    assert {"fake_labels", "histogram_noise"} <= derived
    assert {"fake_labels", "histogram_noise"} <= set(REGISTRY["dpgan"].privacy_keys)


def test_derivation_finds_a_key_that_only_matters_under_another_choice():
    """Negative control of the method: histogram_noise leaves the default (uniform labels) event
    unchanged, so one pass over the defaults alone would miss it."""
    entry = REGISTRY["dpgan"]
    assert "histogram_noise" not in _dependent_keys(entry, {})
    assert "histogram_noise" in _dependent_keys(entry, {"fake_labels": "dp_histogram"})


def test_print_derived_keys(capsys):
    """Shows the derived sets (``pytest -s``) beside the listed ones."""
    for name in PRIVATE:
        print(name, sorted(derived_privacy_keys(name)), sorted(REGISTRY[name].privacy_keys))
