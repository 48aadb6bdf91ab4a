"""Adversarial attacks in an l-inf or l2 ball, batched, on the model's device.

* FGSM (Goodfellow et al. 2015): one step of size eps along the normalised gradient.
* I-FGSM / BIM (Kurakin et al. 2017): ``steps`` steps of ``step_size``, projected on the ball.
* MIM (Dong et al. 2018): I-FGSM on an accumulated gradient g <- decay g + grad / ||grad||_1.
* PGD / MadryEtAl (Madry et al. 2018): I-FGSM from a uniformly random start in the ball.

Conventions: the input domain is a parameter (default [-1, 1], the project's domain) and every
iterate is clamped to it; the ball is around the clean input and sizes are in the domain's
units. Without labels the attack uses the model's own predictions on the clean input (the DPAL
paper's choice, which avoids label leaking). ``eot_samples = k`` averages the loss gradient over
k forward passes, for models whose forward pass is random (expectation over transformation).
Gradients are taken with ``torch.autograd.grad`` with respect to the input only: the model's
parameters get no ``.grad`` and its train/eval mode is left as found.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from dpmech import _validate as v

ATTACKS = ("fgsm", "ifgsm", "mim", "pgd")
ALIASES = {"bim": "ifgsm", "madry": "pgd", "madryetal": "pgd"}
NORMS = ("linf", "l2")
_TINY = 1e-12


def _check_domain(domain) -> tuple[float, float]:
    if not isinstance(domain, (tuple, list)) or len(domain) != 2:
        raise ValueError(f"domain must be a pair (low, high), got {domain!r}")
    lo = v._real("domain[0]", domain[0])
    hi = v._real("domain[1]", domain[1])
    if not lo < hi:
        raise ValueError(f"domain must have low < high, got {domain!r}")
    return lo, hi


def _check_inputs(x, y, domain):
    if not torch.is_tensor(x) or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor")
    if x.dim() not in (2, 4) or x.shape[0] == 0:
        raise ValueError(f"x must have shape [N, C, H, W] or [N, D] with N > 0, got {tuple(x.shape)}")
    lo, hi = domain
    if x.min().item() < lo - 1e-6 or x.max().item() > hi + 1e-6:
        raise ValueError(f"x must lie in the domain [{lo}, {hi}], got values in [{x.min().item():.4g}, {x.max().item():.4g}]")
    if y is not None and (not torch.is_tensor(y) or tuple(y.shape) != (x.shape[0],)):
        raise ValueError(f"y must be a tensor of shape [{x.shape[0]}]")


def _per_example_norm(t: torch.Tensor, p: float) -> torch.Tensor:
    return t.flatten(1).norm(p=p, dim=1).view(-1, *([1] * (t.dim() - 1)))


def _direction(g: torch.Tensor, norm: str) -> torch.Tensor:
    """Steepest-ascent unit direction for the norm: sign(g) for l-inf, g/||g||_2 for l2."""
    if norm == "linf":
        return g.sign()
    return g / _per_example_norm(g, 2).clamp_min(_TINY)


def _project(delta: torch.Tensor, eps: float, norm: str) -> torch.Tensor:
    if norm == "linf":
        return delta.clamp(-eps, eps)
    n = _per_example_norm(delta, 2)
    return delta * torch.where(n > eps, eps / n.clamp_min(_TINY), torch.ones_like(n))


def _labels(model, x):
    with torch.no_grad():
        return model(x).argmax(dim=1)


def _grad(model, x_adv: torch.Tensor, y: torch.Tensor, eot_samples: int) -> torch.Tensor:
    """Mean over ``eot_samples`` forward passes of the gradient of the summed cross-entropy."""
    total = torch.zeros_like(x_adv)
    for _ in range(eot_samples):
        xa = x_adv.detach().requires_grad_(True)
        loss = F.cross_entropy(model(xa), y, reduction="sum")
        (g,) = torch.autograd.grad(loss, xa)
        total += g
    return total / eot_samples


def _setup(x, y, eps, norm, domain, eot_samples, model):
    eps = v.non_negative("eps", eps)
    norm = v.choice("norm", norm, NORMS)
    domain = _check_domain(domain)
    eot_samples = v.positive_int("eot_samples", eot_samples)
    _check_inputs(x, y, domain)
    if y is None:
        y = _labels(model, x)
    return eps, norm, domain, eot_samples, y


def _iterate(model, x, y, *, eps, steps, step_size, norm, domain, eot_samples, decay=None, start=None):
    """Shared loop of I-FGSM, MIM and PGD."""
    lo, hi = domain
    x_adv = x.clone() if start is None else start
    momentum = torch.zeros_like(x) if decay is not None else None
    for _ in range(steps):
        g = _grad(model, x_adv, y, eot_samples)
        if momentum is not None:
            momentum = decay * momentum + g / _per_example_norm(g, 1).clamp_min(_TINY)
            g = momentum
        x_adv = x_adv + step_size * _direction(g, norm)
        x_adv = (x + _project(x_adv - x, eps, norm)).clamp(lo, hi)
    return x_adv.detach()


class _KeepMode:
    """Leave the model's train/eval mode as it was found."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.was = self.model.training

    def __exit__(self, *exc):
        self.model.train(self.was)


def fgsm(model, x, y=None, *, eps, norm="linf", domain=(-1.0, 1.0), eot_samples=1):
    """FGSM (Goodfellow et al. 2015): x + eps * direction(grad), clamped to the domain."""
    with _KeepMode(model):
        eps, norm, domain, eot_samples, y = _setup(x, y, eps, norm, domain, eot_samples, model)
        if eps == 0:
            return x.clone()
        g = _grad(model, x, y, eot_samples)
        return (x + eps * _direction(g, norm)).clamp(*domain).detach()


def _iter_params(eps, steps, step_size):
    steps = v.positive_int("steps", steps)
    if step_size is None:
        step_size = 2.5 * eps / steps  # Madry et al.'s choice: can reach the boundary from anywhere
    else:
        step_size = v.positive("step_size", step_size)
    return steps, step_size


def ifgsm(model, x, y=None, *, eps, steps=10, step_size=None, norm="linf", domain=(-1.0, 1.0), eot_samples=1):
    """I-FGSM / BIM (Kurakin et al. 2017): iterated FGSM steps projected on the eps-ball."""
    with _KeepMode(model):
        eps, norm, domain, eot_samples, y = _setup(x, y, eps, norm, domain, eot_samples, model)
        steps, step_size = _iter_params(eps, steps, step_size)
        if eps == 0:
            return x.clone()
        return _iterate(model, x, y, eps=eps, steps=steps, step_size=step_size, norm=norm, domain=domain,
                        eot_samples=eot_samples)


def mim(model, x, y=None, *, eps, steps=10, step_size=None, decay=1.0, norm="linf", domain=(-1.0, 1.0),
        eot_samples=1):
    """MIM (Dong et al. 2018): g <- decay * g + grad / ||grad||_1, step along direction(g).

    With ``decay = 0`` this is exactly I-FGSM (the l1 normalisation does not change a direction).
    """
    with _KeepMode(model):
        eps, norm, domain, eot_samples, y = _setup(x, y, eps, norm, domain, eot_samples, model)
        steps, step_size = _iter_params(eps, steps, step_size)
        decay = v.non_negative("decay", decay)
        if eps == 0:
            return x.clone()
        return _iterate(model, x, y, eps=eps, steps=steps, step_size=step_size, norm=norm, domain=domain,
                        eot_samples=eot_samples, decay=decay)


def _random_start(x, eps, norm, domain, generator):
    lo, hi = domain
    if norm == "linf":
        u = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        delta = (2 * u - 1) * eps
    else:  # uniform in the l2 ball: Gaussian direction, radius eps * U^(1/d)
        d = x[0].numel()
        z = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        z = z / _per_example_norm(z, 2).clamp_min(_TINY)
        r = torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), generator=generator, device=x.device, dtype=x.dtype)
        delta = z * eps * r.pow(1.0 / d)
    return (x + delta).clamp(lo, hi)


def pgd(model, x, y=None, *, eps, steps=10, step_size=None, random_start=True, norm="linf",
        domain=(-1.0, 1.0), eot_samples=1, generator=None):
    """PGD / MadryEtAl (Madry et al. 2018): I-FGSM from a uniform random point of the ball."""
    with _KeepMode(model):
        eps, norm, domain, eot_samples, y = _setup(x, y, eps, norm, domain, eot_samples, model)
        steps, step_size = _iter_params(eps, steps, step_size)
        if eps == 0:
            return x.clone()
        start = None
        if random_start:
            if generator is None:
                raise ValueError("generator must be a torch.Generator when random_start is True")
            start = _random_start(x, eps, norm, domain, generator)
        return _iterate(model, x, y, eps=eps, steps=steps, step_size=step_size, norm=norm, domain=domain,
                        eot_samples=eot_samples, start=start)


_FNS = {"fgsm": fgsm, "ifgsm": ifgsm, "mim": mim, "pgd": pgd}


def attack(name: str, model, x, y=None, **kwargs):
    """Run the attack called ``name`` (one of ATTACKS, or the aliases bim / madry)."""
    if not isinstance(name, str):
        raise ValueError(f"attack must be a string, got {name!r}")
    key = ALIASES.get(name.lower(), name.lower())
    if key not in _FNS:
        raise ValueError(f"attack must be one of {', '.join(ATTACKS)}; got {name!r}")
    return _FNS[key](model, x, y, **kwargs)


def accuracy_under_attack(model, x, y, name: str, eps: float, *, batch_size: int = 500,
                          use_true_labels: bool = False, **kwargs) -> float:
    """Accuracy (against the true ``y``) on adversarial examples of ``x``, batch by batch."""
    batch_size = v.positive_int("batch_size", batch_size)
    device = next(model.parameters()).device
    correct = 0
    for s in range(0, x.shape[0], batch_size):
        xb = x[s:s + batch_size].to(device)
        yb = y[s:s + batch_size].to(device)
        adv = attack(name, model, xb, yb if use_true_labels else None, eps=eps, **kwargs)
        with torch.no_grad():
            correct += (model(adv).argmax(1) == yb).sum().item()
    return correct / x.shape[0]
