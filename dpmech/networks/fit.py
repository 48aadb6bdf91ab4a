"""Non-private supervised training of a classifier, for the networks a mechanism trains on public or
already-released data (AdLM's relevance network on public data, the judge and the train-on-synthetic
classifier of the generative mechanisms): no privacy cost is claimed for it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fit_classifier(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int,
                   lr: float, generator: torch.Generator) -> torch.nn.Module:
    """Adam at ``lr`` on the cross-entropy, ``epochs`` passes over (x, y) in batches of ``batch_size``,
    each pass in a random order drawn from ``generator``; returns ``model`` in eval mode."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=generator).to(x.device)
        for s in range(0, x.shape[0], batch_size):
            idx = order[s:s + batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    return model
