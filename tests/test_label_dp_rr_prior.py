"""RRWithPrior / RR-Top-k (dpmech.label_dp.rr_prior, Ghazi et al. 2021 Alg. 1-2) and LP-MST
(dpmech.label_dp.recipe): exact output probabilities (every ratio <= e^eps, attained), a broken
variant that the same check rejects, the sampler against the exact probabilities, and the rule
that the stage-2 prior never reads part 2's labels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dpmech.privacy.secret import NoiseKey
from dpmech.label_dp.rr_prior import (matrix_epsilon, rr_prior_choose_k, rr_prior_matrix, rr_top_k, rr_top_k_matrix,
                                      rr_with_prior, uniform_prior)

K = 10
pytestmark = pytest.mark.usefixtures("one_thread")


def _priors(seed: int, n: int = 40) -> list[np.ndarray]:
    """Random priors of every shape that matters: Dirichlet of several concentrations, exact ties,
    one-hot (k* = 1), uniform (k* = K), and a prior with zeros."""
    rng = np.random.default_rng(seed)
    out = [rng.dirichlet(np.full(K, a)) for a in (0.05, 0.3, 1.0, 5.0) for _ in range(n // 4)]
    out += [np.eye(K)[3], np.full(K, 1.0 / K), np.array([0.3, 0.3, 0.3, 0.1] + [0.0] * (K - 4)),
            np.array([0.25] * 4 + [0.0] * (K - 4)), np.array([0.5, 0.5] + [0.0] * (K - 2))]
    return out


def _ks(priors, eps):
    return [int(rr_prior_choose_k(torch.tensor(p)[None], eps)[0][0]) for p in priors]


@pytest.mark.parametrize("eps", [0.05, 0.5, 1.0, 2.0, 4.0, 10.0, 50.0])
def test_every_output_ratio_is_at_most_e_eps_and_attained(eps):
    priors = _priors(int(eps * 100))
    ks = _ks(priors, eps)
    assert 1 in ks or eps < 1  # the one-hot prior gives k* = 1 once the objective favours it
    for p, k in zip(priors, ks):
        m = rr_prior_matrix(p, eps)
        assert np.allclose(m.sum(1), 1.0, atol=1e-12)
        assert (m >= 0).all()
        got = matrix_epsilon(m)
        assert got <= eps + 1e-9
        if k >= 2:
            assert got == pytest.approx(eps, abs=1e-7)   # RR on the top k spends exactly epsilon
        else:
            assert got == 0.0                           # k* = 1: the top label whatever y is


def test_k_star_extremes_uniform_one_hot_and_ties():
    for eps in (0.1, 1.0, 4.0, 20.0):
        k, _ = rr_prior_choose_k(uniform_prior(3, K), eps)
        assert k.tolist() == [K] * 3                     # uniform prior: plain K-ary RR (LP-1ST = RR)
        k, order = rr_prior_choose_k(torch.eye(K)[[2]].double(), eps)
        assert int(k[0]) == 1 and int(order[0, 0]) == 2
    # ties broken by the lower class index, deterministically
    p = torch.tensor([[0.1, 0.3, 0.3, 0.3] + [0.0] * (K - 4)])
    _, order = rr_prior_choose_k(p, 1.0)
    assert order[0, :4].tolist() == [1, 2, 3, 0]
    # k* maximises e^eps/(e^eps+k-1) * P(top k) by brute force
    rng = np.random.default_rng(5)
    for _ in range(200):
        q = rng.dirichlet(np.full(K, 0.5))
        eps = float(rng.uniform(0.1, 6))
        s = np.sort(q)[::-1].cumsum()
        obj = [math.exp(eps) / (math.exp(eps) + j) * s[j] for j in range(K)]
        k = _ks([q], eps)[0]
        assert obj[k - 1] == pytest.approx(max(obj), rel=1e-9)


def test_k_equals_K_matches_plain_rr_matrix():
    from dpmech.label_dp.release import rr_keep_prob, rr_output_matrix

    for eps in (0.3, 1.0, 3.0):
        m = rr_top_k_matrix(list(range(K)), K, eps)
        assert np.allclose(m, rr_output_matrix(rr_keep_prob(eps, K), K), atol=1e-14)


def _broken_top_k_matrix(order_row, k, eps):
    """Negative control: outside the top k the true label is *kept* with RR's keep probability
    (the output leaves Y_k), a plausible slip that leaks whether y is in the top k."""
    m = rr_top_k_matrix(order_row, k, eps)
    keep = 1.0 / (1.0 + (k - 1) * math.exp(-eps))
    for y in order_row[k:]:
        m[y] *= 1.0 - keep
        m[y, y] = keep
    return m


def _broken_keep_matrix(order_row, k, eps):
    """Negative control 2: the keep probability of k-ary RR computed with K instead of k."""
    m = rr_top_k_matrix(order_row, k, eps)
    keep = math.exp(eps) / (math.exp(eps) + K - 1)
    top = order_row[:k]
    for y in top:
        for o in top:
            m[y, o] = keep if o == y else (1 - keep) / (k - 1)
    return m


@pytest.mark.parametrize("eps", [0.5, 1.0, 4.0])
def test_negative_controls_are_rejected(eps):
    order = [4, 1, 7, 0, 2, 3, 5, 6, 8, 9]
    for k in (2, 3, 5):
        assert matrix_epsilon(rr_top_k_matrix(order, k, eps)) <= eps + 1e-12
        assert matrix_epsilon(_broken_top_k_matrix(order, k, eps)) > eps + 0.1
        bad = _broken_keep_matrix(order, k, eps)
        assert np.allclose(bad.sum(1), 1.0)
        assert matrix_epsilon(bad) < eps - 0.05 or matrix_epsilon(bad) > eps + 0.05  # not the RR it claims
    # and the sampler's empirical check below rejects the broken sampler too (see the frequency test)


def _freq_check(sample_fn, order, k, eps, n=200_000, seed=3):
    """Chi-square of the sampler's outputs for every true label y against the exact row M[y]."""
    m = rr_top_k_matrix(order, k, eps)
    pvals = []
    for y in range(K):
        g = torch.Generator().manual_seed(seed * 100 + y)
        out = sample_fn(torch.full((n,), y, dtype=torch.int64), torch.tensor(order).expand(n, K), torch.full((n,), k), eps, g)
        counts = np.bincount(out.numpy(), minlength=K)
        support = m[y] > 0
        assert counts[~support].sum() == 0, f"output outside the support for y={y}"
        pvals.append(chisquare(counts[support], m[y][support] * n).pvalue if support.sum() > 1 else 1.0)
    return min(pvals)


def test_sampler_frequencies_match_exact_probabilities_and_broken_sampler_fails():
    order = [4, 1, 7, 0, 2, 3, 5, 6, 8, 9]
    for k, eps in ((1, 1.0), (3, 1.0), (5, 0.5), (K, 2.0)):
        assert _freq_check(rr_top_k, order, k, eps) > 1e-4   # fixed seeds; 10 rows each

    def broken(y, order_t, k_t, eps, g):
        # keeps y with the RR-top-k probability even when y lies outside the top k
        out = rr_top_k(y, order_t, k_t, eps, g)
        keep = 1.0 / (1.0 + (k_t - 1) * math.exp(-eps))
        u = torch.rand(y.shape[0], generator=g, dtype=torch.float64)
        rank = (order_t == y[:, None]).to(torch.int64).argmax(1)
        return torch.where((rank >= k_t) & (u < keep), y, out)

    with pytest.raises(AssertionError, match="outside the support"):
        _freq_check(broken, order, 3, 1.0, n=20_000)


def test_large_epsilon_and_generator_determinism():
    y = torch.arange(K).repeat(100)
    p = torch.softmax(torch.randn(len(y), K, generator=torch.Generator().manual_seed(0), dtype=torch.float64), 1)
    a, ka = rr_with_prior(y, p, 800.0, torch.Generator().manual_seed(1))   # e^800 overflows a double
    b, kb = rr_with_prior(y, p, 800.0, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and torch.equal(ka, kb)
    inside = torch.tensor([int(yy) in rr_prior_choose_k(pp[None], 800.0)[1][0, :int(k)].tolist()
                           for yy, pp, k in zip(y, p, ka)])
    assert torch.equal(a[inside], y[inside])                                 # keep prob 1 - O(e^-800)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="^epsilon"):
        rr_with_prior(torch.zeros(2, dtype=torch.int64), uniform_prior(2, K), 0.0, torch.Generator())
    with pytest.raises(ValueError, match="^prior"):
        rr_with_prior(torch.zeros(2, dtype=torch.int64), -uniform_prior(2, K), 1.0, torch.Generator())
    with pytest.raises(ValueError, match="^y must have one label"):
        rr_with_prior(torch.zeros(3, dtype=torch.int64), uniform_prior(2, K), 1.0, torch.Generator())
    with pytest.raises(ValueError, match="^generator"):
        rr_with_prior(torch.zeros(2, dtype=torch.int64), uniform_prior(2, K), 1.0, 0)


def test_stage2_prior_reads_no_part2_label():
    """LP-2ST: the stage-2 prior comes from the stage-1 model on part 2's images; changing every
    label of part 2 leaves it, and the stage-1 release, unchanged."""
    from dpmech.label_dp import recipe as rc

    g = torch.Generator().manual_seed(0)
    n = 300
    x = torch.rand(n, 1, 28, 28, generator=g) * 2 - 1
    y = torch.randint(0, K, (n,), generator=g)
    seen = []
    real_rr = rc.rr_with_prior

    def spy(yy, prior, eps, gen):
        seen.append((yy.clone(), prior.clone()))
        return real_rr(yy, prior, eps, gen)

    cfg = rc.RecipeConfig(epochs=1, batch_size=100, width=4, hidden=8)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(rc._seed(7, 3)))
    p2 = perm[int(round(0.4 * n)):]
    y_alt = y.clone()
    y_alt[p2] = (y[p2] + 1 + torch.randint(0, K - 1, (len(p2),), generator=g)) % K   # every part-2 label changed
    assert (y_alt[p2] != y[p2]).all()
    old = rc.rr_with_prior
    rc.rr_with_prior = spy
    try:
        key = NoiseKey.reproducible(7)   # the same release randomness in both worlds
        rc.train_label_dp("lp2st", x, y, 1.0, seed=7, cfg=cfg, noise_key=key)
        rc.train_label_dp("lp2st", x, y_alt, 1.0, seed=7, cfg=cfg, noise_key=key)
    finally:
        rc.rr_with_prior = old
    (y1a, pr1a), (y2a, pr2a), (y1b, pr1b), (y2b, pr2b) = seen
    assert torch.equal(y1a, y1b) and torch.equal(pr1a, pr1b)     # stage 1 saw the same labels
    assert torch.equal(pr2a, pr2b)                                # the stage-2 prior is identical
    assert not torch.equal(y2a, y2b)                              # although part 2's labels differ


# ---------------------------------------------------------------- the trainer (trainables' path)


def _data(n=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 28, 28, generator=g) * 2 - 1, torch.randint(0, K, (n,), generator=g)


def test_lp1st_release_is_rr_shaped_and_bad_configs_name_the_field():
    from dpmech.label_dp.trainer import LabelDPConfig
    from dpmech.label_dp.release import release_labels, rr_keep_prob

    y = torch.randint(0, K, (200_000,), generator=torch.Generator().manual_seed(1))
    r = release_labels(y, num_classes=K, task="classification", mechanism="lp1st", epsilon=1.0,
                       generator=torch.Generator().manual_seed(2))
    assert r.epsilon() == 1.0 == r.label_epsilon()
    assert float(r.kept(y).float().mean()) == pytest.approx(rr_keep_prob(1.0, K), abs=0.004)
    for kwargs, field in [(dict(mechanism="lp2st", stage1_epochs=0, epochs=3), "stage1_epochs"),
                          (dict(mechanism="lp2st", stage1_epochs=3, epochs=3), "stage1_epochs"),
                          (dict(mechanism="rr", stage1_epochs=1), "stage1_epochs"),
                          (dict(mechanism="lp1st", task="regression"), "mechanism"),
                          (dict(recipe="sgd"), "recipe"), (dict(stage1_fraction=1.0), "stage1_fraction"),
                          (dict(prior_mode="x"), "prior_mode"), (dict(momentum=1.0), "momentum")]:
        with pytest.raises(ValueError, match=field):
            LabelDPConfig(**kwargs)
    with pytest.raises(ValueError, match="two stages"):
        release_labels(y, num_classes=K, task="classification", mechanism="lp2st", epsilon=1.0,
                       generator=torch.Generator())


def test_lp2st_trainer_releases_each_label_once_and_restores_bit_for_bit():
    import io

    from dpmech.label_dp.trainer import LabelDPConfig, LabelDPTrainer

    x, y = _data()
    cfg = LabelDPConfig(mechanism="lp2st", epsilon=2.0, epochs=4, stage1_epochs=2, batch_size=40, lr=0.05,
                        recipe="mixup_sgd", seed=3)
    key = NoiseKey.fresh()          # the owner's: stage 2 draws from it, not from the checkpoint (issue 48)
    a = LabelDPTrainer(cfg, x, y, noise_key=key)
    part1 = a.part1
    assert len(part1) == 48 and (a.labels[part1] >= 0).all() and (a.labels < 0).sum() == 120 - 48
    first = a.labels.clone()
    a.train_epoch()
    a.train_epoch()
    assert torch.equal(a.labels, first) and a.stage == 1
    p_stage1 = a.privacy()
    assert p_stage1["epsilon"] == 2.0 and 0 < p_stage1["analytic_keep_prob"] < 1
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    assert "label_gen" not in state
    a.train_epoch()                                  # stage 2 begins: part 2 released once
    assert a.stage == 2 and (a.labels >= 0).all()
    assert torch.equal(a.labels[part1], first[part1])   # part 1 never redrawn
    second = a.labels.clone()
    a.train_epoch()
    assert torch.equal(a.labels, second)
    p = a.privacy()
    assert p["epsilon"] == 2.0 == p["label_epsilon"] and p["delta"] == 0.0
    assert 0 <= p["analytic_keep_prob"] <= 1 and 0 <= p["label_keep_rate"] <= 1

    b = LabelDPTrainer(cfg, x, y, noise_key=key)
    b.load_state_dict(state)
    b.train_epoch()
    b.train_epoch()
    assert torch.equal(b.labels, second)
    for pa, pb in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        assert torch.equal(pa, pb)
    assert a.privacy() == b.privacy()


def test_lr_schedule_warms_up_then_decays_to_zero():
    from dpmech.label_dp.recipe import lr_at

    lrs = [lr_at(s, 100, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.01) and lrs[9] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(0.1 / 90)


def test_denoised_prior_inverts_the_rr_channel():
    from dpmech.label_dp.release import rr_keep_prob
    from dpmech.label_dp.recipe import denoise_rr_prior

    rng = np.random.default_rng(0)
    clean = torch.tensor(rng.dirichlet(np.full(K, 0.3), size=50))
    for eps in (0.5, 1.0, 4.0):
        keep = rr_keep_prob(eps, K)
        q = (1 - keep) / (K - 1)
        noisy = q + (keep - q) * clean                      # what a perfect stage-1 model learns
        assert torch.allclose(denoise_rr_prior(noisy, eps), clean, atol=1e-12)
        assert torch.allclose(noisy.sum(1), torch.ones(50, dtype=torch.float64))


def test_trial_schema_and_adapter_run_lp2st():
    from trainables.label_dp import LabelDPMechanism, LabelDPTrialConfig
    from trainables.runtime import evaluate, validate_config

    for bad, field in [({"mechanism": "lp2st", "epochs": 3}, "stage1_epochs"),
                       ({"mechanism": "lp1st", "task": "regression"}, "mechanism"),
                       ({"recipe": "adamw"}, "recipe"), ({"mixup_alpha": -1.0}, "mixup_alpha"),
                       ({"recipe": "adam", "width": 32}, "width"), ({"recipe": "mixup_sgd", "hidden": 0}, "hidden")]:
        with pytest.raises(ValueError, match=field):
            validate_config(bad, LabelDPTrialConfig)
    x, y = _data(200, seed=1)
    cfg = LabelDPTrialConfig(mechanism="lp2st", epsilon=4.0, epochs=2, stage1_epochs=1, recipe="mixup_sgd",
                             lr=0.05, batch_size=50, test_size=100)
    mech = LabelDPMechanism(cfg, x, y, torch.device("cpu"))
    for _ in range(cfg.epochs):
        mech.train_epoch()
    m = evaluate(mech, cfg, x[:100], y[:100])["metrics"]
    assert m["epsilon"] == 4.0 and m["delta"] == 0.0 and m["label_epsilon"] == 4.0
    # the recipe's network is sized by width / hidden (the default 16 / 128, here 8 / 24)
    assert mech.trainer.model.features[0].out_channels == 16
    small = LabelDPMechanism(cfg.model_copy(update={"width": 8, "hidden": 24}), x, y, torch.device("cpu"))
    convs = [mod for mod in small.trainer.model.modules() if isinstance(mod, torch.nn.Conv2d)]
    linears = [mod for mod in small.trainer.model.modules() if isinstance(mod, torch.nn.Linear)]
    assert [c.out_channels for c in convs] == [8, 16] and linears[0].out_features == 24
    assert {"acc_clean", "label_keep_rate", "analytic_keep_prob"} <= set(m)


def test_report_figure_draws_every_method_from_a_benchmark_result(tmp_path):
    from sweeps.report.labeldp import plot_labeldp, rows_from_benchmark

    runs = {}
    for i, (task, m, e) in enumerate([("classification", "none", None), ("regression", "none", None)] +
                                     [("classification", m, e) for m in ("laplace", "rr", "lp1st", "lp2st")
                                      for e in (0.5, 1.0, 4.0)] + [("regression", "laplace", e) for e in (0.1, 1.0)]):
        runs[str(i)] = {"task": task, "method": m, "epsilon": e, "seed": 0, "acc": 0.5 + 0.1 * (e or 4),
                        "mse": 1.0 if task == "regression" else None, "label_keep_rate": 0.5}
    rows = rows_from_benchmark({"runs": runs})
    assert {r["mechanism"] for r in rows} == {"none", "laplace", "rr", "lp1st", "lp2st"}
    assert plot_labeldp(rows, tmp_path / "f.png") and (tmp_path / "f.png").stat().st_size > 10_000


def test_alibi_posterior_is_bayes_rule_on_the_laplace_release():
    from dpmech.label_dp.alibi import alibi_release, alibi_soft_labels

    y = torch.tensor([0, 3, 9, 5])
    noisy, b = alibi_release(y, K, 2.0, torch.Generator().manual_seed(0))
    assert b == 1.0 and noisy.shape == (4, K)
    post = alibi_soft_labels(noisy, b)
    # brute force: the full Laplace likelihood of the vector under each label, uniform prior
    lik = torch.stack([torch.exp(-(noisy - torch.nn.functional.one_hot(torch.tensor(c), K)).abs().sum(1) / b)
                       for c in range(K)], 1)
    assert torch.allclose(post, lik / lik.sum(1, keepdim=True), atol=1e-12)
    prior = torch.softmax(torch.randn(4, K, generator=torch.Generator().manual_seed(1), dtype=torch.float64), 1)
    want = lik * prior
    assert torch.allclose(alibi_soft_labels(noisy, b, prior), want / want.sum(1, keepdim=True), atol=1e-12)
    # negative control: the likelihood at the wrong scale is not the posterior
    assert not torch.allclose(alibi_soft_labels(noisy, b / 2), post, atol=1e-3)
    # large epsilon: the soft label concentrates on the true one
    noisy, b = alibi_release(y, K, 200.0, torch.Generator().manual_seed(0))
    assert torch.equal(alibi_soft_labels(noisy, b).argmax(1), y)


def test_alibi_training_runs_on_soft_labels():
    from dpmech.label_dp import recipe as rc

    x, y = _data(200, seed=2)
    for prior in ("uniform", "model"):
        r = rc.train_label_dp("alibi", x, y, 4.0, seed=0, cfg=rc.RecipeConfig(epochs=2, batch_size=50, width=4, hidden=8),
                              alibi_prior=prior)
        assert 0 < r.info["soft_label_true_mass"] <= 1 and r.info["alibi_prior"] == prior
    with pytest.raises(ValueError, match="alibi_prior"):
        rc.train_label_dp("alibi", x, y, 4.0, seed=0, cfg=rc.RecipeConfig(epochs=1), alibi_prior="x")


def test_trainer_stage2_prior_reads_no_part2_label():
    """The trainable's LP-2ST: with every part-2 label changed, stage 1 (its release and its
    model, hence the stage-2 prior) is identical; only the part-2 release differs."""
    from dpmech.label_dp.trainer import LabelDPConfig, LabelDPTrainer

    x, y = _data(150, seed=4)
    cfg = LabelDPConfig(mechanism="lp2st", epsilon=1.0, epochs=3, stage1_epochs=2, batch_size=50, lr=0.05,
                        recipe="mixup_sgd", seed=1)
    a = LabelDPTrainer(cfg, x, y, noise_key=NoiseKey.reproducible(cfg.seed))
    mask = torch.ones(150, dtype=torch.bool)
    mask[a.part1] = False
    y_alt = y.clone()
    y_alt[mask] = (y[mask] + 1) % K
    b = LabelDPTrainer(cfg, x, y_alt, noise_key=NoiseKey.reproducible(cfg.seed))
    for t in (a, b):
        t.train_epoch()
        t.train_epoch()
    assert torch.equal(a.labels, b.labels)
    for pa, pb in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        assert torch.equal(pa, pb)
    a.train_epoch()
    b.train_epoch()
    assert torch.equal(a.labels[a.part1], b.labels[b.part1]) and not torch.equal(a.labels, b.labels)
