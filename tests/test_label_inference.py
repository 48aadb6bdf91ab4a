"""Label inference against label DP (issue 52, part 5; dpmech.privacy.mia.labels): the bound holds its
level on a mechanism that is exactly epsilon-label-DP (K-ary randomized response of the label), refutes
one that leaks more, reads no advantage from outputs independent of the labels, and finds a model that
outputs its training labels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpmech.privacy.mia.labels import label_epsilon_lower_bound, label_inference

K = 10


def _rr(y: torch.Tensor, eps: float, g: torch.Generator) -> torch.Tensor:
    """K-ary randomized response: keep the label w.p. e^eps / (e^eps + K - 1), else another uniformly."""
    keep = torch.rand(y.shape[0], generator=g) < math.exp(eps) / (math.exp(eps) + K - 1)
    other = (y + torch.randint(1, K, y.shape, generator=g)) % K
    return torch.where(keep, y, other)


def _one_hot(c: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(c, K).double()


def test_the_bound_holds_its_level_on_randomized_response_and_refutes_more():
    g = torch.Generator().manual_seed(0)
    over = 0
    for _ in range(100):
        y = torch.randint(0, K, (2000,), generator=g)          # labels drawn from the (uniform) prior
        res = label_inference(_one_hot(_rr(y, 1.0, g)), y)
        over += res.eps_lb > 1.0
    assert over <= 10                                           # 5 expected at 95%
    refuted = 0
    for _ in range(20):
        y = torch.randint(0, K, (2000,), generator=g)
        res = label_inference(_one_hot(_rr(y, 3.0, g)), y)
        refuted += res.eps_lb > 1.0
        assert res.eps_lb <= 3.0 + 0.3
    assert refuted >= 18


def test_outputs_independent_of_the_labels_give_no_advantage():
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, K, (2000,), generator=g)
    res = label_inference(torch.randn(2000, K, generator=g), y)
    assert abs(res.advantage) < 0.03 and res.prior_accuracy == pytest.approx(0.1) and res.eps_lb < 0.2   # 0 but at 5%


def test_a_model_that_outputs_its_labels_is_found_with_a_non_uniform_prior():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(1000, K)) * 2
    prior = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    y = torch.tensor([rng.choice(K, p=p) for p in prior])
    res = label_inference(_one_hot(y), y, prior=prior)
    assert res.accuracy == 1.0 and res.advantage > 0.3 and res.eps_lb > 3.0
    # the prior alone (guessing its mode) is not a leak
    res0 = label_inference(torch.tensor(logits), y, prior=prior)
    assert res0.eps_lb == 0.0 and abs(res0.advantage) < 0.06
    m = res.metrics()
    assert set(m) >= {"label_inference_accuracy", "label_inference_advantage", "label_inference_eps_lb"}


def test_refusals_and_edge_cases():
    with pytest.raises(ValueError, match="outputs must be"):
        label_inference(torch.zeros(3, K), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must be in"):
        label_inference(torch.zeros(3, K), torch.tensor([0, 1, K]))
    with pytest.raises(ValueError, match="prior must be"):
        label_inference(torch.zeros(3, K), torch.tensor([0, 1, 2]), prior=np.ones((3, K)))
    assert label_epsilon_lower_bound(0, np.full(100, 0.1)) == 0.0
    assert math.isinf(label_epsilon_lower_bound(100, np.full(100, 1e-9))) or \
        label_epsilon_lower_bound(100, np.full(100, 1e-9)) > 10
