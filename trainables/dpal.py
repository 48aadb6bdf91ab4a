"""The ``dpal`` trainable: DPAL training and verified inference under Ray Tune.

Every key and its default: ``DPALTrialConfig`` below (``dpsweep mechanisms``). The
mechanism itself is ``dpmech.dpal``; the decisions it takes are in docs/dpal.md.

``evaluation: faithful`` (the default) is dpsweep's DPAL. ``evaluation: reference`` trains and evaluates as the
reference code does (``dpmech.dpal.reference``) and reports ``ref_*`` metrics only (docs/metrics.md):
**reference protocol: not a DP guarantee, not a white-box attack, not a certificate.** It exists to show where
the paper's numbers come from (docs/dpal.md, "The reference protocol").
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from dpmech.dpal.config import DPALConfig
from dpmech.dpal.trainer import DPALTrainer
from dpmech.dpal.verify import conventional_accuracy_under_attack, verified_inference
from dpmech.robustness.evaluation import format_size, metric_name
from trainables.config import CommonConfig
from trainables.entry import TrainableEntry
from trainables.runtime import TrainerMechanism, run_trial


class DPALTrialConfig(CommonConfig):
    """DPAL (docs/dpal.md): DP adversarial learning with the composition robustness bound."""

    has_certificate: ClassVar[bool] = True  # verified inference

    eps_t: float = Field(1.0, gt=0, allow_inf_nan=False, description="total privacy budget of Theorem 4 (eps_1 + eps_1/gamma_x + eps_1/gamma + eps_2)")
    psi: float = Field(2.0, gt=0, allow_inf_nan=False, description="inference noise scale-down of Appendix L (MNIST 2, CIFAR-10 10)")
    xi: float = Field(1.0, ge=0, allow_inf_nan=False, description="weight of the adversarial term in Eq. 10")
    train_attacks: list[Literal["ifgsm", "mim", "pgd"]] = Field(
        default_factory=lambda: ["ifgsm", "mim", "pgd"], min_length=1,
        description="Alg. 1's ensemble A crafting DP adversarial examples (pgd = MadryEtAl)")
    train_attack_steps: int = Field(10, gt=0, description="T_mu: iterations of the training attacks")
    mu_a: float = Field(0.2, gt=0, allow_inf_nan=False, description="attack size tested by isRobust (Alg. 1 line 15), l-inf, [-1, 1] domain")
    theta1_bound: float = Field(1.0, gt=0, allow_inf_nan=False, description="enforced l1 operator-norm bound on theta_1 (gamma of Lemma 3)")
    epochs: int = Field(10, gt=0, description="training epochs")
    batch_size: int = Field(2499, gt=1, description="m: size of the fixed disjoint batches")
    lr: float = Field(1e-4, gt=0, allow_inf_nan=False, description="learning rate")
    attack_norm: Literal["linf"] = Field("linf", description="DPAL is evaluated under l-inf attacks")
    n_predict: int = Field(100, gt=0, description="psi-noisy draws per prediction in accuracy metrics")
    certify_bounds: Literal["argmax", "hoeffding"] = Field("hoeffding", description="confidence bound of verified inference (the paper: Hoeffding)")
    evaluation: Literal["faithful", "reference"] = Field(
        "faithful", description="faithful: dpsweep's DPAL (docs/dpal.md); reference: the reference code's training and "
        "evaluation protocol, reported as ref_* metrics (reference protocol: not a DP guarantee, not a white-box attack, "
        "not a certificate; docs/dpal.md 'The reference protocol')")
    ref_eval_every: int = Field(10, gt=0, description="reference: evaluate every this many epochs (of int(N / batch_size) "
                                "steps) and report the maximum over the evaluations, as the reference does")

    def smoothing_unavailable(self) -> str | None:
        return ("DPAL's noise is Laplace noise fixed at training plus psi-scaled Laplace noise at inference, not "
                "Gaussian noise on the input; its certificate is verified inference (certifier: default)")

    @model_validator(mode="after")
    def _mechanism_rules(self):
        """Cross-key rules of the mechanism itself (e.g. Appendix M's eps_t >= 2 on CIFAR-10)."""
        dpal_config(self)  # raises ValueError naming the field
        reference_rules(self)
        return self


def dpal_config(cfg: DPALTrialConfig) -> DPALConfig:
    """The dpmech configuration of a trial (the evaluation keys map onto Alg. 1's n, eta, mu_a)."""
    return DPALConfig(
        dataset=cfg.dataset, eps_t=cfg.eps_t, psi=cfg.psi, xi=cfg.xi, attacks=tuple(cfg.train_attacks),
        attack_steps=cfg.train_attack_steps, mu_a=cfg.mu_a, n=cfg.certify_n, eta=cfg.certify_eta,
        bounds=cfg.certify_bounds, norm="linf", batch_size=cfg.batch_size, lr=cfg.lr, epochs=cfg.epochs,
        theta1_bound=cfg.theta1_bound, seed=cfg.seed)


class DPALMechanism(TrainerMechanism):
    """Adapter from the trial config to ``dpmech.dpal.trainer.DPALTrainer``."""

    def __init__(self, cfg: DPALTrialConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device, noise_key=None):
        self.trainer = DPALTrainer(dpal_config(cfg), x, y, device=device, noise_key=noise_key)

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


REFERENCE_LABEL = "reference protocol: not a DP guarantee, not a white-box attack, not a certificate"


def reference_rules(cfg: DPALTrialConfig) -> None:
    """Cross-key rules of ``evaluation: reference`` (ValueError naming the field)."""
    if cfg.evaluation != "reference":
        return
    from dpmech.dpal.reference import ATTACKS, EPS3

    if cfg.dataset != "mnist":
        raise ValueError(f"config.dataset: evaluation 'reference' reproduces the reference's MNIST code only, got {cfg.dataset!r}")
    if cfg.eps_t <= EPS3:
        raise ValueError(f"config.eps_t: evaluation 'reference' needs eps_t > {EPS3} (eps_3 = 0.1), got {cfg.eps_t}")
    bad = sorted(set(cfg.attacks) - set(ATTACKS))
    if bad:
        raise ValueError(f"config.attacks: evaluation 'reference' runs the reference's attacks {list(ATTACKS)} only, got {bad}")
    if cfg.attacks and cfg.attack_labels != "predicted":
        raise ValueError("config.attack_labels: evaluation 'reference' attacks the surrogate's own predictions "
                         "(cleverhans without y), set attack_labels: predicted")


def reference_metric_names(config: dict) -> set[str]:
    """The final metrics of a trial with ``evaluation: reference`` (docs/metrics.md)."""
    out = {"ref_acc_clean", "ref_steps", "ref_eps_t", "ref_b_x", "ref_b_h", "compute_seconds", "not_learned"}
    sizes_by_attack = config.get("attacks") or {}
    all_sizes = sorted({float(s) for sizes in sizes_by_attack.values() for s in sizes})
    for attack, sizes in sizes_by_attack.items():
        out |= {"ref_" + metric_name(attack, s) for s in sizes}
    out |= {f"ref_acc_attack_mean_{format_size(s)}" for s in all_sizes}
    if (config.get("certify_images") or 0) > 0:
        for s in config.get("certify_sizes") or ():
            out.add(f"ref_cert_acc_{format_size(s)}")
            out.add(f"ref_cert_head_acc_{format_size(s)}")
            out |= {f"ref_cert_acc_{attack}_{format_size(s)}" for attack in sizes_by_attack}
            out |= {f"ref_cert_head_acc_{attack}_{format_size(s)}" for attack in sizes_by_attack}
    return out


class ReferenceMechanism:
    """``evaluation: reference``: ``dpmech.dpal.reference.ReferenceTrainer``. An epoch is int(N / batch_size)
    steps (line 288); every ``ref_eval_every`` epochs (and after the last) the reference's evaluation runs on the
    test set (the whole of it is the batch whose statistics the norms use) and each reported metric is the
    maximum over those evaluations (lines 749-750, 801-802)."""

    def __init__(self, cfg: DPALTrialConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device):
        from dpmech.dpal.reference import ReferenceTrainer

        self.cfg = cfg
        self.trainer = ReferenceTrainer(x, y, cfg.eps_t, mu_a=cfg.mu_a, batch_size=cfg.batch_size, lr=cfg.lr,
                                        alpha=cfg.xi, attack_steps=cfg.train_attack_steps, seed=cfg.seed, device=device)
        self.evaluations: list[dict] = []

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.net

    @property
    def epoch(self) -> int:
        return self.trainer.step_count // self.trainer.steps_per_epoch

    def train_epoch(self) -> dict[str, float]:
        losses = [self.trainer.step() for _ in range(self.trainer.steps_per_epoch)]
        return {"train_loss": float(sum(losses) / len(losses))}

    def _evaluate(self, x, y) -> None:
        cfg = self.cfg
        sizes = sorted({float(s) for v in cfg.attacks.values() for s in v})
        cert = tuple(cfg.certify_sizes) if cfg.certify_images > 0 else ()
        out = {}
        k = min(cfg.certify_images, x.shape[0]) if cert else 0
        for name, attack_sizes in cfg.attacks.items():
            m = self.trainer.evaluate(x, y, attacks=(name,), sizes=tuple(attack_sizes), n=cfg.certify_n,
                                      attack_steps=cfg.attack_steps, psi=cfg.psi, seed=cfg.seed + self.trainer.step_count)
            out.update(m)
        if cert:
            for name in (cfg.attacks or {"pgd": ()}):
                m = self.trainer.evaluate(x[:k], y[:k], attacks=(name,), sizes=cert, n=cfg.certify_n,
                                          attack_steps=cfg.attack_steps, psi=cfg.psi, cert_sizes=cert,
                                          seed=cfg.seed + self.trainer.step_count + 1)
                out.update({key: val for key, val in m.items() if key.startswith("ref_cert_")})
        if not out:
            out = self.trainer.evaluate(x, y, attacks=(), n=1)
        del sizes
        self.evaluations.append({"step": self.trainer.step_count, **out})

    def test_accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The fixed-noise prediction on the whole test batch (line 728); runs the reference's evaluation every
        ``ref_eval_every`` epochs."""
        if self.epoch % self.cfg.ref_eval_every == 0:
            self._evaluate(x, y)
        with torch.no_grad():
            nz = self.trainer.noise
            x, y = x.to(self.trainer.device), y.to(self.trainer.device)
            return float((self.trainer.net(x, nz["benign"], nz["h"]).argmax(1) == y).float().mean())

    def conventional_accuracy(self, x, y, cfg: DPALTrialConfig) -> dict[str, float]:
        """The maximum of each ref_* metric over the evaluations (one more after the last epoch if it was not
        evaluated), the attack means of those maxima, and the reference budget's noise scales."""
        if not self.evaluations or self.evaluations[-1]["step"] != self.trainer.step_count:
            self._evaluate(x, y)
        best: dict[str, float] = {}
        for ev in self.evaluations:
            for key, val in ev.items():
                if key != "step":
                    best[key] = max(best.get(key, -1.0), float(val))
        from dpmech.dpal.reference import ATTACKS

        sizes = sorted({float(s) for v in cfg.attacks.values() for s in v})
        for s in sizes:
            vals = [best["ref_" + metric_name(a, s)] for a in ATTACKS if "ref_" + metric_name(a, s) in best]
            if vals:
                best[f"ref_acc_attack_mean_{format_size(s)}"] = sum(vals) / len(vals)
        if cfg.certify_images > 0:
            for s in cfg.certify_sizes:
                for tag in ("ref_cert_", "ref_cert_head_"):
                    vals = [best[tag + metric_name(a, s)] for a in ATTACKS if tag + metric_name(a, s) in best]
                    best[f"{tag}acc_{format_size(s)}"] = sum(vals) / len(vals) if vals else 0.0
        b = self.trainer.budget
        best.update({"ref_steps": float(self.trainer.step_count), "ref_eps_t": b.eps_t, "ref_b_x": b.b_x, "ref_b_h": b.b_h})
        return best

    def certify(self, x, y, cfg: DPALTrialConfig):
        return None  # the reference's certificate is reported as ref_cert_* by conventional_accuracy

    def privacy(self) -> dict[str, float]:
        return {}   # the reference protocol makes no privacy claim (no epsilon metric)

    def state_dict(self) -> dict:
        return {"trainer": self.trainer.state_dict(), "evaluations": self.evaluations}

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state["trainer"])
        self.evaluations = list(state["evaluations"])


def _mechanism(cfg: DPALTrialConfig, x, y, device, noise_key=None):
    if cfg.evaluation == "reference":  # the reference protocol draws from its public seed (docs/threat_model.md)
        return ReferenceMechanism(cfg, x, y, device)
    return DPALMechanism(cfg, x, y, device, noise_key=noise_key)


def dpal(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable for DPAL (flat config; see the module docstring)."""
    run_trial(config, DPALTrialConfig, _mechanism, "dpal", noise_key=noise_key)


def final_metrics(config: dict, metrics: set[str]) -> set[str]:
    """``evaluation: reference`` reports ``ref_*`` metrics only (docs/dpal.md)."""
    return reference_metric_names(config) if config.get("evaluation") == "reference" else metrics


TRAINABLES = (
    TrainableEntry(
        "dpal", "trainables.dpal:dpal", DPALTrialConfig,
        "DPAL (ICLR 2020 submission, StoBatch lineage): DP auto-encoder and DP adversarial objective with "
        "fixed noise and disjoint batches (Theorem 4), verified inference with the (kappa + phi)_max bound.",
        epsilon_protects="training examples, by the paper's Theorem 4 accounting (eps_t; docs/dpal.md)",
        final_metrics="trainables.dpal:final_metrics"),
)
