"""Evaluation as plain data: conventional accuracy (clean and under each attack and size) and
certified accuracy curves, keyed by the metric names of docs/metrics.md.

* ``acc_clean``: accuracy on the clean test examples;
* ``acc_<attack>_<size>``: accuracy on adversarial examples of that attack and size (e.g.
  ``acc_pgd_0.2``); sizes are in the [-1, 1] input domain;
* ``cert_acc_<size>``: certified accuracy at that attack size;
* ``not_learned``: 1.0 when the trial did not learn (``did_not_learn``: accuracy not significantly
  above chance), else 0.0; ``loss_near_chance``: the train-loss hint (``loss_near_chance``).

For a model whose forward pass is random (PixelDP), predictions are the argmax of the expected
scores estimated from ``n_predict`` draws (Lecuyer et al. 2018, Sec. 3.4) and the attacks
average their gradients over ``eot_samples`` draws (expectation over transformation).
"""

from __future__ import annotations

import numpy as np
import torch

from dpmech import _validate as v
from dpmech.robustness.attacks import ATTACKS, attack, resolve_eot_samples
from dpmech.robustness.certification import CertificationResult, certified_accuracy, model_device, monte_carlo


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
        device = model_device(model, x.device)
        out = [model(x[s:s + batch_size].to(device)).argmax(1).cpu() for s in range(0, x.shape[0], batch_size)]
        model.train(was)
        return torch.cat(out).numpy()
    est = monte_carlo(model, x, n_predict, batch_size=batch_size)
    return est.mean.argmax(axis=1)


ATTACK_LABELS = ("true", "predicted")


def conventional_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                          attacks: dict[str, list[float]] | None = None, norm: str = "linf",
                          n_predict: int = 1, eot_samples: int | str = 1, steps: int = 10, batch_size: int = 500,
                          attack_kwargs: dict | None = None, seed: int = 0,
                          attack_labels: str = "true") -> dict[str, float]:
    """``acc_clean`` and ``acc_<attack>_<size>`` for every attack name and size in ``attacks``.

    ``attack_labels="true"`` (default): each attack maximises the loss of the true label ``y``,
    as robust accuracy is defined in the literature (e.g. Madry et al. 2018, Eq. 2.1).
    ``"predicted"``: it maximises the loss of the model's own clean prediction, the DPAL paper's
    choice against label leaking (Kurakin et al. 2017); on a weak model this attacks the wrong
    class for every misclassified example, and accuracy under attack can exceed clean accuracy.
    Accuracy is measured against the true labels ``y`` in both cases.

    ``acc_worst_<size>``: for every size at which some attack ran, the fraction of examples
    classified correctly clean *and* under every attack run at that size (the per-example worst
    case, as AutoAttack reports robust accuracy). ``eot_samples="auto"``: ``EOT_AUTO_SAMPLES``
    draws per gradient for a model whose forward pass is random, 1 otherwise
    (``dpmech.robustness.attacks.resolve_eot_samples``), reported as ``eot_samples_used``. The iterative
    attacks ifgsm, mim and pgd run ``steps`` iterations; APGD its own default (100).
    """
    attack_labels = v.choice("attack_labels", attack_labels, ATTACK_LABELS)
    attacks = attacks or {}
    for name, sizes in attacks.items():
        if name not in ATTACKS:
            raise ValueError(f"attack must be one of {', '.join(ATTACKS)}; got {name!r}")
        for s in sizes:
            v.non_negative("attack size", s)
    y_np = np.asarray(y.cpu() if torch.is_tensor(y) else y)
    clean_ok = predict(model, x, n_predict=n_predict) == y_np
    out = {"acc_clean": float(clean_ok.mean())}
    device = model_device(model, x.device)
    if attacks:
        auto = eot_samples == "auto"
        eot_samples = resolve_eot_samples(model, x[:1].to(device), eot_samples)
        if auto:
            out["eot_samples_used"] = float(eot_samples)
    worst: dict[str, np.ndarray] = {}
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, sizes in attacks.items():
        for size in sizes:
            advs = []
            for s in range(0, x.shape[0], batch_size):
                xb = x[s:s + batch_size].to(device)
                yb = torch.as_tensor(y_np[s:s + batch_size], device=device) if attack_labels == "true" else None
                kwargs = dict(attack_kwargs or {})
                kwargs.update(eps=float(size), norm=norm, eot_samples=eot_samples)
                if name in ("ifgsm", "mim", "pgd"):
                    kwargs.setdefault("steps", steps)
                if name in ("pgd", "apgd_ce", "apgd_dlr"):
                    kwargs.setdefault("generator", gen)
                advs.append(attack(name, model, xb, yb, **kwargs).detach().cpu())
            x_adv = torch.cat(advs)
            ok = predict(model, x_adv, n_predict=n_predict) == y_np
            out[metric_name(name, size)] = float(ok.mean())
            key = format_size(size)
            worst[key] = worst.get(key, clean_ok) & ok
    for key, ok in worst.items():
        out[f"acc_worst_{key}"] = float(ok.mean())
    return out


# The did-not-learn rule (docs/metrics.md, ``not_learned``)
LOSS_CHANCE_MARGIN = 0.05   # loss_near_chance: train_loss >= (1 - 0.05) ln K (a hint, not a verdict)
CHANCE_TEST_LEVEL = 0.01    # one-sided exact binomial test of accuracy against chance at this level
MSE_CHANCE_MARGIN = 0.05    # regression: mse >= (1 - 0.05) x the MSE of predicting the mean


def chance_accuracy(y, num_classes: int) -> float:
    """Accuracy of the best constant prediction on labels ``y``: max(1/K, largest class frequency)."""
    y = np.asarray(y.cpu() if torch.is_tensor(y) else y).astype(np.int64).ravel()
    if y.size == 0:
        raise ValueError("y must hold at least one label")
    return max(1.0 / num_classes, float(np.bincount(y, minlength=num_classes).max() / y.size))


def did_not_learn(*, num_classes: int, acc_clean: float | None = None, n_test: int | None = None, y=None,
                  mse: float | None = None, y_values=None) -> float:
    """``not_learned``: 1.0 when the model did not learn, else 0.0 (docs/metrics.md).

    A classifier did not learn when its clean accuracy is not significantly above chance: with
    ``c = round(acc_clean * n_test)`` correct answers, the one-sided exact binomial test of ``c``
    against ``Binomial(n_test, p0)`` gives a p-value above 0.01, where ``p0 = chance_accuracy(y, K)``
    (the best constant prediction on the evaluated labels: max(1/K, largest class frequency)).
    A non-finite accuracy counts as not learned.

    The training loss decides nothing here: a DP-SGD model at small epsilon can keep its noisy
    cross-entropy near ln K and still be 3x better than chance (issue 24, point 8). That rule is
    the separate hint ``loss_near_chance``.

    A regressor (``mse`` given) did not learn when ``mse >= (1 - 0.05) Var(y_values)``: within 5%
    of (or above) the MSE of predicting the mean of the evaluated targets.
    """
    from scipy.stats import binom

    if mse is not None:
        vals = np.asarray(y_values.cpu() if torch.is_tensor(y_values) else y_values, dtype=np.float64).ravel()
        baseline = float(vals.var())
        return float(not np.isfinite(mse) or mse >= (1 - MSE_CHANCE_MARGIN) * baseline)
    if acc_clean is None or not n_test:
        return 0.0
    if not np.isfinite(acc_clean):
        return 1.0
    p0 = chance_accuracy(y, num_classes)
    correct = int(round(float(acc_clean) * n_test))
    p_value = float(binom.sf(correct - 1, n_test, p0))  # P(C >= correct) under chance
    return float(p_value > CHANCE_TEST_LEVEL)


def loss_near_chance(*, num_classes: int, train_loss: float | None, loss_is_cross_entropy: bool) -> float | None:
    """``loss_near_chance``: a hint, not a verdict (docs/metrics.md). 1.0 when the last epoch's
    training loss is the mean cross-entropy (``loss_is_cross_entropy``) and is within 5% of (or
    above) ln K, the loss of predicting the uniform distribution, or not finite; 0.0 when it is
    below; None (not logged) when the loss is not a cross-entropy on the true labels or unknown.

    It does not set ``not_learned``: a noisy DP-SGD loss can sit near ln K while the model is far
    better than chance."""
    if not loss_is_cross_entropy or train_loss is None:
        return None
    if not np.isfinite(train_loss):
        return 1.0
    return float(train_loss >= (1 - LOSS_CHANCE_MARGIN) * float(np.log(num_classes)))


def certified_accuracy_curve(result: CertificationResult, sizes) -> dict[str, float]:
    """``cert_acc_<size>`` for each size (Lecuyer et al. 2018, Sec. 4.1)."""
    return {f"cert_acc_{format_size(t)}": acc for t, acc in certified_accuracy(result, sizes).items()}
