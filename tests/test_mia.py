"""Membership inference (dpmech.privacy.mia, docs/mia.md): the game, offline RMIA and LiRA, the metrics.

Controls: an overfit non-private model on 300 MNIST candidates is found by both attacks; random
scores give AUC 1/2 within the interval; DP-SGD at epsilon 1 is never refuted over repeated runs while
the same recipe without clipping and noise is (the bound's negative control); the epsilon bounds hold
their level on a mechanism that is exactly epsilon-DP and refute one that leaks more; the membership
draw is out of the attack's reach (every refusal an attack could hit, and a walk of every object a view
reaches).
"""

from __future__ import annotations

import gc
import math
import pickle
import types

import numpy as np
import pytest
import torch
from scipy.stats import beta as beta_dist

from dpmech.privacy.audit.one_run import epsilon_lower_bound
from dpmech.privacy.mia.attacks import lira_offline, random_guess, rmia_offline, run_attack
from dpmech.privacy.mia.game import AttackView, MembershipGame, MembershipHidden
from dpmech.privacy.mia.metrics import auc_with_interval, epsilon_lower_bounds, evaluate_scores, tpr_at_fpr
from dpmech.privacy.mia.references import ReferenceModels, reference_key
from dpmech.privacy.mia.attacks import scaled_logit
from dpmech.privacy.secret import NoiseKey

DELTA = 1e-5


def _membership_generator(seed: int) -> torch.Generator:
    # the owner's secret in a sweep; the research mode's public seed here, for determinism
    return NoiseKey.reproducible(seed).generator("mia.membership", seed)


def _mlp(d_in: int, width: int, seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(d_in, width), torch.nn.ReLU(),
                                   torch.nn.Linear(width, 10))


def _overfit(d_in: int, width: int = 128, steps: int = 300, lr: float = 2e-3):
    """Full-batch Adam to (near) zero training loss: the non-private, overfit recipe."""
    def train(x, y, seed):
        model = _mlp(d_in, width, seed)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return model
    return train


@pytest.fixture(scope="module")
def mnist():
    from dpmech.datasets.splits import load_dataset

    x, y = load_dataset("mnist", split="test", size=2300, seed=0).tensors   # the 10k split loads fastest
    return x, y


def _gaussian_mixture(n: int, d: int = 32, spread: float = 0.35, seed: int = 0):
    """10 overlapping Gaussian classes (about half of fresh examples classified right): a model fits its
    training set only by memorising it, so membership leaks."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(10, d, generator=g) * spread
    y = torch.randint(0, 10, (n,), generator=g)
    return means[y] + torch.randn(n, d, generator=g), y


# ---------------------------------------------------------------------------------------------- controls


def test_overfit_mnist_model_is_found(mnist, one_thread):
    """Positive control: 300 MNIST candidates (144 members), an MLP trained to ~1e-3 loss, 2 reference
    models on 2,000 disjoint MNIST images. Measured: RMIA AUC 0.809 [0.761, 0.856], TPR 0.25 [0.18, 0.33]
    at 1% FPR, eps_lb 1.63; LiRA AUC 0.774 [0.723, 0.826], TPR 0.19 [0.13, 0.26], eps_lb 0.97."""
    x, y = mnist
    game = MembershipGame(x[:300], y[:300], generator=_membership_generator(1))
    train = _overfit(784)
    target = train(*game.members(), 101)
    refs = ReferenceModels(train, x[300:], y[300:], count=2, train_size=game.expected_members, num_z=1000,
                           architecture="mlp-784-128-10", recipe={"adam_lr": 2e-3, "steps": 300}, seed=1)
    rmia = run_attack(game, target, refs, attack="rmia", delta=DELTA)
    lira = run_attack(game, target, refs, attack="lira", delta=DELTA)
    for res, auc_min in ((rmia, 0.75), (lira, 0.7)):
        m = res.metrics()
        print(res.attack, {k: round(val, 4) for k, val in m.items()})
        assert m["mia_auc_lo"] > 0.65 and m["mia_auc"] >= auc_min
        assert m["mia_tpr_at_fpr_0.01_lo"] > 0.05          # far above 1%: the 95% interval lies above 5x the FPR
        assert m["mia_eps_lb"] > 0                          # the leak is certified, not only estimated
        assert m["mia_candidates"] == 300 and m["mia_members"] == res.members and m["mia_references"] == 2


def test_random_scores_give_auc_one_half(one_thread):
    """Negative control: scores that ignore the target. One game's interval covers 1/2, and over 400
    games the 95% DeLong interval covers 1/2 in at least 92% of them; TPR at 1% FPR stays near 1%."""
    x, y = _gaussian_mixture(400)
    game = MembershipGame(x, y, generator=_membership_generator(2))
    view = game.attack_view(_mlp(32, 8, 0))
    res = game.evaluate(random_guess(view, generator=torch.Generator().manual_seed(5)), delta=DELTA)
    assert res.auc_lo <= 0.5 <= res.auc_hi
    assert res.eps_lb == 0.0

    rng = np.random.default_rng(0)
    covered, tpr = 0, []
    for _ in range(400):
        members = rng.random(400) < 0.5
        scores = rng.random(400)
        auc, lo, hi = auc_with_interval(scores, members)
        covered += lo <= 0.5 <= hi
        tpr.append(tpr_at_fpr(scores, members, 0.01).tpr)
    assert covered >= 0.92 * 400, covered
    assert np.mean(tpr) < 0.03


def test_dp_sgd_at_epsilon_1_is_never_refuted(one_thread):
    """DP-SGD at epsilon 1 (MLP, 1,000 candidates of the Gaussian mixture, batch 50, Adam): over 4
    runs each attack's bound stays at or below the ledger's epsilon, each run at confidence
    1 - 0.05 / 4 (Bonferroni: the four together at 95%). Negative control: the same recipe with no
    clipping and no noise (claim: infinite) has a bound above 1 -- a claim of epsilon 1 for it would be
    refuted. Measured: every DP run's bound 0.00 (both attacks, AUC 0.52-0.55); the control's RMIA bound
    1.69 (AUC 0.88), LiRA's 1.15."""
    from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer

    runs = 4
    confidence = 1 - 0.05 / runs
    x, y = _gaussian_mixture(3000)

    def recipe(epsilon, plan_size=None):
        def train(xx, yy, seed):
            cfg = DPSGDConfig(epsilon=epsilon, delta=DELTA, batch_size=50, epochs=30, lr=3e-3, optimizer="adam",
                              max_grad_norm=1.0, seed=seed)
            trainer = DPSGDTrainer(_mlp(32, 256, seed), xx, yy, cfg, plan_size=plan_size or xx.shape[0],
                                   noise_key=NoiseKey.reproducible(seed)).fit()
            train.claims.append(trainer.privacy()["epsilon"])
            return trainer.model
        train.claims = []
        return train

    worst = 0.0
    for run in range(runs + 1):
        private = run < runs
        game = MembershipGame(x[:1000], y[:1000], generator=_membership_generator(10 + run))
        target_train = recipe(1.0 if private else None, plan_size=game.expected_members)
        target = target_train(*game.members(), 200 + run)
        claim = target_train.claims[-1]
        refs = ReferenceModels(recipe(1.0 if private else None), x[1000:], y[1000:], count=1,
                               train_size=game.expected_members, num_z=1000, architecture="mlp-32-256-10",
                               recipe={"epsilon": 1.0 if private else None, "epochs": 30}, seed=run)
        for attack in ("rmia", "lira"):
            res = run_attack(game, target, refs, attack=attack, delta=DELTA, confidence=confidence)
            print(run, attack, f"claim {claim:.3f}", f"auc {res.auc:.3f} eps_lb {res.eps_lb:.3f} "
                  f"rates {res.eps_lb_rates:.3f}")
            if private:
                assert claim <= 1.0 + 1e-9
                assert res.eps_lb <= claim and res.eps_lb_rates <= claim
                worst = max(worst, res.eps_lb)
            elif attack == "rmia":
                assert math.isinf(claim)
                assert res.eps_lb > 1.0                      # would refute "epsilon 1"
    assert worst < 0.5


def test_epsilon_bounds_hold_their_level_on_randomized_response():
    """The bounds on a mechanism that is exactly epsilon-DP (each candidate's score: its membership bit
    by randomized response at epsilon 1, so TPR = e FPR): over 100 games of 1,000 candidates at 95%,
    each bound exceeds 1 in at most 10 (at most 5 expected); at epsilon 3 the same bounds refute 1 in at
    least 18 of 20."""
    rng = np.random.default_rng(1)

    def game(eps):
        members = rng.random(1000) < 0.5
        keep = rng.random(1000) < math.exp(eps) / (1 + math.exp(eps))
        return np.where(keep, members, ~members).astype(float) + 1e-3 * rng.random(1000), members

    grid = (0.05, 0.2, 0.5)
    over = {"eps_lb": 0, "eps_lb_rates": 0}
    for _ in range(100):
        b = epsilon_lower_bounds(*game(1.0), delta=0.0, guess_fractions=grid)
        for key in over:
            over[key] += b[key] > 1.0
    assert over["eps_lb"] <= 10 and over["eps_lb_rates"] <= 10, over
    refuted = sum(epsilon_lower_bounds(*game(3.0), delta=0.0, guess_fractions=grid)["eps_lb"] > 1.0 for _ in range(20))
    assert refuted >= 18


# ------------------------------------------------------------------------------ the membership is hidden


def _reachable(root, limit: int = 200_000):
    """Every object reachable from ``root`` by references an attack could follow from it (attributes,
    slots, containers, closures, bound methods), not through modules, classes or function globals."""
    seen, stack, out = set(), [root], []
    while stack and len(out) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        out.append(obj)
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in (obj.__closure__ or ()))
            stack.extend(obj.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(obj))
    return out


def test_the_membership_draw_is_out_of_the_attacks_reach(one_thread):
    x, y = _gaussian_mixture(200)
    game = MembershipGame(x, y, generator=_membership_generator(3))
    view = game.attack_view(_mlp(32, 8, 0))
    refs = ReferenceModels(_overfit(32, 8, 5), *_gaussian_mixture(300, seed=1), count=1, train_size=100, num_z=100,
                           architecture="mlp", recipe="r", seed=0)

    # reading it from the view is refused, under any name
    for name in ("membership", "included", "_included", "members", "game", "_game", "secret"):
        with pytest.raises(MembershipHidden, match="never given to the attack"):
            getattr(view, name)
    with pytest.raises(AttributeError):
        view.membership = None                      # nothing can be stored on a view either
    # handing the game itself to an attack is refused
    for attack in (rmia_offline, lira_offline):
        with pytest.raises(TypeError, match="never the MembershipGame"):
            attack(game, refs)
    with pytest.raises(TypeError):
        random_guess(game, generator=torch.Generator())
    # neither can be pickled (so neither travels to a log or another process by accident)
    for obj in (game, view):
        with pytest.raises(TypeError, match="not picklable"):
            pickle.dumps(obj)
    assert "members" not in repr(game) and repr(view) == "AttackView(200 candidates)"
    # nothing the view reaches is the game or its membership vector
    secret = game._included
    reached = _reachable(view)
    assert len(reached) > 10                        # the walk did see the model's tensors
    assert not any(o is game or o is secret for o in reached)
    assert not any(isinstance(o, np.ndarray) and o.dtype == np.bool_ for o in reached)
    assert any(o is secret for o in _reachable([view, game]))     # the walk's own control: it finds it from the game
    # editing what the view hands out changes nothing the game holds
    view.x.zero_()
    assert torch.equal(game.candidates()[0], x)

    # the draw: a fair coin per candidate from the generator given, the same for the same generator
    again = MembershipGame(x, y, generator=_membership_generator(3))
    assert np.array_equal(again._included, secret) and 60 < secret.sum() < 140
    assert not np.array_equal(MembershipGame(x, y, generator=_membership_generator(4))._included, secret)
    assert torch.equal(game.members()[0], x[torch.from_numpy(np.flatnonzero(secret))])
    with pytest.raises(ValueError, match="explicit torch.Generator"):
        MembershipGame(x, y, generator=3)


def test_reference_models_never_see_the_game_and_are_shared_by_key(one_thread):
    x, y = _gaussian_mixture(600)
    pop_x, pop_y = x[200:], y[200:]
    calls = []

    def train(xx, yy, seed):
        calls.append((xx.clone(), seed))
        return _overfit(32, 8, 20)(xx, yy, seed)

    cache = {}
    kwargs = dict(count=2, train_size=100, num_z=150, architecture={"mlp": [32, 8, 10]}, recipe={"steps": 20},
                  seed=7, cache=cache)
    refs = ReferenceModels(train, pop_x, pop_y, **kwargs)
    assert len(calls) == 0                                   # trained on first use
    logits = refs.logits(x[:200])
    assert logits.shape == (2, 200, 10) and len(calls) == 2 and set(cache) == set(refs.keys)
    # they trained on population rows only, never on a candidate, and z is in neither training set
    cand = {tuple(r.tolist()) for r in x[:200]}
    zs = {tuple(r.tolist()) for r in refs.z_x}
    for xx, _ in calls:
        rows = {tuple(r.tolist()) for r in xx}
        assert not rows & cand and not rows & zs and len(rows) == 100
    # two trials (two membership draws) with the same population, architecture and recipe share them
    for seed in (0, 1):
        game = MembershipGame(x[:200], y[:200], generator=_membership_generator(seed))
        again = ReferenceModels(train, pop_x, pop_y, **kwargs)
        assert again.keys == refs.keys
        assert torch.equal(again.logits(x[:200]), logits)
        rmia_offline(game.attack_view(_overfit(32, 8, 20)(*game.members(), 0)), again)
    assert len(calls) == 2
    # the key names data, architecture, recipe and seed
    xx, yy = refs.training_set(0)
    base = dict(architecture={"mlp": [32, 8, 10]}, recipe={"steps": 20}, seed=refs.seeds[0])
    assert reference_key(xx, yy, **base) == refs.keys[0]
    for change in (dict(architecture="other"), dict(recipe={"steps": 21}), dict(seed=refs.seeds[0] + 1)):
        assert reference_key(xx, yy, **{**base, **change}) != refs.keys[0]
    assert reference_key(xx + 0, yy.flip(0), **base) != refs.keys[0]
    # candidates that are population rows are refused
    game = MembershipGame(pop_x[:50], pop_y[:50], generator=_membership_generator(0))
    with pytest.raises(ValueError, match="also appear in the population"):
        lira_offline(game.attack_view(_mlp(32, 8, 0)), refs)
    with pytest.raises(ValueError, match="num_z"):
        ReferenceModels(train, pop_x, pop_y, count=1, train_size=300, num_z=150, architecture="a", recipe="r")


# --------------------------------------------------------------------------------- the formulas, pinned


class _Fixed(torch.nn.Module):
    """A 'model' that returns stored logits for stored inputs (row i of x -> row i of logits)."""

    def __init__(self, x, logits):
        super().__init__()
        self.table = {tuple(r.tolist()): l for r, l in zip(x, logits)}

    def forward(self, x):
        return torch.stack([self.table[tuple(r.tolist())] for r in x])


def test_rmia_and_lira_compute_the_papers_formulas():
    """Both attacks against a brute-force reading of the formulas (docs/mia.md) on fixed logits."""
    g = torch.Generator().manual_seed(0)
    n, nz, c, k = 12, 15, 4, 3
    cand_x = torch.randn(n, 2, generator=g)
    pop_x = torch.randn(nz + 20, 2, generator=g)
    cand_y = torch.randint(0, c, (n,), generator=g)
    pop_y = torch.randint(0, c, (nz + 20,), generator=g)
    all_x = torch.cat([cand_x, pop_x])
    target = _Fixed(all_x, 3 * torch.randn(all_x.shape[0], c, generator=g))
    ref_models = [_Fixed(all_x, 3 * torch.randn(all_x.shape[0], c, generator=g)) for _ in range(k)]
    it = iter(ref_models)
    refs = ReferenceModels(lambda xx, yy, s: next(it), pop_x, pop_y, count=k, train_size=20, num_z=nz,
                           architecture="fixed", recipe="fixed")
    game = MembershipGame(cand_x, cand_y, generator=_membership_generator(0))
    view = game.attack_view(target)

    def prob(model, xi, yi, t):
        return torch.softmax(model(xi[None]).double()[0] / t, 0)[yi].item()

    a, gamma, t = 0.4, 1.5, 2.0

    def marginal(xi, yi):
        p_out = np.mean([prob(m, xi, yi, t) for m in ref_models])
        return 0.5 * ((1 + a) * p_out + (1 - a))

    expected = []
    for xi, yi in zip(cand_x, cand_y):
        rx = prob(target, xi, yi, t) / marginal(xi, yi)
        lr = [rx / (prob(target, zi, zy, t) / marginal(zi, zy)) for zi, zy in zip(refs.z_x, refs.z_y)]
        expected.append(np.mean(np.array(lr) >= gamma))
    np.testing.assert_allclose(rmia_offline(view, refs, a=a, gamma=gamma, temperature=t), expected, atol=1e-12)

    def phi(model, xi, yi):
        p = torch.softmax(model(xi[None]).double()[0], 0)[yi].item()
        return math.log(p / (1 - p))

    ph_ref = np.array([[phi(m, xi, yi) for xi, yi in zip(cand_x, cand_y)] for m in ref_models])
    mu = ph_ref.mean(0)
    sigma = math.sqrt(((ph_ref - mu) ** 2).sum() / (k * n - n))
    ph_t = np.array([phi(target, xi, yi) for xi, yi in zip(cand_x, cand_y)])
    np.testing.assert_allclose(lira_offline(view, refs), (ph_t - mu) / sigma, rtol=1e-9)
    # the logit scaling stays finite where p rounds to 1
    assert np.isfinite(scaled_logit(torch.tensor([[80.0, 0.0, -5.0]]), torch.tensor([0]))).all()


def test_metrics_against_direct_computation():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 6, 60).astype(float)          # many ties
    members = rng.random(60) < 0.5
    x, y = scores[members], scores[~members]
    # AUC: the pairwise definition, ties 1/2; DeLong's variance from its structural components
    psi = (x[:, None] > y[None, :]) + 0.5 * (x[:, None] == y[None, :])
    auc, lo, hi = auc_with_interval(scores, members)
    assert auc == pytest.approx(psi.mean())
    se = math.sqrt(psi.mean(1).var(ddof=1) / len(x) + psi.mean(0).var(ddof=1) / len(y))
    assert (lo, hi) == pytest.approx((auc - 1.959964 * se, auc + 1.959964 * se), abs=1e-6)
    # TPR at FPR: the best threshold with at most floor(fpr n0) false positives; Clopper-Pearson on TP
    r = tpr_at_fpr(scores, members, 0.1)
    best = max(((x >= t).sum(), t) for t in np.r_[np.unique(scores), np.inf] if (y >= t).sum() <= int(0.1 * len(y)))
    assert (r.tp, r.members, r.non_members) == (best[0], len(x), len(y))
    assert r.tpr_lo == pytest.approx(beta_dist.ppf(0.025, r.tp, len(x) - r.tp + 1) if r.tp else 0.0)
    assert r.fpr_hi == pytest.approx(beta_dist.ppf(0.95, r.fp + 1, len(y) - r.fp))
    # the epsilon bounds: the grid's best k, Bonferroni over its G thresholds
    scores = rng.random(2000) + 0.8 * (members := rng.random(2000) < 0.5)
    b = epsilon_lower_bounds(scores, members, delta=DELTA, guess_fractions=(0.01, 0.05, 0.2))
    assert b["thresholds"] == 3 and b["eps_lb"] > 0
    assert b["eps_lb"] == pytest.approx(epsilon_lower_bound(b["eps_lb_k"], b["eps_lb_tp"], beta=0.05 / 3, delta=DELTA,
                                                            m=2000))
    ks = {20: None, 100: None, 400: None}
    top = np.argsort(-scores, kind="stable")
    rates = []
    for k in ks:
        tp = int(members[top[:k]].sum())
        tpr_lo = beta_dist.ppf(0.05 / 6, tp, members.sum() - tp + 1)
        fpr_hi = beta_dist.ppf(1 - 0.05 / 6, k - tp + 1, (~members).sum() - (k - tp))
        rates.append(math.log((tpr_lo - DELTA) / fpr_hi) if tpr_lo > DELTA else 0.0)
    assert b["eps_lb_rates"] == pytest.approx(max(0.0, *rates))
    # the result's metric names
    m = evaluate_scores(scores, members, delta=DELTA, attack="x").metrics()
    for key in ("mia_auc", "mia_tpr_at_fpr_0.001", "mia_tpr_at_fpr_0.01", "mia_eps_lb"):
        assert key in m and math.isfinite(m[key])
    # refusals: one score per candidate, finite, both classes present
    with pytest.raises(ValueError, match="one score per candidate"):
        evaluate_scores(scores[:-1], members, delta=DELTA)
    with pytest.raises(ValueError, match="finite"):
        evaluate_scores(np.r_[np.nan, scores[1:]], members, delta=DELTA)
    with pytest.raises(ValueError, match="at least 2 members"):
        evaluate_scores(scores[:3], np.array([True, False, False]), delta=DELTA)
    assert isinstance(AttackView, type)


def test_rows_in_finds_byte_equal_rows_and_never_takes_a_key_collision_for_one(monkeypatch):
    """The population is kept disjoint from the candidates by ``rows_in`` (vectorised keys, each hit
    confirmed byte for byte): planted copies are found, rows that differ in one bit are not, and when
    every key collides (a planted worst case) only the true copies remain."""
    import numpy as np
    import torch

    from dpmech.privacy.mia import references

    g = torch.Generator().manual_seed(0)
    pool = torch.rand(500, 1, 6, 6, generator=g)
    cand = torch.rand(40, 1, 6, 6, generator=g)
    pool[[3, 250, 499]] = cand[[0, 7, 39]]
    near = cand[5].clone()
    near.view(-1)[0] = torch.nextafter(near.view(-1)[0], torch.tensor(2.0))   # one ulp away: not a copy
    pool[100] = near
    assert np.flatnonzero(references.rows_in(pool, cand)).tolist() == [3, 250, 499]
    monkeypatch.setattr(references, "_row_keys", lambda words, chunk=2048: np.zeros(words.shape[0], np.uint64))
    assert np.flatnonzero(references.rows_in(pool, cand)).tolist() == [3, 250, 499]
