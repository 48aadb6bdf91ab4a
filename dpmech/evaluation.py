"""Evaluation as plain data: conventional accuracy (clean and under each attack and size) and
certified accuracy curves, keyed by the metric names of docs/metrics.md.

* ``acc_clean``: accuracy on the clean test examples;
* ``acc_<attack>_<size>``: accuracy on adversarial examples of that attack and size (e.g.
  ``acc_pgd_0.2``); sizes are in the [-1, 1] input domain;
* ``cert_acc_<size>``: certified accuracy at that attack size.

For a model whose forward pass is random (PixelDP), predictions are the argmax of the expected
scores estimated from ``n_predict`` draws (Lecuyer et al. 2018, Sec. 3.4) and the attacks
average their gradients over ``eot_samples`` draws (expectation over transformation).
"""

from __future__ import annotations

import numpy as np
import torch

from dpmech import _validate as v
from dpmech.attacks import ATTACKS, attack
from dpmech.certify import CertificationResult, certified_accuracy, monte_carlo


def format_size(size: float) -> str:
    """Attack size as it appears in metric names: up to 6 significant digits (0.2 -> '0.2')."""
    return f"{float(size):.6g}"


def metric_name(attack_name: str, size: float) -> str:
    return f"acc_{attack_name}_{format_size(size)}"


@torch.no_grad()
def predict(model: torch.nn.Module, x: torch.Tensor, *, n_predict: int = 1, batch_size: int = 4096) -> np.ndarray:
    """Class predictions; with ``n_predict > 1`` the argmax of the mean softmax over draws."""
    n_predict = v.positive_int("n_predict", n_predict)
    if n_predict == 1:
        was = model.training
        model.eval()
        device = next(model.parameters()).device
        out = [model(x[s:s + batch_size].to(device)).argmax(1).cpu() for s in range(0, x.shape[0], batch_size)]
        model.train(was)
        return torch.cat(out).numpy()
    est = monte_carlo(model, x, n_predict, batch_size=batch_size)
    return est.mean.argmax(axis=1)


def conventional_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                          attacks: dict[str, list[float]] | None = None, norm: str = "linf",
                          n_predict: int = 1, eot_samples: int = 1, steps: int = 10, batch_size: int = 500,
                          attack_kwargs: dict | None = None, seed: int = 0) -> dict[str, float]:
    """``acc_clean`` and ``acc_<attack>_<size>`` for every attack name and size in ``attacks``.

    Attacks use the model's own predictions as labels (no label leaking, as in the DPAL
    paper); accuracy is measured against the true labels ``y``.
    """
    attacks = attacks or {}
    for name, sizes in attacks.items():
        if name not in ATTACKS:
            raise ValueError(f"attack must be one of {', '.join(ATTACKS)}; got {name!r}")
        for s in sizes:
            v.non_negative("attack size", s)
    y_np = np.asarray(y.cpu() if torch.is_tensor(y) else y)
    out = {"acc_clean": float((predict(model, x, n_predict=n_predict) == y_np).mean())}
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, sizes in attacks.items():
        for size in sizes:
            advs = []
            for s in range(0, x.shape[0], batch_size):
                xb = x[s:s + batch_size].to(device)
                kwargs = dict(attack_kwargs or {})
                kwargs.update(eps=float(size), norm=norm, eot_samples=eot_samples)
                if name != "fgsm":
                    kwargs.setdefault("steps", steps)
                if name == "pgd":
                    kwargs.setdefault("generator", gen)
                advs.append(attack(name, model, xb, None, **kwargs).detach().cpu())
            x_adv = torch.cat(advs)
            out[metric_name(name, size)] = float((predict(model, x_adv, n_predict=n_predict) == y_np).mean())
    return out


def certified_accuracy_curve(result: CertificationResult, sizes) -> dict[str, float]:
    """``cert_acc_<size>`` for each size (Lecuyer et al. 2018, Sec. 4.1)."""
    return {f"cert_acc_{format_size(t)}": acc for t, acc in certified_accuracy(result, sizes).items()}
