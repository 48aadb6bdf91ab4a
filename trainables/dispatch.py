"""One Ray Tune trainable for a sweep that compares several mechanisms: it runs the registered
trainable named by the trial config's ``trainable`` key. ``noise_key`` is the sweep's secret
(``tune.with_parameters``: in Ray's object store, never in a config; docs/threat_model.md)."""

from __future__ import annotations

from trainables.config import trial_config
from trainables.registry import get_trainable


def dispatch(config: dict, noise_key=None) -> None:
    cfg = trial_config(config)
    name = cfg.get("trainable")
    if name is None:
        raise ValueError("config.trainable: missing (the name of a registered trainable)")
    fn = get_trainable(name).fn
    from trainables.watchdog import trial_time_limit

    with trial_time_limit(cfg):   # failure.trial_timeout (trainables.watchdog)
        if noise_key is not None and takes_noise_key(fn):
            fn(cfg, noise_key=noise_key)
        else:   # a trainable written without the parameter draws its own randomness
            fn(cfg)


def takes_noise_key(fn) -> bool:
    import inspect

    try:
        return "noise_key" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
