"""What a trainable declares about itself (``TrainableEntry``): its name, its Ray Tune function, its
trial schema, and what its epsilon protects. Each trainable module ends with ``TRAINABLES``, a tuple
of these; ``trainables.registry`` collects them (docs/adding_a_mechanism.md)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from trainables.config import CommonConfig


@dataclass(frozen=True)
class TrainableEntry:
    name: str
    target: str                    # "module:function" of the Ray Tune function trainable
    config_model: type[CommonConfig]
    description: str
    # "module:function" mapping a validated config to the dp-accounting DpEvent of one trial (its
    # guarantee for the training examples, planned from the config); None: the trainable has no
    # such guarantee (tuning_privacy refuses it). privacy_keys: the config keys that change it.
    privacy_event: str | None = None
    privacy_keys: tuple[str, ...] = ()
    # What the trial's ``epsilon`` metric protects, in words (``dpsweep mechanisms`` prints it;
    # docs/metrics.md). privacy_epsilon False: the trainable logs no epsilon/delta metric at all
    # (its epsilon is a robustness parameter, logged as robustness_epsilon*).
    epsilon_protects: str = "training examples"
    privacy_epsilon: bool = True
    # Final metrics of this trainable beyond the generic ones (sweeps.spec.space.reported_metrics reads it)
    metrics: tuple[str, ...] = ()
    # "module:function" (config, metrics) -> the final metrics of a trial with this config, given the
    # set computed from the generic rules and ``metrics``; None: that set as it is
    final_metrics: str | None = None

    @property
    def fn(self) -> Callable[[dict], None]:
        return resolve(self.target)

    @property
    def privacy_event_fn(self) -> Callable:
        if self.privacy_event is None:
            raise ValueError(f"trainable {self.name!r} has no per-trial privacy event")
        return resolve(self.privacy_event)

    def reported_metrics(self, config: dict, metrics: set[str]) -> set[str]:
        """The final metrics of a trial with ``config``, given the generic ones plus ``metrics``."""
        return metrics if self.final_metrics is None else set(resolve(self.final_metrics)(config, metrics))


def resolve(target: str):
    """The object named by ``"module:attribute"``."""
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)
