"""How a trial builds its mechanism (the trainer adapter of trainables.runtime), shared by the trial
itself and the membership attack's reference models (trainables.mia_trial)."""

from __future__ import annotations

from trainables.config import CommonConfig


def build_mechanism(mechanism_cls, cfg: CommonConfig, x, y, device, noise_key):
    """``mechanism_cls(cfg, x, y, device, noise_key=...)``; a mechanism whose constructor takes no
    ``noise_key`` (one written before it existed) is built without it and draws its own."""
    import inspect

    try:
        takes_key = "noise_key" in inspect.signature(mechanism_cls).parameters
    except (TypeError, ValueError):
        takes_key = False
    return mechanism_cls(cfg, x, y, device, noise_key=noise_key) if takes_key else mechanism_cls(cfg, x, y, device)
