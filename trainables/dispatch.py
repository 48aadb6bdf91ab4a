"""One Ray Tune trainable for a sweep that compares several mechanisms: it runs the registered
trainable named by the trial config's ``trainable`` key."""

from __future__ import annotations

from trainables.config import trial_config
from trainables.registry import get_trainable


def dispatch(config: dict) -> None:
    cfg = trial_config(config)
    name = cfg.get("trainable")
    if name is None:
        raise ValueError("config.trainable: missing (the name of a registered trainable)")
    get_trainable(name).fn(cfg)
