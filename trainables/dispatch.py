"""One Ray Tune trainable for a sweep that compares several mechanisms: it runs the registered
trainable named by the trial config's ``trainable`` key."""

from __future__ import annotations

from trainables.registry import get_trainable


def trial_config(config: dict) -> dict:
    """Flatten the CLI's pre-expanded grid form ``{"trial": {...}, "_mlflow": ...}``."""
    if isinstance(config.get("trial"), dict):
        return {**config["trial"], **{k: v for k, v in config.items() if k != "trial"}}
    return dict(config)


def dispatch(config: dict) -> None:
    cfg = trial_config(config)
    name = cfg.get("trainable")
    if name is None:
        raise ValueError("config.trainable: missing (the name of a registered trainable)")
    get_trainable(name).fn(cfg)
