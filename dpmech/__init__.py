"""dpmech: the science of dpsweep, usable without Ray or MLflow (docs/notebook.md; the layout: docs/layout.md).

Shared packages: ``privacy`` (mechanisms, accounting on dp-accounting, the per-example clipping
engines, the cost of tuning, one-run audits), ``robustness`` (attacks, PixelDP's noise layer,
certification, randomized smoothing, evaluation), ``datasets`` (the named datasets in [-1, 1] and
users' own) and ``networks``. One package per mechanism family: ``pixeldp``, ``dpsgd``,
``secure_sgd``, ``dpal``, ``dpal_sound``, ``adlm``, ``label_dp``, ``dpgan``, ``dp_merf``.

The public names below are listed in ``__all__`` and imported lazily on first use, so
``import dpmech`` is cheap and never imports Ray or MLflow. ``dpmech.certify`` and ``dpmech.audit``
are functions (PixelDP certification of any noisy model; the one-run audit of canary scores); the
short module names of earlier releases (``dpmech.accounting``, ``dpmech.attacks``, ``dpmech.data``,
``dpmech.evaluation``, ``dpmech.mechanisms``, ``dpmech.noise_layer``, ``dpmech.smoothing``) still
resolve to their modules. Conventions: inputs in [-1, 1]; every random step takes an explicit
``torch.Generator``; ``alpha`` is a failure probability.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_CERT = "dpmech.robustness.certification"
_ATTACKS = "dpmech.robustness.attacks"
_AUDIT = "dpmech.privacy.audit"

# public name -> the module that defines it (documented once, in that module)
_PUBLIC = {
    # certification (PixelDP, Lecuyer et al. 2019): any model with a random forward pass
    "certify": _CERT, "certify_counts": _CERT, "certified_size": _CERT, "certified_accuracy": _CERT,
    "monte_carlo": _CERT, "argmax_bounds": _CERT, "hoeffding_bounds": _CERT, "bernstein_bounds": _CERT,
    "CertificationResult": _CERT, "MonteCarloEstimate": _CERT,
    "pixeldp_noise_scale": "dpmech.robustness.noise_layer", "NoiseLayer": "dpmech.robustness.noise_layer",
    # attacks and evaluation
    "attack": _ATTACKS, "fgsm": _ATTACKS, "ifgsm": _ATTACKS, "mim": _ATTACKS, "pgd": _ATTACKS, "apgd": _ATTACKS,
    "apgd_ce": _ATTACKS, "apgd_dlr": _ATTACKS, "accuracy_under_attack": _ATTACKS,
    "conventional_accuracy": "dpmech.robustness.evaluation",
    "certified_accuracy_curve": "dpmech.robustness.evaluation",
    # privacy audit (Steinke, Nasr & Jagielski 2023; Mahloujifar et al. 2025)
    "audit": f"{_AUDIT}.one_run", "epsilon_lower_bound": f"{_AUDIT}.one_run", "p_value": f"{_AUDIT}.one_run",
    "make_canaries": f"{_AUDIT}.one_run", "loss_scores": f"{_AUDIT}.one_run", "audit_possible": f"{_AUDIT}.one_run",
    "run_estimators": f"{_AUDIT}.estimators", "WhiteBoxCanaries": f"{_AUDIT}.whitebox",
    "EngineCanaries": f"{_AUDIT}.whitebox", "eps_delta_lower_bound": f"{_AUDIT}.fdp", "audit_fdp": f"{_AUDIT}.fdp",
    # accounting (dp-accounting)
    "PrivacyLedger": "dpmech.privacy.accounting",
    # data
    "load_splits": "dpmech.datasets.splits",
    # DP-SGD on any nn.Module (docs/notebook.md, "Train your own model with DP-SGD")
    "DPSGDTrainer": "dpmech.dpsgd.trainer", "DPSGDConfig": "dpmech.dpsgd.trainer",
}
# modules, public too under their short names (``dpmech.accounting.epsilon``, ``dpmech.smoothing.certify``)
_MODULES = {
    "accounting": "dpmech.privacy.accounting", "mechanisms": "dpmech.privacy.mechanisms",
    "attacks": _ATTACKS, "evaluation": "dpmech.robustness.evaluation",
    "noise_layer": "dpmech.robustness.noise_layer", "smoothing": "dpmech.robustness.smoothing",
    "data": "dpmech.datasets.splits",
}

__all__ = sorted(_PUBLIC) + sorted(_MODULES)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'dpmech' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
