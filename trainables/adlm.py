"""The ``adlm`` trainable: the Adaptive Laplace Mechanism (Phan, Wu, Hu & Dou, ICDM 2017) under Ray Tune.

Every key and its default: ``AdLMTrialConfig`` below (``dpsweep mechanisms``). The mechanism itself is
``dpmech.adlm``; the decisions it takes, and what its epsilon does and does not mean, are in docs/adlm.md.

Evaluation: the default conventional accuracy (``acc_clean``, ``acc_<attack>_<size>``) of the released
classifier f(clip(x + chi / |L|)); AdLM has no robustness certificate (``certify`` returns None).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from dpmech.adlm.trainer import AdLMTrainer
from trainables.config import CommonConfig
from trainables.entry import TrainableEntry
from trainables.runtime import TrainerMechanism, run_trial


class AdLMTrialConfig(CommonConfig):
    """AdLM (docs/adlm.md): relevance-adaptive Laplace noise on the first affine transformation and a
    functional-mechanism loss; epsilon = eps_1 + eps_2 + eps_3 (the paper's accounting)."""

    dataset: Literal["mnist", "fashion_mnist"] = Field("mnist", description="dataset, inputs scaled to [-1, 1] (AdLM: 28x28 grey images)")
    epsilon: float = Field(1.0, gt=0, allow_inf_nan=False,
                           description="total budget eps_1 + eps_2 + eps_3 of the paper's Theorem (relevance + features + loss)")
    budget_split: list[float] = Field(
        default_factory=lambda: [1 / 3, 1 / 3, 1 / 3], min_length=3, max_length=3,
        description="fractions of epsilon for the relevance, the features and the loss (the paper: equal thirds)")
    relevance_source: Literal["public", "training"] = Field(
        "public", description="data the LRP network is trained on: held-out public examples, or the training set "
        "(as the reference; not covered by epsilon)")
    relevance_public_size: int = Field(5000, gt=0, description="held-out examples the LRP network is trained on (public source)")
    relevance_norm: Literal["linf", "l1"] = Field(
        "linf", description="per-example relevance normalisation: linf (the paper's Delta_R = 2d/N) or l1 (2/N)")
    relevance_epochs: int = Field(2, ge=0, description="epochs of non-private training of the LRP network")
    lrp_epsilon: float = Field(1.0, gt=0, allow_inf_nan=False, description="stabiliser of the LRP-epsilon rule (the reference: 1)")
    loss_sensitivity: Literal["labels", "paper"] = Field(
        "labels", description="Delta_L scaling the loss noise: labels (2 |h_pi|) or paper (the reference's K (|h_pi| + |h_pi|^2/4))")
    beta_min: float = Field(0.01, gt=0, lt=1, description="floor of the budget redistribution vector beta (fraction of the uniform share)")
    input_clip: float = Field(10.0, gt=0, allow_inf_nan=False, description="perturbed inputs clipped to [-clip, clip] (the reference: 10)")
    epochs: int = Field(10, gt=0, description="training epochs")
    batch_size: int = Field(1800, gt=0, description="|L|: batch size; the per-example input noise is Lap(b_j) / |L|")
    lr: float = Field(5e-4, gt=0, allow_inf_nan=False, description="Adam learning rate")
    attack_norm: Literal["linf", "l2"] = Field("linf", description="norm of the attack ball")
    certify_images: int = Field(0, ge=0, description="AdLM has no robustness certificate; any value certifies nothing")

    # the paper's epsilon is claimed for the training examples; the audit can test that claim (docs/adlm.md)
    protects_training_examples: ClassVar[bool] = True

    def smoothing_unavailable(self) -> str | None:
        return "AdLM's model has Laplace noise drawn once on its input, not fresh Gaussian noise"

    @model_validator(mode="after")
    def _mechanism_rules(self):
        """Cross-key rules (the same as ``dpmech.adlm.config.AdLMConfig.validate``, without importing torch)."""
        if any(f <= 0 for f in self.budget_split) or abs(sum(self.budget_split) - 1.0) > 1e-9:
            raise ValueError(f"budget_split must hold 3 positive fractions adding up to 1, got {self.budget_split}")
        if self.train_size is not None and self.batch_size > self.train_size:
            raise ValueError(f"batch_size must be <= train_size ({self.train_size}), got {self.batch_size}")
        return self


def adlm_config(cfg: AdLMTrialConfig):
    """The dpmech configuration (``dpmech.adlm.config.AdLMConfig``) of a trial."""
    from dpmech.adlm.config import AdLMConfig

    return AdLMConfig(
        dataset=cfg.dataset, epsilon=cfg.epsilon,
        budget_split=tuple(cfg.budget_split), relevance_source=cfg.relevance_source, relevance_norm=cfg.relevance_norm,
        relevance_epochs=cfg.relevance_epochs, lrp_epsilon=cfg.lrp_epsilon, loss_sensitivity=cfg.loss_sensitivity,
        beta_min=cfg.beta_min,
        input_clip=cfg.input_clip, batch_size=cfg.batch_size, lr=cfg.lr, epochs=cfg.epochs, seed=cfg.seed)


def public_relevance_data(cfg: AdLMTrialConfig, x_train):
    """``relevance_public_size`` examples in neither the training nor the evaluation subset (the pool the
    privacy audit also draws from), minus any image that equals a training input (an included audit
    canary), chosen with ``data_seed``; returns (x, y) tensors."""
    import torch

    from dpmech.datasets.splits import load_held_out, subset_indices

    try:
        pool = load_held_out(cfg.dataset, train_size=cfg.train_size, test_size=cfg.test_size, seed=cfg.data_seed)
    except ValueError:
        raise ValueError("relevance_source: 'public' needs held-out examples; set train_size or test_size below "
                         "the split's size (or use relevance_source: training)") from None
    px, py = pool.tensors
    train_rows = {bytes(r) for r in x_train.detach().cpu().flatten(1).numpy()}
    keep = torch.tensor([bytes(r) not in train_rows for r in px.flatten(1).numpy()], dtype=torch.bool)
    px, py = px[keep], py[keep]
    if px.shape[0] < cfg.relevance_public_size:
        raise ValueError(f"relevance_public_size: only {px.shape[0]} held-out examples are available, "
                         f"got {cfg.relevance_public_size}")
    idx = torch.from_numpy(subset_indices(px.shape[0], cfg.relevance_public_size, cfg.data_seed))
    return px[idx], py[idx]


class AdLMMechanism(TrainerMechanism):
    """Adapter from the trial config to ``dpmech.adlm.trainer.AdLMTrainer``."""

    def __init__(self, cfg: AdLMTrialConfig, x, y, device, noise_key=None):
        rel = public_relevance_data(cfg, x) if cfg.relevance_source == "public" else None
        if rel is not None:
            rel = tuple(t.to(device) for t in rel)
        self.trainer = AdLMTrainer(adlm_config(cfg), x, y, relevance_data=rel, device=device, noise_key=noise_key)

    def extra_artifacts(self, directory):
        """``adlm/relevance.png``: the released (noisy) average relevance R_bar and the per-pixel input noise
        scale b_j / |L| (log scale); both are outputs of the mechanism, not training examples."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t = self.trainer
        rel = t.relevance[0].numpy()
        scale = (t.scales_features[0] / t.config.batch_size).log10().numpy()
        fig, axes = plt.subplots(1, 2, figsize=(7, 3.2), dpi=110)
        for ax, img, title in ((axes[0], rel, "released relevance R_bar"),
                               (axes[1], scale, "log10 input noise scale")):
            im = ax.imshow(img, cmap="viridis")
            ax.set_title(title, fontsize=9)
            ax.axis("off")
            fig.colorbar(im, ax=ax, fraction=0.046)
        fig.tight_layout()
        path = directory / "relevance.png"
        fig.savefig(path)
        plt.close(fig)
        return [(path, "adlm")]


def adlm(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable for AdLM (flat config; see the module docstring)."""
    run_trial(config, AdLMTrialConfig, AdLMMechanism, "adlm", noise_key=noise_key)


TRAINABLES = (
    TrainableEntry(
        "adlm", "trainables.adlm:adlm", AdLMTrialConfig,
        "AdLM (Phan et al., ICDM 2017): LRP relevance released with Laplace noise, relevance-adaptive Laplace "
        "noise on the first affine transformation, functional-mechanism loss; epsilon = eps_1 + eps_2 + eps_3 "
        "(the paper's accounting, docs/adlm.md); no certificate.",
        epsilon_protects="training examples, by the paper's accounting (eps_1 + eps_2 + eps_3; docs/adlm.md)",
        metrics=("adlm_eps_relevance", "adlm_eps_features", "adlm_eps_loss")),
)
