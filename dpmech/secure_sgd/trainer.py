"""SecureSGD (Phan et al., IJCAI 2019, "Heterogeneous Gaussian Mechanism: Preserving Differential
Privacy in Deep Learning with Provable Robustness") and SecureSGD-AGM.

Two guarantees, from two noises (docs/secure_sgd.md):

* **Robustness (PixelDP, Lecuyer et al. 2018).** A noise layer after a sensitivity-bounded first
  layer (or on the input), calibrated to (robustness_epsilon, robustness_delta, L, Delta). With
  ``mechanism="hgm"`` the noise is the heterogeneous Gaussian mechanism of ``dpmech.secure_sgd.hgm``:
  N(0, sigma^2 r) with sigma from Theorem 1 at the sensitivity of the whitened pre-noise layer
  diag(r)^(-1/2) g (Sec. 3 of the paper; r = 1 unless redistributed); with ``mechanism="agm"``
  it is N(0, sigma^2) with the analytic Gaussian sigma (Balle & Wang 2018). Certified with the
  PixelDP test (``dpmech.robustness.certification``) on the whitened model.
* **Privacy of the training data (DP-SGD, Abadi et al. 2016; the paper's Alg. 1 trains with
  clipped, noised per-example gradients).** Poisson-sampled batches, per-example clipping to C,
  N(0, (sigma_g C)^2) noise on the sum, with the noise multiplier sigma_g calibrated from the
  target (epsilon, delta) and every step recorded in a ``PrivacyLedger``; the reported epsilon is
  the ledger's (RDP and PLD), the same for both mechanisms (the HGM/AGM choice changes the
  robustness noise only). The engine is ``dpmech.dpsgd.trainer``.

The noise layer draws fresh noise in every forward pass, at training and at prediction time,
from the model's own generators (``dpmech.robustness.noise_layer.NoiseLayer``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer
from dpmech.secure_sgd.hgm import DELTA_MAX, MECHANISMS, mechanism_sigma
from dpmech.networks.pixeldp import PixelDPNet
from dpmech.robustness.noise_layer import BoundedConv2d, NoiseLayer
from dpmech.pixeldp.trainer import guarantee_epsilon
from dpmech._validate import matching_checkpoint

__all__ = [
    "SecureSGDConfig",
    "SecureSGDTrainer",
    "HeterogeneousNoiseLayer",
    "build_secure_sgd_model",
    "robustness_noise_scale",
    "whitened_sensitivity",
    "NoiseFree",
]


class HeterogeneousNoiseLayer(NoiseLayer):
    """PixelDP noise layer drawing N(0, scale^2 r) (the HGM's heterogeneous noise).

    ``r`` (a buffer shaped like one feature map, saved in the model's state dict) is the
    redistribution vector, all ones by default (then this is the plain Gaussian noise layer).
    ``scale`` is the base sigma of the whitened mechanism; the certifier sees ``scale`` and the
    whitened sensitivity, which is exactly the PixelDP model diag(r)^(-1/2) g -> + N(0, scale^2)
    -> post-processing by diag(r)^(1/2) (docs/secure_sgd.md).
    """

    def __init__(self, scale: float, feature_shape: tuple[int, ...], seed: int = 0):
        super().__init__(scale, "l2", seed)
        self.register_buffer("r", torch.ones(tuple(feature_shape)))

    @property
    def homogeneous(self) -> bool:
        return bool(torch.all(self.r == 1))

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.homogeneous else f", heterogeneous r in [{float(self.r.min()):.3g}, {float(self.r.max()):.3g}]")

    def sample_shape(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        z = super().sample_shape(shape, dtype, device)
        if self.homogeneous:
            return z
        if tuple(shape[len(shape) - self.r.dim():]) != tuple(self.r.shape):
            raise ValueError(f"noise of shape {tuple(shape)} does not end with r's shape {tuple(self.r.shape)}")
        return z.mul_(self.r.to(device=device, dtype=dtype).sqrt())


def robustness_noise_scale(mechanism: str, epsilon: float, delta: float, attack_bound: float,
                           sensitivity: float = 1.0) -> float:
    """Base sigma of the noise layer: ``mechanism`` ('hgm': Phan et al. Theorem 1; 'agm': Balle &
    Wang) for the L2 sensitivity ``sensitivity * attack_bound`` (PixelDP Sec. 3.2, with the
    whitened sensitivity for heterogeneous noise)."""
    attack_bound = v.positive("attack_bound", attack_bound)
    sensitivity = v.positive("sensitivity", sensitivity)
    return mechanism_sigma(mechanism, epsilon, delta, sensitivity * attack_bound)


def _feature_shape(model: PixelDPNet) -> tuple[int, ...]:
    with torch.no_grad():
        return tuple(model.pre_noise(torch.zeros(1, *model.input_shape)).shape[1:])


def build_secure_sgd_model(dataset: str, *, mechanism: str, epsilon: float, delta: float,
                           attack_bound: float, noise_after: int = 1, seed: int = 0) -> PixelDPNet:
    """The PixelDP network of ``dataset`` (``dpmech.networks.pixeldp``) with a ``HeterogeneousNoiseLayer``
    calibrated by ``mechanism`` for the construction bound Delta = 1 and r = 1.

    Every ReLU is made out-of-place: Opacus's per-sample gradient hooks refuse in-place
    operations on the tensors they observe.
    """
    v.choice("mechanism", mechanism, MECHANISMS)
    scale = robustness_noise_scale(mechanism, epsilon, delta, attack_bound, 1.0)
    from dpmech.pixeldp.trainer import pixeldp_network

    model = pixeldp_network(dataset, scale, norm="l2", noise_after=noise_after, seed=seed)
    model.noise = HeterogeneousNoiseLayer(scale, _feature_shape(model), seed=seed)
    for m in model.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    return model


@torch.no_grad()
def whitened_sensitivity(model: PixelDPNet) -> float:
    """L2 operator norm of diag(r)^(-1/2) g (g the pre-noise part), exact up to float64 rounding.

    noise on the input (g = identity): 1 / sqrt(min r); after a ``BoundedConv2d``: the largest
    singular value of the whitened convolution's dense matrix. Never above the construction
    bound 1 / sqrt(min r) (returned as the minimum of the two).
    """
    r = model.noise.r.double()
    bound = 1.0 / math.sqrt(float(r.min()))
    if model.noise_after == 0:
        return bound
    layer = model.first
    if not isinstance(layer, BoundedConv2d):
        raise ValueError("the pre-noise layer must be a BoundedConv2d")
    shape = tuple(model.input_shape)
    d = math.prod(shape)
    if d > 4096:
        raise ValueError(f"input_shape must have at most 4096 entries for the dense computation, got {d}")
    device = layer.weight.device
    basis = torch.eye(d, dtype=torch.float64, device=device).reshape(d, *shape)
    out = F.conv2d(basis, layer.normalised_weight().double(), None, layer.stride, layer.padding)
    out = out / r.to(device).sqrt()
    m = out.reshape(d, -1)
    exact = float(torch.linalg.eigvalsh(m @ m.T)[-1].clamp_min(0).sqrt())
    return min(bound, exact)


class NoiseFree(nn.Module):
    """The base classifier of randomized smoothing: ``model`` without its noise layer
    (post_noise(pre_noise(x))), for a model whose noise sits on the input."""

    def __init__(self, model: PixelDPNet):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.post_noise(self.model.pre_noise(x))


# ----------------------------------------------------------------------------- the trainer

@dataclass
class SecureSGDConfig:
    """Hyperparameters of one SecureSGD run: the DP-SGD part (training-data privacy) and the noise
    layer (robustness). Defaults: the PixelDP MNIST CNN, delta 1e-5, L = 0.1."""

    dataset: str = "mnist"
    mechanism: str = "hgm"               # hgm (SecureSGD) | agm (SecureSGD-AGM): robustness noise calibration
    # training-data privacy (DP-SGD; the ledger's epsilon is reported)
    epsilon: float | None = 2.0          # target epsilon of DP-SGD (None: noise_multiplier as given)
    noise_multiplier: float | None = None  # explicit DP-SGD sigma instead of a target epsilon
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    batch_size: int = 256                # expected Poisson batch size
    epochs: int = 5
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    clipping: str = "ghost"
    accountant: str = "rdp"
    # robustness (the PixelDP noise layer)
    robustness_epsilon: float = 1.0      # eps_r of the noise layer
    robustness_delta: float = 0.05       # delta_r of the noise layer
    attack_bound: float = 0.1            # construction attack bound L ([-1, 1] domain)
    noise_after: int = 1                 # 0: noise on the input; 1: after the bounded first conv
    seed: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        from dpmech.datasets.splits import check_dataset

        check_dataset(self.dataset)
        v.choice("mechanism", self.mechanism, MECHANISMS)
        v.positive("robustness_epsilon", self.robustness_epsilon)
        v.open_unit("robustness_delta", self.robustness_delta)
        if self.mechanism == "hgm":
            if self.robustness_delta >= DELTA_MAX:
                raise ValueError(f"robustness_delta must be < sqrt(2/pi) for the HGM bound, got {self.robustness_delta}")
        v.positive("attack_bound", self.attack_bound)
        if isinstance(self.noise_after, bool) or self.noise_after not in (0, 1):
            raise ValueError(f"noise_after must be 0 or 1, got {self.noise_after!r}")
        if self.epsilon is None and self.noise_multiplier is None:
            raise ValueError("epsilon: SecureSGD needs a target epsilon or a noise_multiplier (it is never non-private)")
        self.dpsgd_config()  # validates the DP-SGD keys

    def dpsgd_config(self) -> DPSGDConfig:
        return DPSGDConfig(epsilon=self.epsilon, noise_multiplier=self.noise_multiplier, delta=self.delta, max_grad_norm=self.max_grad_norm,
                           batch_size=self.batch_size, epochs=self.epochs, lr=self.lr, optimizer=self.optimizer,
                           momentum=self.momentum, weight_decay=self.weight_decay, clipping=self.clipping,
                           accountant=self.accountant, seed=self.seed)

    @property
    def noise_scale(self) -> float:
        """Base sigma of the noise layer for the construction bound Delta = 1, r = 1."""
        return robustness_noise_scale(self.mechanism, self.robustness_epsilon, self.robustness_delta,
                                      self.attack_bound, 1.0)

    def to_dict(self) -> dict:
        return asdict(self)


class SecureSGDTrainer(DPSGDTrainer):
    """DP-SGD (``dpmech.dpsgd.trainer``) on a PixelDP network whose noise layer is calibrated by the HGM
    or the AGM. The noise layer draws fresh noise in every training forward pass (from its own
    generators, checkpointed with the rest); the privacy of the training data is the ledger's."""

    def __init__(self, config: SecureSGDConfig, x_train: torch.Tensor, y_train: torch.Tensor, *,
                 device: str | torch.device = "cpu", plan_size: int | None = None, canaries=None,
                 noise_key=None):
        config.validate()
        self.secure_config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)  # parameter initialisation, without touching the global RNG
            model = build_secure_sgd_model(config.dataset, mechanism=config.mechanism,
                                           epsilon=config.robustness_epsilon, delta=config.robustness_delta,
                                           attack_bound=config.attack_bound, noise_after=config.noise_after,
                                           seed=config.seed + 1)
        if tuple(model.input_shape) != tuple(x_train.shape[1:]):
            raise ValueError(f"x_train images must have shape {model.input_shape}, got {tuple(x_train.shape[1:])}")
        super().__init__(model, x_train, y_train, config.dpsgd_config(), device=device, plan_size=plan_size,
                         canaries=canaries, noise_key=noise_key)

    # -------------------------------------------------------------- redistribution
    def set_redistribution(self, r: torch.Tensor) -> float:
        """Use the redistribution vector ``r`` (shape of one feature map, r > 0, sum = K; see
        ``dpmech.secure_sgd.hgm.redistribution_vector``) and re-calibrate the base sigma for the whitened
        construction bound L / sqrt(min r) (Phan et al.'s heterogeneous mechanism, sound
        reading). Returns the new base sigma.

        ``r`` must not depend on the training data beyond what the ledger accounts for (e.g. a
        data-independent choice, or a function of the DP-trained parameters): the reference
        implementation's r, computed from raw training gradients, is not offered (docs/secure_sgd.md).
        """
        noise = self.model.noise
        r = torch.as_tensor(r, dtype=noise.r.dtype, device=noise.r.device)
        if tuple(r.shape) != tuple(noise.r.shape):
            raise ValueError(f"r must have shape {tuple(noise.r.shape)}, got {tuple(r.shape)}")
        if not torch.isfinite(r).all() or (r <= 0).any():
            raise ValueError("r must be finite and > 0 everywhere")
        k = r.numel()
        if abs(float(r.double().sum()) - k) > 1e-4 * k:
            raise ValueError(f"r must sum to its number of entries {k} (the total noise variance is kept), got {float(r.sum())}")
        cfg = self.secure_config
        noise.r.copy_(r)
        noise.scale = robustness_noise_scale(cfg.mechanism, cfg.robustness_epsilon, cfg.robustness_delta,
                                             cfg.attack_bound, 1.0 / math.sqrt(float(r.min())))
        return float(noise.scale)

    # -------------------------------------------------------------- guarantees
    def robustness(self) -> dict[str, float]:
        """The PixelDP guarantee of the noise layer, recomputed from the noise actually used and
        the exactly measured whitened sensitivity: robustness_epsilon is the smallest eps for which
        N(0, noise_scale^2) on a pre-noise part of that sensitivity is (eps, robustness_delta)-DP
        against attacks of size L (exact Gaussian profile; at most the configured eps_r)."""
        cfg = self.secure_config
        scale = float(self.model.noise.scale)
        sens = whitened_sensitivity(self.model)
        eps = guarantee_epsilon(scale, cfg.attack_bound, sens, cfg.robustness_delta, "l2")
        return {"robustness_epsilon": eps, "robustness_delta": float(cfg.robustness_delta),
                "attack_bound": float(cfg.attack_bound), "noise_scale": scale, "sensitivity": sens}

    def privacy(self) -> dict[str, float]:
        """Training-data (epsilon, delta) from the ledger (RDP; PLD as epsilon_pld) and the
        robustness parameters under their own names."""
        return {**super().privacy(), **self.robustness()}

    def smoothing_classifier(self):
        """(base model, sigma) for randomized smoothing when the noise is isotropic Gaussian on the
        input (noise_after = 0, r = 1); None otherwise."""
        noise = self.model.noise
        if self.secure_config.noise_after != 0 or not noise.homogeneous:
            return None
        return NoiseFree(self.model), float(noise.scale)

    # -------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["secure_config"] = self.secure_config.to_dict()
        state["noise_scale"] = float(self.model.noise.scale)
        state["noise_layer_gen"] = [s.clone() for s in self.model.noise.get_rng_state(self.device)]
        return state

    def load_state_dict(self, state: dict) -> None:
        matching_checkpoint(state.get("secure_config"), self.secure_config.to_dict())
        super().load_state_dict(state)
        self.model.noise.scale = float(state["noise_scale"])
        self.model.noise.set_rng_state(self.device, state["noise_layer_gen"])
