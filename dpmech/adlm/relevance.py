"""AdLM's private relevance analysis (Algorithm 1, lines 1-7): the average relevance R_j(D) of every
input feature to the model output, computed with Layer-wise Relevance Propagation (LRP, Bach et al.
2015, the epsilon rule), and released with Laplace noise (budget eps_1).

* ``RelevanceNet``         the network LRP explains: a plain ReLU CNN (conv 5x5/2 32 -> conv 5x5/2 64
                           -> fc 256 -> 10), trained without privacy by ``train_relevance_net`` on the
                           data it is given. The reference code explains a pre-trained LeNet-5 of the
                           LRP toolbox; which data that network may see is a privacy question
                           (docs/adlm.md, decision 1): the trainable gives it held-out public data.
* ``lrp_epsilon``          LRP-epsilon from the predicted class's softmax probability (the reference:
                           ``nn.lrp(ypred, 'epsilon', 1.)``), R_in = a * grad_a(z . stop(R / (z + eps sign z)))
                           for every affine layer and max-pooling, identity through ReLU and reshapes.
* ``normalized_relevance`` one map per example, |R| scaled so that every entry is in [0, 1] (``linf``,
                           the paper's assumption behind Delta_R = 2d/|D|) or the map's L1 norm is 1
                           (``l1``, Delta_R = 2/|D|). The normalisation is what bounds the sensitivity,
                           whatever the network.
* ``average_relevance``    R(D) = (1/|D|) sum_i r(x_i).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dpmech import _validate as v
from dpmech.adlm.budget import RELEVANCE_NORMS
from dpmech.networks.fit import fit_classifier

_PASS_THROUGH = (nn.ReLU, nn.Flatten, nn.Identity, nn.Dropout)


class RelevanceNet(nn.Module):
    """The ReLU CNN whose decisions LRP explains (inputs [N, C, 28, 28] in [-1, 1])."""

    def __init__(self, in_channels: int = 1, classes: int = 10, side: int = 28):
        super().__init__()
        s2 = (side + 1) // 2
        s4 = (s2 + 1) // 2
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv2d(32, 64, 5, stride=2, padding=2), nn.ReLU(), nn.Flatten(),
            nn.Linear(64 * s4 * s4, 256), nn.ReLU(),
            nn.Linear(256, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def train_relevance_net(x: torch.Tensor, y: torch.Tensor, *, epochs: int, generator: torch.Generator,
                        classes: int = 10, batch_size: int = 128, lr: float = 1e-3) -> RelevanceNet:
    """A ``RelevanceNet`` trained non-privately (Adam, cross-entropy) on (x, y); initialisation and
    shuffling come from ``generator`` (the global RNG is untouched)."""
    epochs = v.positive_int("relevance_epochs", epochs, minimum=0)
    if x.dim() != 4 or y.dim() != 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"relevance data must be [N, C, H, W] images with N labels, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = RelevanceNet(x.shape[1], classes, x.shape[2]).to(x.device)
    return fit_classifier(net, x, y, epochs=epochs, batch_size=batch_size, lr=lr, generator=generator)


def lrp_epsilon(layers: nn.Sequential, x: torch.Tensor, eps: float = 1.0) -> torch.Tensor:
    """LRP-epsilon relevance of every input feature, shaped like ``x``.

    The relevance starts at the predicted class's logit with value p_max, the softmax probability of
    the prediction (so it is in [0, 1]), and flows back layer by layer: for an affine layer (or
    max-pooling) z = layer(a), R_a = a * d/da [z . stop(R / (z + eps sign(z)))] (Montavon et al.'s
    gradient formulation of the epsilon rule); ReLU, Flatten, Identity and Dropout pass R through
    unchanged (reshaped to their input). Biases and the eps stabiliser absorb part of the relevance.
    """
    eps = v.positive("lrp_epsilon", eps)
    acts = [x.detach()]
    with torch.no_grad():
        for layer in layers:
            acts.append(layer(acts[-1]))
    logits = acts[-1]
    prob = logits.softmax(dim=1)
    pred = prob.argmax(dim=1)
    rel = torch.zeros_like(logits)
    rel[torch.arange(logits.shape[0]), pred] = prob[torch.arange(logits.shape[0]), pred]
    for layer, a in zip(reversed(list(layers)), reversed(acts[:-1])):
        if isinstance(layer, _PASS_THROUGH):
            rel = rel.reshape(a.shape)
            continue
        a = a.clone().requires_grad_(True)
        with torch.enable_grad():
            z = layer(a)
            stab = torch.where(z >= 0, torch.ones_like(z), -torch.ones_like(z))
            s = (rel / (z + eps * stab)).detach()
            (c,) = torch.autograd.grad((z * s).sum(), a)
        rel = (a * c).detach()
    return rel


def normalized_relevance(relevance: torch.Tensor, norm: str = "linf") -> torch.Tensor:
    """One map per example, |R| divided by its largest entry (``linf``: entries in [0, 1]) or by its sum
    (``l1``: L1 norm 1); an all-zero map stays zero. A per-example function, so replacing one
    example changes one map only (the sensitivity argument of ``relevance_sensitivity``)."""
    norm = v.choice("relevance_norm", norm, RELEVANCE_NORMS)
    a = relevance.detach().abs().flatten(1).to(torch.float64)
    denom = a.amax(dim=1, keepdim=True) if norm == "linf" else a.sum(dim=1, keepdim=True)
    out = torch.where(denom > 0, a / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(a))
    return out.reshape(relevance.shape)


@torch.no_grad()
def average_relevance(net: nn.Module, x: torch.Tensor, *, norm: str = "linf", lrp_eps: float = 1.0,
                      batch_size: int = 1000) -> torch.Tensor:
    """R(D) = (1/|D|) sum_{x_i in D} r(x_i) (Alg. 1 lines 1-7, before the noise), float64, shaped like one
    input; r is ``normalized_relevance`` of ``lrp_epsilon`` on ``net``."""
    if x.dim() != 4 or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty [N, C, H, W] batch, got {tuple(x.shape)}")
    layers = net.layers if hasattr(net, "layers") else net
    net.eval()
    total = torch.zeros(x.shape[1:], dtype=torch.float64, device=x.device)
    for s in range(0, x.shape[0], batch_size):
        r = lrp_epsilon(layers, x[s:s + batch_size], lrp_eps)
        total += normalized_relevance(r, norm).sum(dim=0)
    return total / x.shape[0]
