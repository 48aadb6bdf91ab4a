"""An empty Poisson batch in every clipping engine: the step adds the noise N(0, (sigma C)^2) / B
and is taken (``DPSGDTrainer._empty_step``); ``clipping: flat`` used to crash there (issue 25)."""

import pytest
import torch
from torch import nn

from dpmech.privacy.secret import NoiseKey
from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer


def _update(mode: str, *, sigma: float = 1.0, lr: float = 0.5, batch: int = 4, seed: int = 3) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 50))
    cfg = DPSGDConfig(epsilon=None, noise_multiplier=sigma, max_grad_norm=2.0, batch_size=batch, epochs=1,
                      clipping=mode, lr=lr, momentum=0.0, seed=seed)
    trainer = DPSGDTrainer(model, torch.randn(16, 1, 8, 8), torch.randint(0, 50, (16,)), cfg,
                           noise_key=NoiseKey.reproducible(seed))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    n, loss, correct = trainer._step(torch.zeros(0, dtype=torch.long))
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (n, loss, correct) == (0, 0.0, 0) and trainer.steps == 1
    trainer.close()
    return after - before


@pytest.mark.parametrize("mode", ["flat", "ghost", "bk"])
def test_empty_batch_step_adds_calibrated_noise(mode):
    def calibrated(d: torch.Tensor) -> bool:
        # SGD step of the noise alone: -lr * N(0, (sigma C)^2) / B, sd 0.5 * 2 / 4 = 0.25 (3,250
        # parameters: the std's standard error is 1.2%, the mean's 0.0044)
        return d.mean().abs().item() < 0.02 and abs(d.std().item() / 0.25 - 1) < 0.05

    assert calibrated(_update(mode))
    # negative control: the same check on a step whose noise is 1.3 sigma (std 25% too high), and on
    # one divided by B = 2 instead of the expected batch 4, fails by about 20 standard errors
    assert not calibrated(_update(mode, sigma=1.3))
    assert not calibrated(_update(mode, batch=2, lr=0.5))


def test_empty_batch_flat_matches_bookkeeping_engine():
    """Same seed, same noise stream: the flat engine's empty step equals book-keeping's."""
    assert torch.allclose(_update("flat"), _update("bk"), atol=1e-6)


def test_empty_batch_without_noise_moves_nothing():
    """Negative control: sigma 0 and an empty batch leave the model where it was."""
    assert torch.count_nonzero(_update("flat", sigma=0.0)) == 0
