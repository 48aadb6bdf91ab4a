"""The ``label_attack`` trial key: label inference against a ``label_dp`` trial's own model (issue 52,
part 5; docs/mia.md, "Label DP in a sweep").

    label_attack: {examples: 500, confidence: 0.95}

* ``examples``: n >= 1 audited training examples (at most ``train_size``), the first n of a public
  permutation of the trial's training subset (``data_seed``). Their labels are replaced, before the
  mechanism releases the labels, by draws from the uniform prior over the classes from the trial's
  secret noise key (``generator("label_attack.labels", ...)``; the public seed's stream only with
  ``noise_source: seed``), so the prior is known exactly and the bound is rigorous
  (``dpmech.privacy.mia.labels.LabelGame``). The mechanism releases them like any other label.
* ``confidence``: 1 - beta of ``label_inference_eps_lb`` (default 0.95).

After training, the attacker guesses each audited example's label as the model's most likely class on
its input; the trial logs ``label_inference_accuracy``, ``_prior_accuracy`` (1/K), ``_advantage``,
``_eps_lb`` (compared with the trial's ``label_epsilon``, the claim; never with ``epsilon`` of a
guarantee about images), ``_examples``, ``_correct``, ``_confidence`` and ``label_attack_seconds``
(names: docs/metrics.md).

Why a key of its own and not ``mia: {attack: label}``: the question is another (which label, not
whether a member), the claim another (the label epsilon), and none of ``mia``'s fields (references,
candidates, num_z) applies. Trainables that accept it say so with ``supports_label_attack`` and a
``label_attack`` field (label_dp); on any other the key is refused in one line
(``CommonConfig._label_attack_elsewhere``). Refused also with ``task: regression`` (the guess is a
class) and with ``mechanism: labeldp_pro`` (an (epsilon, delta) guarantee; the bound is for pure
epsilon).
"""

from __future__ import annotations

import time

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class LabelAttackSettings(BaseModel):
    """The fields of the ``label_attack`` mapping (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    examples: int = Field(500, ge=1)
    confidence: float = Field(0.95, gt=0, lt=1)


def parse(value) -> dict:
    """The mapping checked and completed with its defaults (a plain dict: the config stays JSON); a
    one-line ValueError naming ``label_attack.<field>`` and the rule otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"label_attack: must be a mapping such as {{examples: 500, confidence: 0.95}}, got {value!r}")
    try:
        return LabelAttackSettings(**value).model_dump()
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if not isinstance(p, int))
        raise ValueError(f"label_attack.{where}: {err['msg']}" if where else f"label_attack: {err['msg']}") from None


def settings(cfg) -> LabelAttackSettings | None:
    value = getattr(cfg, "label_attack", None)
    return LabelAttackSettings(**value) if value else None


def check(cfg) -> None:
    """The rules that involve other keys (the schema's validator calls it)."""
    s = settings(cfg)
    if s is None:
        return
    if getattr(cfg, "task", "classification") != "classification":
        raise ValueError("label_attack: the attack guesses a class; task must be 'classification'")
    if getattr(cfg, "mechanism", None) == "labeldp_pro":
        raise ValueError("label_attack: its bound holds for pure label DP; mechanism labeldp_pro is (epsilon, delta)")
    from dpmech.datasets.splits import train_split_size

    size = cfg.train_size if cfg.train_size is not None else train_split_size(cfg.dataset)
    if s.examples > size:
        raise ValueError(f"label_attack.examples: must be <= the training set's {size} examples, got {s.examples}")


def refuse_elsewhere(data, schema_name: str):
    """A schema without a ``label_attack`` field: the key refused in one line that names the rule."""
    if isinstance(data, dict) and data.get("label_attack") is not None:
        raise ValueError("label_attack: the label-inference attack runs on label DP trials (trainable label_dp), "
                         f"whose epsilon protects the labels; {schema_name} has no label_attack key")
    return data


def _public_seed(cfg) -> int:
    return int(cfg.seed) * 1_000_003 + 5207


class LabelAttackTrial:
    """The trial's audited examples (their secret labels) and, after training, the attack."""

    def __init__(self, cfg, x, y, noise_key):
        from dpmech.datasets.splits import num_classes
        from dpmech.privacy.mia.labels import LabelGame

        self.cfg, self.settings = cfg, settings(cfg)
        n = int(y.shape[0])
        if self.settings.examples > n:
            raise ValueError(f"label_attack.examples: must be <= the training set's {n} examples, "
                             f"got {self.settings.examples}")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(cfg.data_seed) * 7919 + 52))
        index = perm[:self.settings.examples].sort().values
        self.x_audit = x[index.to(x.device)]
        self.game = LabelGame(index, num_classes(cfg.dataset),
                              generator=noise_key.generator("label_attack.labels", _public_seed(cfg)))

    def training_labels(self, y: torch.Tensor) -> torch.Tensor:
        return self.game.training_labels(y)

    def run(self, mech, metrics: dict) -> dict[str, float]:
        """The attack on the trained ``mech.model``: the ``label_inference_*`` metrics (docs/metrics.md)."""
        from dpmech.privacy.mia.labels import label_guess_outputs

        t0 = time.perf_counter()
        outputs = label_guess_outputs(mech.model, self.x_audit)      # the attacker's view: inputs and model
        result = self.game.evaluate(outputs, confidence=self.settings.confidence)
        out = {k: float(v) for k, v in result.metrics().items()}
        out["label_attack_seconds"] = round(time.perf_counter() - t0, 3)
        return out


def label_attack_trial(cfg, x, y, noise_key) -> LabelAttackTrial | None:
    """The trial's :class:`LabelAttackTrial`, or None without ``label_attack``."""
    if settings(cfg) is None:
        return None
    return LabelAttackTrial(cfg, x, y, noise_key)
