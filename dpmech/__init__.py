"""dpmech: the science of dpsweep, usable without Ray or MLflow (docs/notebook.md).

Mechanisms and their calibration (``mechanisms``), datasets in [-1, 1] (``data``), attacks
(``attacks``: FGSM, I-FGSM, MIM, PGD, APGD), PixelDP's noise layer, networks and trainer
(``noise_layer``, ``models``, ``pixeldp``), the PixelDP certifier for any noisy model
(``certify``), randomized smoothing (``smoothing``), the one-run privacy audit (``audit``),
privacy accounting (``accounting``, on dp-accounting), evaluation helpers (``evaluation``) and
DP-SGD for any ``nn.Module`` (``DPSGDTrainer``, ``DPSGDConfig``).

The public names below are listed in ``__all__`` and imported lazily on first use, so
``import dpmech`` is cheap and never imports Ray or MLflow. Conventions: inputs in [-1, 1];
every random step takes an explicit ``torch.Generator``; ``alpha`` is a failure probability.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it (documented once, in that module)
_PUBLIC = {
    # certification (PixelDP, Lecuyer et al. 2018): any model with a random forward pass
    "certify_counts": "dpmech.certify", "certified_size": "dpmech.certify",
    "certified_accuracy": "dpmech.certify", "monte_carlo": "dpmech.certify", "argmax_bounds": "dpmech.certify",
    "hoeffding_bounds": "dpmech.certify", "bernstein_bounds": "dpmech.certify",
    "CertificationResult": "dpmech.certify", "MonteCarloEstimate": "dpmech.certify",
    "pixeldp_noise_scale": "dpmech.noise_layer", "NoiseLayer": "dpmech.noise_layer",
    # attacks and evaluation
    "attack": "dpmech.attacks", "fgsm": "dpmech.attacks", "ifgsm": "dpmech.attacks", "mim": "dpmech.attacks",
    "pgd": "dpmech.attacks", "apgd": "dpmech.attacks", "apgd_ce": "dpmech.attacks", "apgd_dlr": "dpmech.attacks",
    "accuracy_under_attack": "dpmech.attacks", "conventional_accuracy": "dpmech.evaluation",
    "certified_accuracy_curve": "dpmech.evaluation",
    # privacy audit (Steinke, Nasr & Jagielski 2023)
    "epsilon_lower_bound": "dpmech.audit", "p_value": "dpmech.audit",
    "make_canaries": "dpmech.audit", "loss_scores": "dpmech.audit", "audit_possible": "dpmech.audit",
    "run_estimators": "dpmech.audit",
    # white-box canaries in the DP-SGD engine; the f-DP one-run bound (Mahloujifar et al. 2025)
    "WhiteBoxCanaries": "dpmech.audit_whitebox", "audit_fdp": "dpmech.audit_fdp",
    # accounting (dp-accounting)
    "PrivacyLedger": "dpmech.accounting",
    # data
    "load_splits": "dpmech.data",
    # DP-SGD on any nn.Module (docs/notebook.md, "Train your own model with DP-SGD")
    "DPSGDTrainer": "dpmech.dpsgd", "DPSGDConfig": "dpmech.dpsgd",
}
# submodules, public too (``dpmech.certify.certify``, ``dpmech.smoothing.certify``,
# ``dpmech.accounting.epsilon``). A function named like its module (certify, audit) cannot be a
# package attribute of its own, since importing a submodule binds its name on the package: those two
# modules are callable instead (``dpmech.certify(...)``, ``dpmech.audit(...)`` forward to the function).
_MODULES = ("accounting", "attacks", "audit", "certify", "data", "evaluation", "mechanisms", "noise_layer",
            "smoothing")

__all__ = sorted(_PUBLIC) + list(_MODULES)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    if name in _MODULES:
        return importlib.import_module(f"dpmech.{name}")
    raise AttributeError(f"module 'dpmech' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_MODULES))
