"""Adversarial attacks in an l-inf or l2 ball, batched, on the device of the input.

* FGSM (Goodfellow, Shlens & Szegedy 2015, "Explaining and harnessing adversarial examples"):
  one step of size eps along the steepest-ascent direction of the loss.
* I-FGSM / BIM (Kurakin, Goodfellow & Bengio 2017, "Adversarial examples in the physical
  world"): ``steps`` steps of ``step_size``, each projected on the eps-ball and the domain.
* MIM (Dong et al. 2018, "Boosting adversarial attacks with momentum"): I-FGSM along an
  accumulated gradient ``g <- decay * g + grad / ||grad||_1`` (per example).
* PGD / MadryEtAl (Madry et al. 2018, "Towards deep learning models resistant to adversarial
  attacks"): I-FGSM from a random point of the ball (l-inf: uniform in the cube; l2: a uniform
  direction at a radius uniform in [0, eps], as torchattacks' PGDL2 draws it; see
  ``_random_start``).
* APGD (Croce & Hein 2020, "Reliable evaluation of adversarial robustness with an ensemble of
  diverse parameter-free attacks", Alg. 1): PGD with momentum 0.75, step size 2 eps halved at
  checkpoints when the loss stalls, restarting from the best point; with the cross-entropy
  (``apgd_ce``) or the difference-of-logits-ratio loss (``apgd_dlr``, their Eq. 5).

Conventions
-----------
* Loss: cross-entropy on the model's logits, summed over the batch (per-example gradients are
  therefore not rescaled by the batch size; every step direction is scale-invariant anyway).
* Step direction (steepest ascent for the norm): ``sign(grad)`` for l-inf and
  ``grad / ||grad||_2`` per example for l2. A zero gradient gives a zero step, never NaN.
* Every iterate is projected on the ball around the *clean* input (per example for l2), then
  clamped to the input ``domain`` (default ``(-1, 1)``, the project's input scaling; attack
  sizes are in the domain's units). Clamping moves each coordinate towards the clean input,
  which lies in the domain, so it never leaves the ball.
* Labels: with ``y=None`` the attack uses the model's own prediction on the clean input (as
  the DPAL paper does, to avoid label leaking); with ``eot_samples = k > 1`` that prediction is
  the argmax of the softmax averaged over k forward passes.
* ``eot_samples = k``: the loss gradient is averaged over k forward passes (expectation over
  transformation), for models whose forward pass is random, e.g. PixelDP's noise layer.
* Gradients are taken with ``torch.autograd.grad`` with respect to the input only (also inside
  a ``torch.no_grad()`` block): no ``.grad`` accumulates in the model's parameters, and the
  train/eval mode of every submodule is left exactly as found.
* Default step size of the iterative attacks: ``2.5 * eps / steps`` (Madry et al.'s rule of
  thumb: enough to cross the ball from any starting point, with room to move along its
  boundary); pass ``step_size`` to override.
* ``eps = 0`` returns an exact copy of ``x`` (no forward pass).
* PGD's random start draws from an explicit ``torch.Generator`` (this project never uses the
  global random state for a randomized step); it is required when ``random_start`` is True.

Exact identities (tested): one-step PGD without random start and ``step_size = eps`` is FGSM;
MIM with ``decay = 0`` is I-FGSM with the same steps and step size.

Every invalid argument raises ``ValueError`` naming the parameter and the rule it broke.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

from dpmech import _validate as v

__all__ = ["ATTACKS", "ALIASES", "NORMS", "fgsm", "ifgsm", "mim", "pgd", "apgd", "apgd_ce", "apgd_dlr",
           "dlr_loss", "apgd_checkpoints", "EOT_AUTO_SAMPLES", "resolve_eot_samples", "attack", "accuracy_under_attack", "default_step_size"]

ATTACKS = ("fgsm", "ifgsm", "mim", "pgd", "apgd_ce", "apgd_dlr")
ALIASES = {"bim": "ifgsm", "i-fgsm": "ifgsm", "madry": "pgd", "madryetal": "pgd"}
NORMS = ("linf", "l2")
DEFAULT_DOMAIN = (-1.0, 1.0)
DOMAIN_TOLERANCE = 1e-6


# ----------------------------------------------------------------------------- validation

def _check_domain(domain) -> tuple[float, float]:
    if not isinstance(domain, (tuple, list)) or len(domain) != 2:
        raise ValueError(f"domain must be a pair (low, high), got {domain!r}")
    lo = v._real("domain[0]", domain[0])
    hi = v._real("domain[1]", domain[1])
    if not lo < hi:
        raise ValueError(f"domain must have low < high, got ({lo}, {hi})")
    return lo, hi


def _check_x(x, domain: tuple[float, float]) -> None:
    if not torch.is_tensor(x) or not x.is_floating_point():
        kind = f"a {x.dtype} tensor" if torch.is_tensor(x) else type(x).__name__
        raise ValueError(f"x must be a floating-point tensor, got {kind}")
    if x.dim() not in (2, 4) or x.shape[0] == 0 or x[0].numel() == 0:
        raise ValueError(f"x must have shape [N, C, H, W] or [N, D] with N > 0, got {tuple(x.shape)}")
    if not torch.isfinite(x.detach()).all().item():
        raise ValueError("x must be finite (it contains NaN or inf)")
    lo_x, hi_x = (t.item() for t in torch.aminmax(x.detach()))
    lo, hi = domain
    if lo_x < lo - DOMAIN_TOLERANCE or hi_x > hi + DOMAIN_TOLERANCE:
        raise ValueError(f"x must lie in the domain [{lo:g}, {hi:g}] (tolerance {DOMAIN_TOLERANCE:g}), "
                         f"got values in [{lo_x:.6g}, {hi_x:.6g}]")


def _check_y(y, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    if not torch.is_tensor(y) or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        kind = f"a {y.dtype} tensor" if torch.is_tensor(y) else type(y).__name__
        raise ValueError(f"y must be an integer tensor of class indices, got {kind}")
    if tuple(y.shape) != (n,):
        raise ValueError(f"y must have shape [{n}] (one label per row of x), got {tuple(y.shape)}")
    if y.min().item() < 0:
        raise ValueError(f"y must hold class indices >= 0, got {y.min().item()}")
    return y.to(device=x.device, dtype=torch.long)


def _check_steps(eps: float, steps, step_size) -> tuple[int, float]:
    steps = v.positive_int("steps", steps)
    step_size = default_step_size(eps, steps) if step_size is None else v.positive("step_size", step_size)
    return steps, step_size


def default_step_size(eps: float, steps: int) -> float:
    """``2.5 * eps / steps``: the default step of I-FGSM, MIM and PGD (Madry et al. 2018)."""
    return 2.5 * eps / steps


# ----------------------------------------------------------------------------- geometry

def _per_example(t: torch.Tensor) -> tuple[int, ...]:
    """Shape that broadcasts one value per example against ``t``."""
    return (t.shape[0],) + (1,) * (t.dim() - 1)


def _prescale(g: torch.Tensor) -> torch.Tensor:
    """``g`` divided per example by its largest absolute entry (zero rows stay zero).

    A positive per-example factor changes no direction; it keeps the norms computed next away
    from underflow (tiny gradients) and overflow.
    """
    m = g.detach().flatten(1).abs().amax(dim=1).view(_per_example(g))
    return torch.where(m > 0, g / torch.where(m > 0, m, torch.ones_like(m)), torch.zeros_like(g))


def _normalise(g: torch.Tensor, p: float) -> torch.Tensor:
    """``g / ||g||_p`` per example; a zero row stays zero."""
    g = _prescale(g)
    n = g.flatten(1).norm(p=p, dim=1).view(_per_example(g))  # >= 1 for a non-zero row
    return torch.where(n > 0, g / torch.where(n > 0, n, torch.ones_like(n)), torch.zeros_like(g))


def _direction(g: torch.Tensor, norm: str) -> torch.Tensor:
    """Steepest-ascent unit direction for the norm: sign(g) for l-inf, g / ||g||_2 for l2."""
    return g.sign() if norm == "linf" else _normalise(g, 2)


def _project(delta: torch.Tensor, eps: float, norm: str) -> torch.Tensor:
    """Euclidean projection of ``delta`` on the eps-ball of the norm (per example for l2)."""
    if norm == "linf":
        return delta.clamp(-eps, eps)
    n = delta.flatten(1).norm(p=2, dim=1).view(_per_example(delta))
    scale = torch.where(n > eps, eps / torch.where(n > 0, n, torch.ones_like(n)), torch.ones_like(n))
    return delta * scale


def _random_start(x: torch.Tensor, eps: float, norm: str, domain, generator: torch.Generator) -> torch.Tensor:
    """A random point of the eps-ball around ``x``, clamped to the domain.

    l-inf: each coordinate uniform in [-eps, eps] (Madry et al.'s start). l2: a Gaussian
    direction normalised to unit length, times a radius ``eps * U`` uniform in [0, eps] (as
    torchattacks' PGDL2 does). A point uniform in the ball's *volume* (radius eps U^(1/d)) sits
    at the boundary in high dimension (d = 784: 99% of the mass beyond 0.994 eps), so every
    restart begins at the same distance; the radius-uniform start also explores the interior
    (torchattacks' PGDL2 with it was 0.4-0.9 points stronger at l2 2.0 on an MNIST CNN, issue
    18; docs/attacks.md). Drawn on the generator's device, then moved to ``x``'s.
    """
    gdev = generator.device
    if norm == "linf":
        u = torch.rand(x.shape, generator=generator, device=gdev, dtype=x.dtype)
        delta = (2 * u - 1) * eps
    else:
        d = x[0].numel()
        z = torch.randn(x.shape, generator=generator, device=gdev, dtype=x.dtype)
        r = torch.rand(_per_example(x), generator=generator, device=gdev, dtype=x.dtype)
        delta = _normalise(z, 2) * (eps * r)
    return (x + delta.to(x.device)).clamp(*domain)


# ----------------------------------------------------------------------------- model calls

@contextmanager
def _modes_preserved(model: torch.nn.Module):
    """Restore the train/eval flag of every submodule as found (mixed modes included)."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:
            if m.training != training:
                m.training = training


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if not torch.is_tensor(out) or out.dim() != 2 or out.shape[0] != x.shape[0]:
        shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise ValueError(f"model must return logits of shape [N, K] = [{x.shape[0]}, classes], got {shape}")
    return out


def _predicted_labels(model, x: torch.Tensor, eot_samples: int) -> torch.Tensor:
    """The model's prediction on the clean input (mean softmax over ``eot_samples`` passes)."""
    with torch.no_grad():
        if eot_samples == 1:
            return _logits(model, x).argmax(dim=1)
        probs = sum(F.softmax(_logits(model, x).float(), dim=1) for _ in range(eot_samples))
        return probs.argmax(dim=1)


def _loss_grad(model, x_adv: torch.Tensor, y: torch.Tensor, eot_samples: int, y_max: int = -1) -> torch.Tensor:
    """Mean over ``eot_samples`` forward passes of d(sum of cross-entropies) / d(input).

    ``y_max`` (the largest label, known in advance) is checked against the number of logits
    before the loss is computed (an out-of-range label is a device-side assert on a GPU).
    """
    total = torch.zeros_like(x_adv)
    for _ in range(eot_samples):
        _, _, g = _one_pass(model, x_adv, y_max, lambda logits: F.cross_entropy(logits, y, reduction="sum"))
        if g is not None:
            total += g
    return total / eot_samples if eot_samples > 1 else total


def _one_pass(model, x_adv: torch.Tensor, y_max: int, loss_of):
    """One forward pass at ``x_adv``: the logits, ``loss_of(logits)`` and its gradient with respect
    to the input (None where the loss does not depend on it). Labels above the model's classes are
    refused before the loss is computed (an out-of-range label is a device-side assert on a GPU)."""
    with torch.enable_grad():
        xa = x_adv.detach().clone().requires_grad_(True)
        logits = _logits(model, xa)
        if y_max >= logits.shape[1]:
            raise ValueError(f"y must hold class indices < {logits.shape[1]} (the model's number of classes), "
                             f"got {y_max}")
        loss = loss_of(logits)
        g = None
        if loss.requires_grad:
            (g,) = torch.autograd.grad(loss.sum(), xa, allow_unused=True)
    return logits.detach(), loss.detach(), g


def _iterate(model, x, y, *, eps, steps, step_size, norm, domain, eot_samples, decay=None, start=None):
    """Shared loop of FGSM, I-FGSM, MIM and PGD.

    ``decay=None``: plain I-FGSM steps along direction(grad). Otherwise MIM: the step follows
    direction(g) with ``g <- decay * g + grad / ||grad||_1``. With ``decay = 0`` the accumulated
    ``g`` is the current gradient times a positive per-example factor, which the direction
    ignores, so the raw gradient is used: MIM(decay=0) is then bitwise I-FGSM.
    """
    x_adv = x.clone() if start is None else start
    y_max = int(y.max().item())
    momentum = None
    for _ in range(steps):
        g = _loss_grad(model, x_adv, y, eot_samples, y_max)
        if decay is not None and decay > 0:
            momentum = _normalise(g, 1) if momentum is None else decay * momentum + _normalise(g, 1)
            g = momentum
        x_adv = x_adv + step_size * _direction(g, norm)
        x_adv = (x + _project(x_adv - x, eps, norm)).clamp(*domain)
    return x_adv.detach()


def _prepare(model, x, y, eps, norm, domain, eot_samples):
    """Validate the arguments common to every attack; labels are resolved later (lazily)."""
    eps = v.non_negative("eps", eps)
    norm = v.choice("norm", norm, NORMS)
    domain = _check_domain(domain)
    eot_samples = v.positive_int("eot_samples", eot_samples)
    if not callable(model):
        raise ValueError(f"model must be a callable torch module, got {type(model).__name__}")
    _check_x(x, domain)
    if y is not None:
        y = _check_y(y, x)
    return eps, norm, domain, eot_samples, y


def _run(model, x, y, *, eps, norm, domain, eot_samples, runner=None, **loop):
    """The frame of every iterative attack: eps 0 returns x; the model's modes are kept; y defaults
    to the model's predictions; ``start_fn(x)`` gives the first iterate; ``runner`` (default
    ``_iterate``) runs the steps."""
    x = x.detach()
    if eps == 0:
        return x.clone()
    ctx = _modes_preserved(model) if isinstance(model, torch.nn.Module) else nullcontext()
    with ctx:
        if y is None:
            y = _predicted_labels(model, x, eot_samples)
        start = loop.pop("start_fn", None)
        if start is not None:
            loop["start"] = start(x)
        return (runner or _iterate)(model, x, y, eps=eps, norm=norm, domain=domain, eot_samples=eot_samples, **loop)


# ----------------------------------------------------------------------------- attacks

def fgsm(model, x, y=None, *, eps, norm="linf", domain=DEFAULT_DOMAIN, eot_samples=1) -> torch.Tensor:
    """Fast gradient sign method (Goodfellow et al. 2015), and its l2 analogue.

    ``x + eps * direction(grad_x loss)``, clamped to ``domain``: ``direction`` is ``sign`` for
    ``norm="linf"`` and ``grad / ||grad||_2`` for ``norm="l2"`` (the fast gradient method).

    Args:
        model: returns logits ``[N, K]``; its mode and parameter gradients are left untouched.
        x: clean inputs ``[N, C, H, W]`` or ``[N, D]`` within ``domain``.
        y: labels ``[N]``; ``None`` uses the model's prediction on ``x`` (no label leaking).
        eps: attack size (>= 0) in the units of ``domain``; 0 returns an exact copy of ``x``.
        eot_samples: forward passes the gradient is averaged over (random models).
    """
    eps, norm, domain, eot_samples, y = _prepare(model, x, y, eps, norm, domain, eot_samples)
    return _run(model, x, y, eps=eps, norm=norm, domain=domain, eot_samples=eot_samples,
                steps=1, step_size=eps)


def ifgsm(model, x, y=None, *, eps, steps=10, step_size=None, norm="linf", domain=DEFAULT_DOMAIN,
          eot_samples=1) -> torch.Tensor:
    """Iterative FGSM / basic iterative method, BIM (Kurakin et al. 2017).

    From the clean ``x``, ``steps`` times: ``x' <- clamp_domain(x + P_eps(x' + step_size *
    direction(grad) - x))`` where ``P_eps`` projects on the eps-ball (l-inf or l2).
    ``step_size`` defaults to ``2.5 * eps / steps``. Other arguments as in :func:`fgsm`.
    """
    eps, norm, domain, eot_samples, y = _prepare(model, x, y, eps, norm, domain, eot_samples)
    steps, step_size = _check_steps(eps, steps, step_size)
    return _run(model, x, y, eps=eps, norm=norm, domain=domain, eot_samples=eot_samples,
                steps=steps, step_size=step_size)


def mim(model, x, y=None, *, eps, steps=10, step_size=None, decay=1.0, norm="linf", domain=DEFAULT_DOMAIN,
        eot_samples=1) -> torch.Tensor:
    """Momentum iterative method, MI-FGSM (Dong et al. 2018).

    ``g_{t+1} = decay * g_t + grad / ||grad||_1`` (l1 norm per example, ``g_0 = 0``), then an
    I-FGSM step along ``sign(g_{t+1})`` (l-inf) or ``g_{t+1} / ||g_{t+1}||_2`` (l2), projected
    on the eps-ball and clamped to the domain. ``decay`` (the paper's mu, default 1.0) must be
    >= 0; with ``decay = 0`` this is exactly :func:`ifgsm`. ``step_size`` defaults to
    ``2.5 * eps / steps`` (the paper uses ``eps / steps``; pass it to reproduce).
    """
    eps, norm, domain, eot_samples, y = _prepare(model, x, y, eps, norm, domain, eot_samples)
    steps, step_size = _check_steps(eps, steps, step_size)
    decay = v.non_negative("decay", decay)
    return _run(model, x, y, eps=eps, norm=norm, domain=domain, eot_samples=eot_samples,
                steps=steps, step_size=step_size, decay=decay)


def pgd(model, x, y=None, *, eps, steps=10, step_size=None, random_start=True, norm="linf",
        domain=DEFAULT_DOMAIN, eot_samples=1, generator=None) -> torch.Tensor:
    """Projected gradient descent, MadryEtAl (Madry et al. 2018).

    I-FGSM started from a random point of the eps-ball around ``x`` (clamped to the domain):
    uniform per coordinate for l-inf; for l2 a uniform direction at a radius uniform in
    [0, eps] (``_random_start``). The start is drawn from ``generator`` (a ``torch.Generator``, required
    when ``random_start`` is True; it may live on another device than ``x``). ``step_size``
    defaults to ``2.5 * eps / steps``. With ``random_start=False``, ``steps=1`` and
    ``step_size=eps`` this is exactly :func:`fgsm`.
    """
    eps, norm, domain, eot_samples, y = _prepare(model, x, y, eps, norm, domain, eot_samples)
    steps, step_size = _check_steps(eps, steps, step_size)
    if not isinstance(random_start, bool):
        raise ValueError(f"random_start must be a bool, got {random_start!r}")
    start_fn = None
    if random_start:
        if not isinstance(generator, torch.Generator):
            raise ValueError("generator must be a torch.Generator when random_start is True "
                             f"(randomized steps take an explicit generator), got {type(generator).__name__}")
        start_fn = lambda x0: _random_start(x0, eps, norm, domain, generator)  # noqa: E731
    return _run(model, x, y, eps=eps, norm=norm, domain=domain, eot_samples=eot_samples,
                steps=steps, step_size=step_size, start_fn=start_fn)


# ----------------------------------------------------------------------------- EOT default

# EOT draws per gradient for a model whose forward pass is random, when eot_samples is "auto":
# where more draws stopped helping on a noise-augmented MNIST CNN (sigma 0.5) under PGD-10
# (benchmarks/eot_convergence.py, benchmarks/results/eot_convergence.json; docs/attacks.md).
EOT_AUTO_SAMPLES = 8


def resolve_eot_samples(model, x: torch.Tensor, eot_samples) -> int:
    """``eot_samples`` itself (a positive int), or for ``"auto"``: ``EOT_AUTO_SAMPLES`` when two
    forward passes of ``model`` on ``x`` differ (a random forward pass), else 1. The global RNG
    state is restored after the two passes."""
    if eot_samples == "auto":
        from dpmech.robustness.certification import has_random_forward

        return EOT_AUTO_SAMPLES if has_random_forward(model, x) else 1
    return v.positive_int("eot_samples", eot_samples)


# ----------------------------------------------------------------------------- APGD


def dlr_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Difference of logits ratio (Croce & Hein 2020, Eq. 5), per example:
    -(z_y - max_{i != y} z_i) / (z_pi1 - z_pi3 + 1e-12), z sorted decreasingly (pi1 >= pi2 >= pi3).
    Invariant to shifting and scaling the logits; needs at least 3 classes."""
    if logits.shape[1] < 3:
        raise ValueError(f"the DLR loss needs at least 3 classes, the model has {logits.shape[1]}")
    z_sorted, _ = logits.sort(dim=1, descending=True)
    z_y = logits.gather(1, y[:, None]).squeeze(1)
    other = logits.scatter(1, y[:, None], float("-inf")).amax(dim=1)
    return -(z_y - other) / (z_sorted[:, 0] - z_sorted[:, 2] + 1e-12)


def _per_example_loss(name: str, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "ce":
        return F.cross_entropy(logits, y, reduction="none")
    return dlr_loss(logits, y)


def apgd_checkpoints(steps: int) -> list[int]:
    """The checkpoints w_j of Croce & Hein 2020, Sec. 3.2, as AutoAttack computes them: the first
    after ``p_1 = 0.22`` of the iterations, then each interval shrinks by 0.03 of them down to a
    minimum of 0.06 (``max(int(f * steps), 1)`` iterations each). Iterations are 1-based: the
    step size is checked right after iteration w_j."""
    first, minimum, decrease = max(int(0.22 * steps), 1), max(int(0.06 * steps), 1), max(int(0.03 * steps), 1)
    out, at, k = [], 0, first
    while at + k <= steps:
        at += k
        out.append(at)
        k = max(k - decrease, minimum)
    return out


def _loss_value_and_grad(model, x_adv, y, loss_name: str, eot_samples: int, y_max: int):
    """Per-example loss (mean over ``eot_samples`` passes), its input gradient (mean), and the
    mean softmax's prediction."""
    grad = torch.zeros_like(x_adv)
    loss_sum = probs = None
    for _ in range(eot_samples):
        logits, loss, g = _one_pass(
            model, x_adv, y_max,
            lambda logits: _per_example_loss(loss_name, logits.to(torch.promote_types(logits.dtype, torch.float32)), y))
        if g is not None:
            grad += g
        p = F.softmax(logits.float(), dim=1)
        loss_sum = loss if loss_sum is None else loss_sum + loss
        probs = p if probs is None else probs + p
    return loss_sum / eot_samples, grad / eot_samples, probs.argmax(dim=1)


def _apgd_project(x: torch.Tensor, x_new: torch.Tensor, eps: float, norm: str, domain) -> torch.Tensor:
    return (x + _project(x_new - x, eps, norm)).clamp(*domain)


def _apgd_run(model, x, y, *, eps, steps, norm, domain, eot_samples, loss_name, start, rho=0.75, momentum=0.75):
    """Alg. 1 of Croce & Hein (2020), vectorised over the batch (each example has its own step
    size, best point and checkpoint state), in AutoAttack's form:

    * eta^(0) = 2 eps; x^(1) = P(x^(0) + eta grad) (no momentum on the first step);
    * z = P(x^(k) + eta dir(grad)); x^(k+1) = P(x^(k) + a (z - x^(k)) + (1 - a)(x^(k) - x^(k-1))),
      a = 0.75 (dir = sign for l-inf, grad / ||grad||_2 for l2);
    * at each checkpoint w_j (``apgd_checkpoints``): halve eta and restart from the best point
      x_max (with its gradient) where Condition 1 (the loss increased in at most rho = 0.75 of
      the iterations since the last checkpoint) or Condition 2 (eta was not halved at the last
      checkpoint and the best loss has not improved since) holds.

    Returns (x_best: highest loss seen, fooled: misclassified at some iterate, x_fooled: the last
    misclassified iterate)."""
    y_max = int(y.max().item())
    per = _per_example(x)
    x_adv = start.clone()
    loss, grad, pred = _loss_value_and_grad(model, x_adv, y, loss_name, eot_samples, y_max)
    fooled = pred != y
    x_fooled = x_adv.clone()
    x_best, grad_best, loss_best = x_adv.clone(), grad.clone(), loss.clone()
    step = torch.full((x.shape[0],), 2.0 * eps, device=x.device, dtype=x.dtype)
    checkpoints = set(apgd_checkpoints(steps))
    last_check, increased = 0, torch.zeros(x.shape[0], device=x.device)
    loss_best_at_check = loss_best.clone()
    reduced_at_check = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    x_prev, loss_prev = x_adv.clone(), loss.clone()
    for it in range(1, steps + 1):
        a = 1.0 if it == 1 else momentum
        z = _apgd_project(x, x_adv + step.view(per) * _direction(grad, norm), eps, norm, domain)
        x_new = _apgd_project(x, x_adv + a * (z - x_adv) + (1 - a) * (x_adv - x_prev), eps, norm, domain)
        x_prev, x_adv = x_adv, x_new
        loss, grad, pred = _loss_value_and_grad(model, x_adv, y, loss_name, eot_samples, y_max)
        now_fooled = pred != y
        x_fooled = torch.where(now_fooled.view(per), x_adv, x_fooled)
        fooled |= now_fooled
        increased += (loss > loss_prev).float()
        loss_prev = loss
        better = loss > loss_best
        x_best = torch.where(better.view(per), x_adv, x_best)
        grad_best = torch.where(better.view(per), grad, grad_best)
        loss_best = torch.where(better, loss, loss_best)
        if it in checkpoints:
            cond1 = increased <= rho * (it - last_check)
            cond2 = ~reduced_at_check & (loss_best_at_check >= loss_best)
            reduce = cond1 | cond2
            reduced_at_check = reduce
            loss_best_at_check = loss_best.clone()
            step = torch.where(reduce, step / 2, step)
            x_adv = torch.where(reduce.view(per), x_best, x_adv)
            grad = torch.where(reduce.view(per), grad_best, grad)
            increased.zero_()
            last_check = it
    return x_best, fooled, x_fooled


def apgd(model, x, y=None, *, eps, steps=100, loss="ce", norm="linf", domain=DEFAULT_DOMAIN, eot_samples=1,
         random_start=True, generator=None) -> torch.Tensor:
    """Auto-PGD (Croce & Hein 2020, Alg. 1) with the cross-entropy (``loss="ce"``) or the DLR loss
    (``loss="dlr"``, Eq. 5); ``_apgd_run`` gives the steps.

    Starts from a random point of the ball (``generator`` required, as for :func:`pgd`; l-inf:
    uniform in the cube, l2: ``_random_start``) or, with ``random_start=False``, from ``x``.
    ``steps`` defaults to 100 (AutoAttack's standard). With ``eot_samples = k`` the loss and
    gradient are means over k forward passes and "misclassified" uses the mean softmax.
    Returns, per example, the last iterate that was misclassified, else the iterate of highest
    loss (an example never fooled is returned at its worst point, not as the clean input).
    """
    eps, norm, domain, eot_samples, y = _prepare(model, x, y, eps, norm, domain, eot_samples)
    steps = v.positive_int("steps", steps)
    loss = v.choice("loss", loss, ("ce", "dlr"))
    if not isinstance(random_start, bool):
        raise ValueError(f"random_start must be a bool, got {random_start!r}")
    if random_start and not isinstance(generator, torch.Generator):
        raise ValueError("generator must be a torch.Generator when random_start is True "
                         f"(randomized steps take an explicit generator), got {type(generator).__name__}")
    start = (lambda x0: _random_start(x0, eps, norm, domain, generator)) if random_start else (lambda x0: x0.clone())
    return _run(model, x, y, eps=eps, norm=norm, domain=domain, eot_samples=eot_samples, runner=_apgd_result,
                start_fn=start, steps=steps, loss_name=loss).detach()


def _apgd_result(model, x, y, **run) -> torch.Tensor:
    """Per example, the last misclassified iterate of ``_apgd_run``, else its iterate of highest loss."""
    x_best, fooled, x_fooled = _apgd_run(model, x, y, **run)
    return torch.where(fooled.view(_per_example(x)), x_fooled, x_best)


def apgd_ce(model, x, y=None, **kwargs) -> torch.Tensor:
    """APGD with the cross-entropy loss (AutoAttack's APGD-CE); arguments as :func:`apgd`."""
    return apgd(model, x, y, loss="ce", **kwargs)


def apgd_dlr(model, x, y=None, **kwargs) -> torch.Tensor:
    """APGD with the DLR loss (AutoAttack's APGD-DLR, Croce & Hein 2020 Eq. 5); arguments as :func:`apgd`."""
    return apgd(model, x, y, loss="dlr", **kwargs)


_FNS = {"fgsm": fgsm, "ifgsm": ifgsm, "mim": mim, "pgd": pgd, "apgd_ce": apgd_ce, "apgd_dlr": apgd_dlr}
_SIGNATURES = {"apgd_ce": apgd, "apgd_dlr": apgd}


def _resolve(name) -> str:
    if not isinstance(name, str):
        raise ValueError(f"attack must be a string naming an attack, got {name!r}")
    key = ALIASES.get(name.lower(), name.lower())
    if key not in _FNS:
        raise ValueError(f"attack must be one of {', '.join(repr(a) for a in ATTACKS)} "
                         f"(aliases: {', '.join(repr(a) for a in ALIASES)}); got {name!r}")
    return key


def attack(name: str, model, x, y=None, **kwargs) -> torch.Tensor:
    """Run the attack called ``name`` (one of ``ATTACKS``, or an alias: bim, madry, ...).

    ``kwargs`` go to the attack (``eps`` is required); an argument the attack does not take
    raises ``ValueError`` naming it.
    """
    key = _resolve(name)
    fn = _FNS[key]
    allowed = set(inspect.signature(_SIGNATURES.get(key, fn)).parameters) - {"model", "x", "y", "loss"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(f"{unknown[0]} is not a parameter of attack {fn.__name__!r}; "
                         f"it takes {', '.join(sorted(allowed))}")
    return fn(model, x, y, **kwargs)


def accuracy_under_attack(model, x, y, name: str, eps: float, *, batch_size: int = 500,
                          use_true_labels: bool = False, **kwargs) -> float:
    """Accuracy against the true labels ``y`` on adversarial examples of ``x``, batch by batch.

    Each batch is moved to the model's device (that of its first parameter; ``x``'s device for
    a model without parameters) and attacked with ``attack(name, ..., eps=eps, **kwargs)``. The
    attack is given the true labels only if ``use_true_labels`` is True; by default it uses
    the model's own predictions (no label leaking). Predictions on the adversarial examples are
    one forward pass in the model's current mode (set ``eval()`` first for a deterministic
    model). For PGD with a random start, pass ``generator=``; it is shared by the batches.
    """
    _resolve(name)
    v.non_negative("eps", eps)
    batch_size = v.positive_int("batch_size", batch_size)
    if not isinstance(use_true_labels, bool):
        raise ValueError(f"use_true_labels must be a bool, got {use_true_labels!r}")
    if not torch.is_tensor(x) or x.dim() not in (2, 4) or x.shape[0] == 0:
        shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        raise ValueError(f"x must be a tensor of shape [N, C, H, W] or [N, D] with N > 0, got {shape}")
    _check_y(y, x)
    from dpmech.robustness.certification import model_device

    device = model_device(model, x.device)
    correct = 0
    for s in range(0, x.shape[0], batch_size):
        xb = x[s:s + batch_size].to(device)
        yb = y[s:s + batch_size].to(device=device, dtype=torch.long)
        adv = attack(name, model, xb, yb if use_true_labels else None, eps=eps, **kwargs)
        with torch.no_grad():
            correct += (_logits(model, adv).argmax(dim=1) == yb).sum().item()
    return correct / x.shape[0]
