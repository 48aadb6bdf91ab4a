"""The ``dpal`` trainable: DPAL training and verified inference under Ray Tune.

Every key and its default: ``trainables.config.DPALTrialConfig`` (``dpsweep mechanisms``). The
mechanism itself is ``dpmech.dpal``; the decisions it takes are in docs/dpal.md.
"""

from __future__ import annotations

import torch

from dpmech.dpal.config import DPALConfig
from dpmech.dpal.trainer import DPALTrainer
from dpmech.dpal.verify import conventional_accuracy_under_attack, verified_inference
from dpmech.evaluation import metric_name
from trainables.config import DPALTrialConfig
from trainables.runtime import TrainerMechanism, run_trial


def dpal_config(cfg: DPALTrialConfig) -> DPALConfig:
    """The dpmech configuration of a trial (the evaluation keys map onto Alg. 1's n, eta, mu_a)."""
    return DPALConfig(
        dataset=cfg.dataset, eps_t=cfg.eps_t, psi=cfg.psi, xi=cfg.xi, attacks=tuple(cfg.train_attacks),
        attack_steps=cfg.train_attack_steps, mu_a=cfg.mu_a, n=cfg.certify_n, eta=cfg.certify_eta,
        bounds=cfg.certify_bounds, norm="linf", batch_size=cfg.batch_size, lr=cfg.lr, epochs=cfg.epochs,
        theta1_bound=cfg.theta1_bound, seed=cfg.seed)


class DPALMechanism(TrainerMechanism):
    """Adapter from the trial config to ``dpmech.dpal.DPALTrainer``."""

    def __init__(self, cfg: DPALTrialConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device):
        self.trainer = DPALTrainer(dpal_config(cfg), x, y, device=device)

    def privacy(self):
        return {k: float(v) for k, v in self.trainer.privacy().items()}

    def conventional_accuracy(self, x, y, cfg: DPALTrialConfig) -> dict[str, float]:
        """Section 4's conventional accuracy, clean and under each configured l-inf attack (labels of
        the attacks: ``attack_labels``)."""
        clean = verified_inference(self.trainer, x, y, n=cfg.n_predict, seed=cfg.seed)
        out = {"acc_clean": clean.accuracy()}
        for name, sizes in cfg.attacks.items():
            for size in sizes:
                if size == 0:
                    out[metric_name(name, size)] = out["acc_clean"]
                    continue
                out[metric_name(name, size)] = conventional_accuracy_under_attack(
                    self.trainer, x, y, name, size, steps=cfg.attack_steps, n=cfg.n_predict, seed=cfg.seed,
                    attack_labels=cfg.attack_labels)
        return out

    def certify(self, x, y, cfg: DPALTrialConfig):
        return verified_inference(self.trainer, x, y, n=cfg.certify_n, eta=cfg.certify_eta,
                                  bounds=cfg.certify_bounds, mu_a=cfg.mu_a, seed=cfg.seed)


def dpal(config: dict) -> None:
    """Ray Tune function trainable for DPAL (flat config; see the module docstring)."""
    run_trial(config, DPALTrialConfig, DPALMechanism, "dpal")
