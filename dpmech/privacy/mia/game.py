"""The membership game, stated explicitly (docs/mia.md, "The game").

Carlini et al. (2022), Sec. III-A, Definition 1 (the membership inference security game), in its
many-candidates form (the one Steinke, Nasr & Jagielski 2023 audit in one run):

1. A pool of n candidates (x_i, y_i) is drawn from one distribution (the caller's pool: e.g. n
   examples of one split, chosen by the trial's public seed).
2. For each candidate a fair coin S_i, from a generator the caller passes in and the attack code never
   receives (the owner's secret: ``NoiseKey.generator("mia.membership", seed)``; the research mode's
   ``NoiseKey.reproducible(seed)`` for tests). S_i = 1 puts the candidate in the training set, S_i = 0
   holds it out, so members and non-members are one distribution split by a coin.
3. The target is trained on the members (:meth:`MembershipGame.members`; the training function, as
   the mechanism being attacked, necessarily sees them).
4. The attack receives an :class:`AttackView`: the candidates' inputs and labels, the target's logits on
   them, and a query oracle of the target (its logits on any other input, e.g. population samples).
   It returns one score per candidate (higher = "more likely a member").
5. :meth:`MembershipGame.evaluate` compares the scores with S (dpmech.privacy.mia.metrics).

The membership vector lives only in the :class:`MembershipGame` (a slotted attribute, no accessor);
the view holds no reference to the game or to the vector (a test walks every object reachable from a
view and finds neither), and reading anything else from a view raises :class:`MembershipHidden`. This
stops an attack, or a caller wiring one, from reading the answer by mistake; it is not a sandbox
against hostile code in the same process (which could walk the interpreter's heap).
"""

from __future__ import annotations

import numpy as np
import torch

from dpmech import _validate as v


class MembershipHidden(AttributeError):
    """An attack asked an :class:`AttackView` for something it does not hold (the membership above all)."""


@torch.no_grad()
def batched_outputs(model, x: torch.Tensor, batch_size: int, who: str = "target") -> torch.Tensor:
    """``model``'s outputs [N, classes] on ``x`` in batches of ``batch_size``: eval mode for the
    duration (restored after), no gradients, on the model's device, returned as float on the CPU.
    ``who`` names the caller in the one-line error on a malformed input or output."""
    if not callable(model):
        raise ValueError(f"{who}: the model must be callable (inputs -> logits), got {type(model).__name__}")
    if not torch.is_tensor(x) or x.dim() < 2:
        raise ValueError(f"{who}: x must be a tensor [N, ...], got {type(x).__name__}")
    training = getattr(model, "training", None)
    if training:
        model.eval()
    try:
        first = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
        device = first.device if first is not None else x.device
        out = [model(x[i:i + batch_size].to(device)).detach().float().cpu() for i in range(0, x.shape[0], batch_size)]
    finally:
        if training:
            model.train()
    logits = torch.cat(out) if out else torch.empty(0)
    if logits.dim() != 2 or logits.shape[0] != x.shape[0]:
        raise ValueError(f"{who}: expected outputs [N, classes] for {x.shape[0]} inputs, got {tuple(logits.shape)}")
    return logits


class _TargetOracle:
    """Black-box access to the target: logits of a batch of inputs (eval mode, no gradients)."""

    __slots__ = ("_model", "_batch_size")

    def __init__(self, model, batch_size: int):
        if not callable(model):
            raise ValueError(f"target must be a callable model (inputs -> logits), got {type(model).__name__}")
        self._model = model
        self._batch_size = batch_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(x) or x.dim() < 2:
            raise ValueError(f"query: x must be a tensor [N, ...], got {type(x).__name__}")
        logits = batched_outputs(self._model, x, self._batch_size, "target")
        if not torch.isfinite(logits).all():
            raise ValueError("target: its logits must be finite")
        return logits


class AttackView:
    """What an attack sees: the candidates (``x``, ``y``), the target's logits on them
    (``target_logits``) and ``query(x)``, the target's logits on other inputs. Nothing else: no
    membership, no game, no training set."""

    __slots__ = ("_x", "_y", "_logits", "_oracle")

    def __init__(self, x: torch.Tensor, y: torch.Tensor, oracle: _TargetOracle):
        self._x = x
        self._y = y
        self._oracle = oracle
        self._logits = oracle(x)

    @property
    def x(self) -> torch.Tensor:
        """The candidates' inputs (a copy: editing it changes nothing the game holds)."""
        return self._x.clone()

    @property
    def y(self) -> torch.Tensor:
        return self._y.clone()

    @property
    def num_candidates(self) -> int:
        return int(self._x.shape[0])

    @property
    def target_logits(self) -> torch.Tensor:
        """The target's logits on the candidates, [n, classes]."""
        return self._logits.clone()

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """The target's logits on ``x`` (e.g. RMIA's population samples z)."""
        return self._oracle(x)

    def __getattr__(self, name: str):
        # only reached for names that are not attributes of the view
        raise MembershipHidden(f"AttackView has no {name!r}: an attack sees the candidates' inputs and labels and the "
                               "target's outputs; the membership is held by the MembershipGame and never given to "
                               "the attack")

    def __repr__(self) -> str:
        return f"AttackView({self.num_candidates} candidates)"

    def __reduce__(self):
        raise TypeError("AttackView: not picklable (it wraps the target model; pass scores, not views)")


class MembershipGame:
    """n candidates, each a member of the target's training set by a fair coin drawn from
    ``generator`` (a ``torch.Generator`` the attack never sees).

    ``members()`` -> the training set; ``attack_view(target)`` -> what the attack sees;
    ``evaluate(scores, delta=...)`` -> the figures (:class:`dpmech.privacy.mia.metrics.MiaResult`).
    """

    __slots__ = ("_x", "_y", "_included")

    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, generator: torch.Generator):
        if not torch.is_tensor(x) or not torch.is_tensor(y) or x.dim() < 2 or y.dim() != 1 or x.shape[0] != y.shape[0]:
            raise ValueError("candidates: x must be a tensor [n, ...] and y a tensor [n] of labels, got "
                             f"{getattr(x, 'shape', type(x).__name__)} and {getattr(y, 'shape', type(y).__name__)}")
        n = x.shape[0]
        if n < 4:
            raise ValueError(f"candidates: need at least 4 (members and non-members, 2 of each), got {n}")
        if not isinstance(generator, torch.Generator):
            raise ValueError("generator: the membership coins need an explicit torch.Generator (the owner's secret, "
                             f"e.g. NoiseKey.generator('mia.membership', seed)), got {type(generator).__name__}")
        if generator.device.type != "cpu":
            raise ValueError(f"generator: must be a CPU generator, got one on {generator.device}")
        self._x = x.detach().clone()
        self._y = y.detach().clone()
        included = (torch.rand(n, generator=generator) < 0.5).numpy()
        included.setflags(write=False)
        self._included = included

    @property
    def num_candidates(self) -> int:
        return int(self._x.shape[0])

    @property
    def expected_members(self) -> int:
        """n // 2: the public training-set size to plan a DP trainer from (``DPSGDTrainer(plan_size=)``),
        so that the sampling rate does not depend on the draw."""
        return self.num_candidates // 2

    def members(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's training set: the candidates whose coin came up 1 (in candidate order)."""
        idx = torch.from_numpy(np.flatnonzero(self._included))
        return self._x[idx].clone(), self._y[idx].clone()

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All n candidates (inputs, labels), members or not."""
        return self._x.clone(), self._y.clone()

    def attack_view(self, target, *, batch_size: int = 1024) -> AttackView:
        """What the attack may see of the target trained on :meth:`members`."""
        batch_size = v.positive_int("batch_size", batch_size)
        return AttackView(self._x.clone(), self._y.clone(), _TargetOracle(target, batch_size))

    def evaluate(self, scores, *, delta: float, confidence: float = 0.95, attack: str = "", references: int = 0,
                 **kwargs):
        """The attack's figures against the membership (:func:`dpmech.privacy.mia.metrics.evaluate_scores`;
        ``fpr_levels`` and ``guess_fractions`` pass through)."""
        from dpmech.privacy.mia.metrics import evaluate_scores

        return evaluate_scores(scores, self._included, attack=attack, references=references, delta=delta,
                               confidence=confidence, **kwargs)

    def __repr__(self) -> str:
        return f"MembershipGame({self.num_candidates} candidates)"

    def __reduce__(self):
        raise TypeError("MembershipGame: not picklable (it holds the membership draw; keep it in the trial's process)")
