"""Registry of trainables by name: the function Ray Tune runs, its config schema, a summary.

A new mechanism is one dpmech package, one trainable module, one line in ``MODULES`` below and one
spec (docs/adding_a_mechanism.md). Each module declares its trainables in ``TRAINABLES``
(``trainables.entry.TrainableEntry``); ``REGISTRY`` maps their names to them, in this order.
"""

from __future__ import annotations

import difflib
import importlib

from trainables.entry import TrainableEntry

MODULES = (
    "trainables.pixeldp",
    "trainables.dpal",
    "trainables.dpal_sound",
    "trainables.adlm",
    "trainables.dpgan",
    "trainables.dp_merf",
    "trainables.dpsgd",
    "trainables.label_dp",
    "trainables.secure_sgd",
    "trainables.lipschitz_dp",
)


def _collect(modules) -> dict[str, TrainableEntry]:
    out: dict[str, TrainableEntry] = {}
    for module in modules:
        for entry in importlib.import_module(module).TRAINABLES:
            if entry.name in out:
                raise ValueError(f"trainable {entry.name!r}: declared twice ({module} and {out[entry.name].target})")
            out[entry.name] = entry
    return out


REGISTRY: dict[str, TrainableEntry] = _collect(MODULES)


def did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def get_trainable(name: str) -> TrainableEntry:
    if name not in REGISTRY:
        raise ValueError(f"unknown trainable {name!r}{did_you_mean(name, REGISTRY)}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]
