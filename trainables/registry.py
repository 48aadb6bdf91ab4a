"""Registry of trainables by name: the function Ray Tune runs, its config schema, a summary.

A new mechanism is one module in dpmech, one trainable, one entry here, one example spec.
The Ray Tune functions are resolved on use (``TrainableEntry.fn``); the schemas are imported here.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Callable

from trainables import secure_sgd as _secure_sgd
from trainables.adlm import AdLMTrialConfig
from trainables.config import CommonConfig, DPALTrialConfig, PixelDPTrialConfig
from trainables.dp_merf import PRIVACY_KEYS as DP_MERF_PRIVACY_KEYS
from trainables.dp_merf import DPMERFTrialConfig
from trainables.dpal_sound import METRICS as DPAL_SOUND_METRICS
from trainables.dpal_sound import PRIVACY_KEYS as DPAL_SOUND_PRIVACY_KEYS
from trainables.dpal_sound import DPALSoundTrialConfig
from trainables.dpgan import DPGANTrialConfig
from trainables.dpsgd import PRIVACY_KEYS as DPSGD_PRIVACY_KEYS
from trainables.dpsgd import DPSGDTrialConfig
from trainables.label_dp import LabelDPTrialConfig


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
    # Final metrics of this trainable beyond the generic ones (sweeps.spec_space.reported_metrics reads it)
    metrics: tuple[str, ...] = ()

    @property
    def fn(self) -> Callable[[dict], None]:
        return _resolve(self.target)

    @property
    def privacy_event_fn(self) -> Callable:
        if self.privacy_event is None:
            raise ValueError(f"trainable {self.name!r} has no per-trial privacy event")
        return _resolve(self.privacy_event)


def _resolve(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


REGISTRY: dict[str, TrainableEntry] = {
    "pixeldp": TrainableEntry(
        "pixeldp", "trainables.pixeldp:pixeldp", PixelDPTrialConfig,
        "PixelDP (Lecuyer et al. 2018): noise layer after a sensitivity-bounded first layer; "
        "certified with the PixelDP robustness test.",
        epsilon_protects="nothing: no epsilon metric; the config's epsilon is a robustness parameter of the noise "
                         "layer, logged as robustness_epsilon_config (configured) and robustness_epsilon "
                         "(recomputed from the noise)",
        privacy_epsilon=False),
    "dpal": TrainableEntry(
        "dpal", "trainables.dpal:dpal", DPALTrialConfig,
        "DPAL (ICLR 2020 submission, StoBatch lineage): DP auto-encoder and DP adversarial objective with "
        "fixed noise and disjoint batches (Theorem 4), verified inference with the (kappa + phi)_max bound.",
        epsilon_protects="training examples, by the paper's Theorem 4 accounting (eps_t; docs/dpal.md)"),
    "dpal_sound": TrainableEntry(
        "dpal_sound", "trainables.dpal_sound:dpal_sound", DPALSoundTrialConfig,
        "dpal_sound: a sound DPAL. DP-SGD (Poisson sampling, per-example clipping of the benign + adversarial "
        "pass of each example, RDP/PLD ledger) on DPAL's adversarial objective with an attack ensemble, Gaussian "
        "input noise at training and inference; certified by randomized smoothing, attacked white-box with EOT "
        "(docs/dpal_sound.md).",
        epsilon_protects="training examples (RDP/PLD ledger; the whole epsilon is DP-SGD's)",
        privacy_event="trainables.dpal_sound:privacy_event",
        privacy_keys=DPAL_SOUND_PRIVACY_KEYS,
        metrics=DPAL_SOUND_METRICS + tuple(f"cert_l2_acc_{r:g}" for r in (0.25, 0.5, 0.75, 1.0))
        + tuple(f"cert_linf_acc_{s:g}" for s in (0.01, 0.02, 0.03, 0.05))),
    "adlm": TrainableEntry(
        "adlm", "trainables.adlm:adlm", AdLMTrialConfig,
        "AdLM (Phan et al., ICDM 2017): LRP relevance released with Laplace noise, relevance-adaptive Laplace "
        "noise on the first affine transformation, functional-mechanism loss; epsilon = eps_1 + eps_2 + eps_3 "
        "(the paper's accounting, docs/adlm.md); no certificate.",
        epsilon_protects="training examples, by the paper's accounting (eps_1 + eps_2 + eps_3; docs/adlm.md)"),
    "dpgan": TrainableEntry(
        "dpgan", "trainables.dpgan:dpgan", DPGANTrialConfig,
        "DPGAN (Xie et al. 2018): conditional WGAN, critic steps on Poisson-sampled real data with per-example "
        "clipping at c_g, Gaussian noise and weight clipping; RDP/PLD epsilon from the ledger; evaluated by "
        "train-on-synthetic accuracy (docs/dpgan.md).",
        epsilon_protects="training examples (RDP/PLD ledger of the critic's steps)",
        privacy_event="trainables.dpgan:privacy_event",
        privacy_keys=("epsilon", "delta", "epochs", "batch_size", "train_size", "dataset", "fake_labels",
                      "histogram_noise")),
    "dp_merf": TrainableEntry(
        "dp_merf", "trainables.dp_merf:dp_merf", DPMERFTrialConfig,
        "DP-MERF (Harder et al. 2021): one Gaussian release of the random-Fourier-feature mean embedding of (image, "
        "label) pairs (sensitivity 1 with a noisy-count coordinate), a conditional generator matched to it with no "
        "further data access; evaluated by train-on-synthetic accuracy (docs/dp_merf.md).",
        epsilon_protects="training examples (one Gaussian release, RDP/PLD)",
        privacy_event="trainables.dp_merf:privacy_event",
        privacy_keys=DP_MERF_PRIVACY_KEYS),
    "dpsgd": TrainableEntry(
        "dpsgd", "trainables.dpsgd:dpsgd", DPSGDTrialConfig,
        "DP-SGD (Abadi et al. 2016): Poisson sampling, per-example clipping (clipping: bk, book-keeping in one "
        "backward pass, the default; ghost or flat through Opacus), "
        "Gaussian noise calibrated to (epsilon, delta) over the planned steps; RDP/PLD epsilon from the ledger; "
        "epsilon null = non-private baseline of the same network (docs/dpsgd.md).",
        epsilon_protects="training examples (RDP/PLD ledger)",
        privacy_event="trainables.dpsgd:privacy_event",
        privacy_keys=DPSGD_PRIVACY_KEYS),
    "label_dp": TrainableEntry(
        "label_dp", "trainables.label_dp:label_dp", LabelDPTrialConfig,
        "Label DP (source: Laplace on MNIST labels): training labels released once per trial with the Laplace "
        "mechanism (one-hot + Lap(2/eps) -> argmax, or the digit + Lap(9/eps)), K-ary randomized response, or "
        "randomized response with a prior (LP-1ST / LP-2ST, Ghazi et al. 2021), a fresh CNN trained on them "
        "(the source's Adam recipe or mixup + SGD); classification or regression; epsilon protects labels only "
        "(docs/label_dp.md).",
        epsilon_protects="training labels only (label DP, delta 0); the images are not protected"),
    "secure_sgd": TrainableEntry(
        "secure_sgd", "trainables.secure_sgd:secure_sgd",
        _secure_sgd.SecureSGDTrialConfig,
        "SecureSGD (Phan et al., IJCAI 2019): DP-SGD (Opacus, RDP/PLD epsilon from the ledger) on a PixelDP net whose "
        "noise layer is calibrated by the heterogeneous Gaussian mechanism (Theorem 1, any eps_r); certified with "
        "the PixelDP test (docs/secure_sgd.md).",
        epsilon_protects="training examples (DP-SGD ledger); the noise layer's robustness parameters are "
                         "robustness_epsilon/robustness_delta",
        privacy_event="trainables.secure_sgd:privacy_event",
        privacy_keys=_secure_sgd.PRIVACY_KEYS),
    "secure_sgd_agm": TrainableEntry(
        "secure_sgd_agm", "trainables.secure_sgd:secure_sgd_agm",
        _secure_sgd.SecureSGDAGMTrialConfig,
        "SecureSGD-AGM: SecureSGD with the noise layer calibrated by the analytic Gaussian mechanism "
        "(Balle & Wang 2018) instead of the HGM (docs/secure_sgd.md).",
        epsilon_protects="training examples (DP-SGD ledger); the noise layer's robustness parameters are "
                         "robustness_epsilon/robustness_delta",
        privacy_event="trainables.secure_sgd:privacy_event",
        privacy_keys=_secure_sgd.PRIVACY_KEYS),
}


def did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def get_trainable(name: str) -> TrainableEntry:
    if name not in REGISTRY:
        raise ValueError(f"unknown trainable {name!r}{did_you_mean(name, REGISTRY)}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]
