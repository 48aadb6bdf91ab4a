"""Clipless DP-SGD (Bethune et al., ICLR 2024, Sec. 2 and its Algorithm "Clipless DP-SGD with local
sensitivities"): DP-SGD on a Lipschitz network where each layer's per-example gradient is bounded a
priori (:meth:`LipschitzSequential.gradient_bounds`), so nothing is clipped.

One step t:

* **Sampling**: Poisson, each of the N examples with probability q = batch_size / N, from the secret
  key's sampling stream at step t (:class:`dpmech.privacy.secret.StepStream`, as ``DPSGDTrainer``).
* **Sensitivities**: Delta_i for every layer with parameters, from the current weights (public: the
  result of earlier noisy steps) and the input clip's radius, never from the batch.
* **Gradient**: the plain gradient of the SUM of the per-example losses l_tau (one backward pass, no
  per-example work): its block i moves by at most Delta_i when one example is added or removed.
* **Noise**: block i gets N(0, s_i^2 I), s_i from ``noise_allocation``: ``global`` s_i = sigma
  sqrt(sum_k Delta_k^2) (Abadi et al.'s single sensitivity); ``per_layer`` s_i = sigma sqrt(n) Delta_i
  (each block the same noise-to-bound ratio; lip-dp's "per-layer" strategy). Rescaling block i by 1/s_i
  gives one Gaussian mechanism with unit noise and sensitivity sqrt(sum_i (Delta_i / s_i)^2), i.e.
  effective noise multiplier sigma_eff = 1 / sqrt(sum_i (Delta_i / s_i)^2), which both allocations make
  sigma (computed from the drawn s_i every step, and what the ledger records).
* **Update**: (sum + noise) / B (B the expected batch size), the optimizer, then every layer projected
  back to Lipschitz <= 1 (post-processing).
* **Accounting**: (q, sigma_eff) per step into the :class:`~dpmech.privacy.accounting.PrivacyLedger`
  (RDP and PLD with dp-accounting, the same accountant as DP-SGD); sigma calibrated to the target
  (epsilon, delta) over the planned steps as DP-SGD's (``noise_multiplier_for``).

``check_bound_every`` k > 0 computes the per-example gradients (torch.func) of every k-th batch and
refuses (raises) when one exceeds its bound: a runtime check of the theory, not part of the mechanism.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import torch

from dpmech import _validate as v
from dpmech._validate import matching_checkpoint
from dpmech.lipschitz.loss import LOSS_LIPSCHITZ, tau_cross_entropy
from dpmech.lipschitz.network import LipschitzSequential
from dpmech.privacy.accounting import PrivacyLedger, noise_multiplier_for, subsampled_gaussian_event
from dpmech.privacy.secret import NoiseKey

ALLOCATIONS = ("global", "per_layer")
_SAMPLING, _NOISE = 11, 12   # public stream numbers of the research mode (NoiseKey.reproducible)


class GradientBoundExceeded(RuntimeError):
    """A per-example gradient exceeded its a-priori bound: the sensitivity the noise assumes is wrong."""


@dataclass
class LipschitzDPConfig:
    """Hyperparameters of one clipless DP-SGD run (module docstring)."""

    epsilon: float | None = 3.0          # target epsilon (None: noise_multiplier, or non-private)
    delta: float = 1e-5
    noise_multiplier: float | None = None
    batch_size: int = 256                # expected batch size, q = batch_size / N
    epochs: int = 10
    lr: float = 1e-3
    optimizer: str = "adam"
    tau: float = 8.0                     # temperature of l_tau (loss.py)
    noise_allocation: str = "per_layer"
    check_bound_every: int = 0           # 0: never
    accountant: str = "rdp"
    seed: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        v.epsilon_or_noise(self.epsilon, self.noise_multiplier)
        v.open_unit("delta", self.delta)
        v.positive_int("batch_size", self.batch_size)
        v.positive_int("epochs", self.epochs)
        v.positive("lr", self.lr)
        v.choice("optimizer", self.optimizer, ("adam", "sgd"))
        v.positive("tau", self.tau)
        v.choice("noise_allocation", self.noise_allocation, ALLOCATIONS)
        v.positive_int("check_bound_every", self.check_bound_every, minimum=0)
        v.choice("accountant", self.accountant, ("rdp", "pld"))
        v.positive_int("seed", self.seed, minimum=0)

    @property
    def private(self) -> bool:
        return self.epsilon is not None or self.noise_multiplier is not None


@dataclass(frozen=True)
class LipschitzPlan:
    n: int
    sampling_rate: float
    steps_per_epoch: int
    steps: int
    noise_multiplier: float | None     # None: non-private

    def dp_event(self):
        return subsampled_gaussian_event(self.sampling_rate, self.noise_multiplier or 0.0, self.steps)


def plan(config: LipschitzDPConfig, n: int) -> LipschitzPlan:
    """q = batch_size / n, ceil(n / batch_size) steps per epoch, sigma (given, or calibrated by RDP/PLD)."""
    config.validate()
    n = v.positive_int("train_size", n)
    if config.batch_size > n:
        raise ValueError(f"batch_size: {config.batch_size} exceeds the {n} training examples (q must be <= 1)")
    q = config.batch_size / n
    per_epoch = math.ceil(n / config.batch_size)
    steps = per_epoch * config.epochs
    sigma = config.noise_multiplier
    if config.epsilon is not None:
        sigma = noise_multiplier_for(config.epsilon, config.delta, q, steps, config.accountant)
    return LipschitzPlan(n, q, per_epoch, steps, sigma)


def noise_stds(bounds: list[float], sigma: float, allocation: str) -> list[float]:
    """s_i of the module docstring (times 1 + 1e-9, so that sigma_eff >= sigma despite rounding)."""
    if allocation == "global":
        total = math.sqrt(sum(b * b for b in bounds))
        stds = [sigma * total for _ in bounds]
    else:
        stds = [sigma * math.sqrt(len(bounds)) * b for b in bounds]
    return [s * (1 + 1e-9) for s in stds]


def effective_noise_multiplier(bounds: list[float], stds: list[float]) -> float:
    """sigma_eff = 1 / sqrt(sum_i (Delta_i / s_i)^2): the noise multiplier of the whole step."""
    if any(s <= 0 for s in stds):
        return 0.0
    return 1.0 / math.sqrt(sum((b / s) ** 2 for b, s in zip(bounds, stds)))


def per_example_gradient_norms(model: LipschitzSequential, x: torch.Tensor, y: torch.Tensor,
                               tau: float) -> torch.Tensor:
    """[N, layers]: the l2 norm of each example's gradient of l_tau for each layer with parameters
    (torch.func: vmap of grad over the examples)."""
    from torch.func import functional_call, grad, vmap

    names = [f"{i}.{name}" for i in model.parameterised() for name, _ in model[i].named_parameters()]
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss_one(p, xi, yi):
        return tau_cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0), tau).sum()

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    layer_of = {n: n.split(".")[0] for n in names}
    out = []
    for i in model.parameterised():
        sq = sum(grads[n].flatten(1).pow(2).sum(1) for n in names if layer_of[n] == str(i))
        out.append(sq.sqrt())
    return torch.stack(out, dim=1)


class LipschitzDPTrainer:
    """Clipless DP-SGD on in-memory tensors (module docstring). ``noise_key``: the secret the sampling
    and the noise are drawn from (default a fresh one; ``NoiseKey.reproducible(seed)`` the labelled
    research mode); ``plan_size``: plan q and the steps from this N instead of ``len(x_train)``."""

    def __init__(self, model: LipschitzSequential, x_train: torch.Tensor, y_train: torch.Tensor,
                 config: LipschitzDPConfig, *, device: str | torch.device = "cpu", plan_size: int | None = None,
                 noise_key: NoiseKey | None = None):
        if not isinstance(model, LipschitzSequential):
            raise ValueError(f"model: must be a dpmech.lipschitz LipschitzSequential, got {type(model).__name__}")
        if not isinstance(config, LipschitzDPConfig):
            raise ValueError(f"config: must be a LipschitzDPConfig, got {type(config).__name__}")
        if not (torch.is_tensor(x_train) and torch.is_tensor(y_train) and x_train.dim() >= 2
                and y_train.dim() == 1 and x_train.shape[0] == y_train.shape[0]):
            raise ValueError("x_train: must be a tensor [N, ...] with N labels in y_train")
        self.config = config
        self.device = torch.device(device)
        self.x, self.y = x_train.to(self.device), y_train.to(self.device)
        self.plan = plan(config, int(plan_size if plan_size is not None else x_train.shape[0]))
        self.model = model.to(self.device)
        self.model.project_()
        params = list(self.model.parameters())
        self.optimizer = (torch.optim.Adam(params, lr=config.lr) if config.optimizer == "adam"
                          else torch.optim.SGD(params, lr=config.lr, momentum=0.9))
        self.noise_key = NoiseKey.resolve(noise_key)
        self.sample_stream = self.noise_key.step_stream("lipschitz.sampling", config.seed * 1000 + _SAMPLING)
        self.noise_stream = self.noise_key.step_stream("lipschitz.noise", config.seed * 1000 + _NOISE, self.device)
        self.ledger = PrivacyLedger()
        self.epoch = 0
        self.steps = 0
        self.last_bounds: list[float] = []
        self.last_stds: list[float] = []

    @property
    def noise_multiplier(self) -> float:
        return float(self.plan.noise_multiplier or 0.0)

    def poisson_batch(self) -> torch.Tensor:
        gen = self.sample_stream.at(self.steps)
        mask = torch.rand(self.x.shape[0], generator=gen) < self.plan.sampling_rate
        return torch.nonzero(mask, as_tuple=False).squeeze(1).to(self.device)

    def train_step(self) -> tuple[int, float, int]:
        """One step on a fresh Poisson sample; (batch size, summed loss, correct)."""
        return self._step(self.poisson_batch())

    def _step(self, idx: torch.Tensor) -> tuple[int, float, int]:
        cfg, model = self.config, self.model
        model.train()
        bounds = model.gradient_bounds(LOSS_LIPSCHITZ)                   # from the weights, not the batch
        layers = model.parameterised()
        self.optimizer.zero_grad(set_to_none=False)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        loss_sum, correct = 0.0, 0
        if idx.numel():
            xb, yb = self.x[idx], self.y[idx]
            if cfg.check_bound_every and self.steps % cfg.check_bound_every == 0:
                self.check_bounds(xb, yb, bounds)
            logits = model(xb)
            losses = tau_cross_entropy(logits, yb, cfg.tau)
            losses.sum().backward()                                       # the sum of per-example gradients
            loss_sum, correct = float(losses.detach().sum()), int((logits.argmax(1) == yb).sum())
        sigma_eff = 0.0
        if cfg.private and self.noise_multiplier > 0:
            stds = noise_stds(bounds, self.noise_multiplier, cfg.noise_allocation)
            sigma_eff = effective_noise_multiplier(bounds, stds)
            if sigma_eff < self.noise_multiplier * (1 - 1e-12):          # never record more than was drawn
                raise RuntimeError(f"noise: effective multiplier {sigma_eff} below the planned {self.noise_multiplier}")
            gen = self.noise_stream.at(self.steps)
            for i, s in zip(layers, stds):
                for p in model[i].parameters(recurse=False):
                    p.grad.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype), alpha=s)
            self.last_stds = stds
        self.last_bounds = bounds
        for p in model.parameters():
            p.grad.div_(cfg.batch_size)
        self.optimizer.step()
        model.project_()
        self.steps += 1
        self.ledger.record(self.plan.sampling_rate, self.noise_multiplier if sigma_eff else 0.0, 1)
        return int(idx.numel()), loss_sum, correct

    def check_bounds(self, xb: torch.Tensor, yb: torch.Tensor, bounds: list[float] | None = None) -> torch.Tensor:
        """Per-example gradient norms of the batch against the bounds; raises GradientBoundExceeded."""
        bounds = self.model.gradient_bounds(LOSS_LIPSCHITZ) if bounds is None else bounds
        norms = per_example_gradient_norms(self.model, xb, yb, self.config.tau)
        limit = torch.tensor(bounds, dtype=norms.dtype, device=norms.device) * (1 + 1e-5)
        over = norms > limit
        if bool(over.any()):
            worst = float((norms / limit).max())
            raise GradientBoundExceeded(f"gradient: a per-example gradient is {worst:.4f} times its a-priori bound; "
                                        "the noise would not cover the sensitivity (refused)")
        return norms

    def train_epoch(self) -> dict[str, float]:
        total, loss_sum, correct = 0, 0.0, 0
        for _ in range(self.plan.steps_per_epoch):
            n_b, l_b, c_b = self.train_step()
            total, loss_sum, correct = total + n_b, loss_sum + l_b, correct + c_b
        self.epoch += 1
        return {"train_loss": loss_sum / max(total, 1), "train_acc": correct / max(total, 1),
                "batch_size_mean": total / self.plan.steps_per_epoch}

    def fit(self) -> "LipschitzDPTrainer":
        while self.epoch < self.config.epochs:
            self.train_epoch()
        return self

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
        self.model.eval()
        correct = sum(int((self.model(x[s:s + batch_size].to(self.device)).argmax(1).cpu() == y[s:s + batch_size].cpu())
                          .sum()) for s in range(0, x.shape[0], batch_size))
        return correct / max(x.shape[0], 1)

    def privacy(self) -> dict[str, float]:
        """(epsilon, delta) of the steps taken (RDP, and PLD as epsilon_pld), q, sigma, steps."""
        d = float(self.config.delta)
        return {"epsilon": self.ledger.epsilon(d, "rdp"), "epsilon_pld": self.ledger.epsilon(d, "pld"), "delta": d,
                "noise_multiplier": self.noise_multiplier if self.config.private else 0.0,
                "sampling_rate": float(self.plan.sampling_rate), "steps": float(self.ledger.steps)}

    def state_dict(self) -> dict:
        """Model, optimizer, ledger and counters; no generator state with a secret key (the draws of
        step t follow from the key and t); the research mode's running generator states."""
        streams = {k: st for k, st in (("sample_gen", self.sample_stream.state_dict()),
                                       ("noise_gen", self.noise_stream.state_dict())) if st is not None}
        return copy.deepcopy({"config": asdict(self.config), "model": self.model.state_dict(),
                              "optimizer": self.optimizer.state_dict(), "ledger": self.ledger.state_dict(),
                              "epoch": self.epoch, "steps": self.steps, **streams})

    def load_state_dict(self, state: dict) -> None:
        matching_checkpoint(state["config"], asdict(self.config))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.sample_stream.load_state_dict(state.get("sample_gen"), "sample_gen")
        self.noise_stream.load_state_dict(state.get("noise_gen"), "noise_gen")
        self.ledger.load_state_dict(state["ledger"])
        self.epoch, self.steps = int(state["epoch"]), int(state["steps"])
