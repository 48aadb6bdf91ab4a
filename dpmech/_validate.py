"""Input validation shared by every dpmech module.

Every public function of dpmech checks its arguments before doing any work and raises
``ValueError`` with a one-line message that names the parameter and the rule it broke
(DESIGN.md, "Conventions"). Nothing is silently clamped.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable


def _real(name: str, value) -> float:
    """Return ``value`` as a float, refusing bools, strings, None and NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    out = float(value)
    if math.isnan(out):
        raise ValueError(f"{name} must not be NaN")
    return out


def positive(name: str, value, *, allow_inf: bool = False) -> float:
    """``value > 0`` and finite (unless ``allow_inf``)."""
    out = _real(name, value)
    if not allow_inf and math.isinf(out):
        raise ValueError(f"{name} must be finite, got {out}")
    if out <= 0:
        raise ValueError(f"{name} must be > 0, got {out}")
    return out


def non_negative(name: str, value) -> float:
    """``value >= 0`` and finite."""
    out = _real(name, value)
    if math.isinf(out):
        raise ValueError(f"{name} must be finite, got {out}")
    if out < 0:
        raise ValueError(f"{name} must be >= 0, got {out}")
    return out


def open_unit(name: str, value) -> float:
    """``0 < value < 1`` (a delta, a failure probability)."""
    out = _real(name, value)
    if not 0.0 < out < 1.0:
        raise ValueError(f"{name} must be in the open interval (0, 1), got {out}")
    return out


def unit_interval(name: str, value, *, low_open: bool = False, high_open: bool = False) -> float:
    """``value`` in [0, 1] with optionally open ends."""
    out = _real(name, value)
    lo_ok = out > 0 if low_open else out >= 0
    hi_ok = out < 1 if high_open else out <= 1
    if not (lo_ok and hi_ok):
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}0, 1{hi}, got {out}")
    return out


def positive_int(name: str, value, *, minimum: int = 1) -> int:
    """An integer ``>= minimum`` (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    out = int(value)
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def choice(name: str, value, options: Iterable[str]) -> str:
    """``value`` is one of ``options`` (strings)."""
    opts = tuple(options)
    if not isinstance(value, str) or value not in opts:
        raise ValueError(f"{name} must be one of {', '.join(repr(o) for o in opts)}; got {value!r}")
    return value


def epsilon_or_noise(epsilon, noise_multiplier) -> None:
    """A DP-SGD-style config's privacy: a positive target ``epsilon`` or a non-negative
    ``noise_multiplier`` (or neither: non-private), never both."""
    if epsilon is not None:
        positive("epsilon", epsilon)
    if noise_multiplier is not None:
        non_negative("noise_multiplier", noise_multiplier)
        if epsilon is not None:
            raise ValueError("epsilon: give a target epsilon or a noise_multiplier, not both")


def matching_checkpoint(saved_config, config: dict) -> None:
    """A trainer's checkpoint is restored only into a trainer built with the same configuration."""
    if saved_config != config:
        raise ValueError("checkpoint config does not match this trainer's config")


def labels_array(y, n: int, unknown: int):
    """Labels ``y`` (a tensor, array or sequence; a scalar when ``n == 1``) as an int64 array of
    shape ``[n]``; ``None`` gives ``unknown`` for every example (a value no prediction equals)."""
    import numpy as np

    if y is None:
        return np.full(n, unknown, dtype=np.int64)
    if hasattr(y, "detach"):
        y = y.detach().cpu()
    y = np.asarray(y)
    if y.ndim == 0 and n == 1:
        y = y.reshape(1)
    if y.shape != (n,):
        raise ValueError(f"y must have shape [{n}], got {tuple(y.shape)}")
    return y.astype(np.int64)


def training_images(x_train, y_train, *, in_range: bool = False) -> None:
    """A trainer's training set: images [N, C, H, W] with N labels [N]; with ``in_range``, the
    project's input domain [-1, 1] (to 1e-6)."""
    if x_train.dim() != 4 or y_train.dim() != 1 or x_train.shape[0] != y_train.shape[0]:
        raise ValueError(f"x_train must be [N, C, H, W] with N labels, got {tuple(x_train.shape)} "
                         f"and {tuple(y_train.shape)}")
    if in_range and (x_train.min().item() < -1 - 1e-6 or x_train.max().item() > 1 + 1e-6):
        raise ValueError("x_train must lie in [-1, 1]")


def set_generator_state(field: str, generator, state) -> None:
    """``generator.set_state(state)``, or a one-line ValueError when the state was saved by a
    generator on another kind of device (a CUDA generator's state is 16 bytes, a CPU one's 5,056):
    the stream cannot be continued there, and starting it again would reuse noise already drawn."""
    import torch

    state = state.cpu() if isinstance(state, torch.Tensor) else state
    try:
        generator.set_state(state)
    except RuntimeError as exc:
        raise ValueError(f"checkpoint.{field}: saved by a generator on another kind of device than this trainer's "
                         f"{generator.device.type} ({str(exc).splitlines()[0][:80]}); resume on the device it was "
                         "saved on (a fresh stream there would reuse or correlate noise already drawn)") from None
