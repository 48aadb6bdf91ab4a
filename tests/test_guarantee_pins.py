"""Issue 50: guarantees that one-line mutants showed unpinned, each pinned by the property it rests on.

1. A trial's noise key comes from the sweep's secret AND the trial's identity (trainables.runtime
   ``trial_noise_key``, ``NoiseKey.derive``): two sweeps' keys give different child keys and stream
   seeds for the same (public) trial identity; the same key gives the same ones. The attack it
   prevents: a reader of the release, who knows the trial's config, recomputing its key.
2. A stream's seed is the full 63 bits of its HMAC (not a truncation an attacker could enumerate).
4. DP-CERT's k augmentations are ONE clipped contribution at k = 2 and k = 1 too (the suite's other
   clipping tests use k = 3), on every clipping route.
5. LabelDP-Pro adds the noise ``sigma`` it was calibrated with (measured from the released weights,
   against a 20% shortfall as the negative control).
6. LabelDP-Pro's label sensitivity is sqrt(2) clip, the figure sigma assumes: changing one label moves
   the (noise-free part of the) update by exactly sqrt(2) clip / |B| per unit of lr.
7. A checkpoint whose tensor bytes changed (a file torch.load still reads) is refused by its SHA-256.
8. A single non-finite weight makes a trial DIVERGED.

Plus the release's refusals (sweeps/release.py ``check_releasable``) on a stand-in tracking client, so
they are checked in the default suite (tests/test_release.py, end to end, is marked slow).
"""

from __future__ import annotations

import io
import math
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml

from dpmech.privacy.secret import NoiseKey

pytestmark = pytest.mark.usefixtures("one_thread")

SWEEP_A = NoiseKey(bytes(range(32)))              # two sweeps' secrets (fixed: the tests are deterministic)
SWEEP_B = NoiseKey(bytes(range(1, 33)))
STREAMS = ("dpsgd.noise", "dpsgd.sampling", "label_dp.labeldp_pro", "tuning.candidates")


# --------------------------------------------------------------------------- 1. the trial's key needs the secret

def _trial(repeat: int = 0):
    from trainables.dpsgd import DPSGDTrialConfig
    from trainables.runtime import validate_config

    config = {"epsilon": 1.0, "batch_size": 8, "train_size": 40, "seed": 3, "repeat": repeat}
    return validate_config(config, DPSGDTrialConfig), config


def _trial_key(sweep_key, repeat: int = 0):
    from trainables.runtime import trial_noise_key

    cfg, config = _trial(repeat)
    return trial_noise_key(cfg, "dpsgd", config, sweep_key)


def _sweeps_are_told_apart(derive) -> bool:
    """The property, for a derivation ``derive(sweep_key) -> child key`` of one fixed trial identity:
    the two sweeps' children (and every stream seed) differ, each sweep's child is reproducible."""
    a, a2, b = derive(SWEEP_A), derive(SWEEP_A), derive(SWEEP_B)
    same = a == a2 and all(a.stream_seed(s, 0) == a2.stream_seed(s, 0) for s in STREAMS)
    apart = a != b and all(a.stream_seed(s, 0) != b.stream_seed(s, 0) for s in STREAMS)
    return same and apart


def test_a_trials_key_depends_on_the_sweeps_secret_not_only_on_its_identity():
    assert _sweeps_are_told_apart(lambda k: _trial_key(k))                     # the trainable path
    assert _sweeps_are_told_apart(lambda k: k.derive("trial identity"))        # the library call
    assert not _trial_key(SWEEP_A).reproducible_mode
    assert _trial_key(SWEEP_A) != _trial_key(SWEEP_A, repeat=1)                # another trial, another key
    assert _trial_key(SWEEP_A) != SWEEP_A                                       # a child, not the sweep's key
    # negative control, the attack: a reader of the release knows the trial's identity (its config is
    # public) and so can compute any key derived from that identity alone; such a derivation gives
    # every sweep the same child and fails the property
    import hashlib

    public_only = lambda k: NoiseKey(hashlib.sha256(b"derive:trial identity").digest())   # noqa: E731
    assert not _sweeps_are_told_apart(public_only)


# --------------------------------------------------------------------------- 2. the seed's width

def _seed_width_ok(seed_of, n: int = 4096) -> tuple[bool, str]:
    seeds = [seed_of(f"stream {i}") for i in range(n)]
    widths = [s.bit_length() for s in seeds]
    ok = (all(0 <= s < 2 ** 63 for s in seeds) and max(widths) == 63 and len(set(seeds)) == n
          and sum(w >= 60 for w in widths) > 0.8 * n)   # 15/16 of uniform 63-bit seeds have >= 60 bits
    return ok, f"max bits {max(widths)}, {n - len(set(seeds))} collisions"


def test_stream_seeds_use_the_full_63_bits():
    ok, why = _seed_width_ok(lambda name: SWEEP_A.stream_seed(name, 0))
    assert ok, why
    # the generator a trainer gets is seeded with that full seed
    assert SWEEP_A.generator("dpsgd.noise", 0).initial_seed() == SWEEP_A.stream_seed("dpsgd.noise", 0)
    # negative control: seeds truncated to 15 bits (32,768 values an attacker enumerates) fail
    ok, why = _seed_width_ok(lambda name: SWEEP_A.stream_seed(name, 0) >> 48)
    assert not ok and "collisions" in why


def test_per_step_seeds_use_the_full_63_bits():
    """The same width for the per-step seeds (issue 48's ``NoiseKey.step_seed``), over steps and names."""
    ok, why = _seed_width_ok(lambda name: SWEEP_A.step_seed("dpsgd.noise", int(name.split()[1])))
    assert ok, why
    ok, why = _seed_width_ok(lambda name: SWEEP_A.step_seed(name, 7))
    assert ok, why
    assert SWEEP_A.step_seed("dpsgd.noise", 7) != SWEEP_B.step_seed("dpsgd.noise", 7)


# --------------------------------------------------------------------------- 4. DP-CERT at k = 2 and k = 1

def _cert_data(k: int):
    from tests.test_dp_certified_training import B, SIGMA

    g = torch.Generator().manual_seed(11)
    x = torch.rand(B, 1, 8, 8, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 4, (B,), generator=g)
    z = torch.randn(k, B, 1, 8, 8, generator=g, dtype=torch.float64) * SIGMA
    return x, y, z


@pytest.mark.parametrize("k", [2, 1])
@pytest.mark.parametrize("route", ["ghost", "inst", "bmm_f", "grouped", "flat"])
def test_k_augmentations_are_one_clipped_contribution_at_k_2_and_1(route, k):
    """The clipped sum equals the per-example clip-and-sum reference (each example's gradient from its
    own k rows, clipped once to C), and removing any example moves it by exactly C (every example is
    clipped), never 2 C (two rows of one example each clipped as an example)."""
    from tests.test_dp_certified_training import B, C, LAMBDA, clipped_sum, reference

    x, y, z = _cert_data(k)
    weight = LAMBDA if k > 1 else 0.0                 # the regulariser needs k >= 2
    kw = dict(augment_multiplicity=k, consistency_weight=weight)
    everyone = list(range(B))
    ref, norms = reference(x, y, z, everyone, weight=weight)
    assert (norms > 2 * C).all(), norms               # every example clipped: the bound is attained
    s = clipped_sum(route, x, y, z, everyone, **kw)
    assert torch.allclose(s, ref, rtol=1e-8, atol=1e-12), (s - ref).norm()
    moves = [float((s - clipped_sum(route, x, y, z, [j for j in everyone if j != i], **kw)).norm()) / C
             for i in everyone]
    assert max(moves) <= 1 + 1e-9 and min(moves) > 1 - 1e-6, moves


# --------------------------------------------------------------------------- 5, 6. LabelDP-Pro

PRO_N, PRO_D, PRO_K, PRO_CLIP = 200, 99, 10, 0.7


def _pro_data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(PRO_N, PRO_D, generator=g)
    x[:20] *= 1e-3                                    # rows far below and far above the clip
    x[20:40] *= 1e3
    y = torch.randint(0, PRO_K, (PRO_N,), generator=g)
    return x, y


def _pro_run(x, y, key: NoiseKey, epsilon: float = 1.0):
    """One LabelDP-Pro pass as ONE batch (lr 1, no momentum yet, projection onto the batch's own span,
    which holds every [K, D] matrix with zero column sums since n >= D): the released weights are
    w = -(P^T xhat - S - N) / n centred over the classes, N the noise on S."""
    from dpmech.label_dp.cluster_prior import PrivateLabels
    from dpmech.label_dp.labeldp_pro import LabelDPProConfig, LabelDPProRun

    cfg = LabelDPProConfig(epochs=1, batch_size=PRO_N, lr=1.0, momentum=0.0, clip=PRO_CLIP, proj_images=0)
    return LabelDPProRun(x, PrivateLabels(y, PRO_K), epsilon, cfg, seed=0, noise_key=key)


def _measured_noise_ratio(shrink: float = 1.0, runs: int = 20) -> float:
    """The std of the noise in the released weights over ``runs`` secret keys (everything else, the
    data, the order and the labels' part of the update, is the same in every run), in units of the
    sigma the run was calibrated with. ``shrink`` < 1: the negative control, a run that draws only
    that fraction of its sigma."""
    x, y = _pro_data()
    ws, sigma = [], None
    for r in range(runs):
        run = _pro_run(x, y, NoiseKey(bytes([r + 1]) * 32))
        sigma = run.info["sigma"]
        assert run.sigma == sigma
        run.sigma = sigma * shrink
        run.train_epoch()
        ws.append(run.state_dict()["w"].double())
    var = torch.stack(ws).var(0, unbiased=True).mean()          # (sigma / n)^2 (1 - 1/K) per entry
    return float((var / (1 - 1 / PRO_K)).sqrt() * PRO_N) / sigma


def test_labeldp_pro_adds_the_noise_it_is_calibrated_with():
    """19 x 900 degrees of freedom: the std's standard error is about 0.6%; 3% is allowed."""
    ratio = _measured_noise_ratio()
    assert abs(ratio - 1) < 0.03, ratio
    control = _measured_noise_ratio(shrink=0.8)       # negative control: 20% less noise than calibrated
    assert abs(control - 1) > 0.1, control


def test_labeldp_pro_label_sensitivity_is_sqrt2_clip_as_sigma_assumes():
    """Changing one label changes S by (e_b - e_a) xhat_i^T, inside the projection's span, so the
    released weights move by exactly sqrt(2) ||xhat_i|| / n: at most sqrt(2) clip (the sensitivity
    sigma is calibrated for) and reaching it, for rows far below and far above the clip alike."""
    x, y = _pro_data()
    key = NoiseKey(bytes([99]) * 32)                  # the same noise in both worlds
    base = _pro_run(x, y, key)
    sens = base.info["sensitivity_total"]             # one epoch: sqrt(2) clip
    assert sens == pytest.approx(math.sqrt(2) * PRO_CLIP, rel=1e-12)
    base.train_epoch()
    w0 = base.state_dict()["w"].double()
    moves = []
    for i in [0, 1, 20, 21, 100, 199]:                # tiny, huge and ordinary rows
        y2 = y.clone()
        y2[i] = (y[i] + 1) % PRO_K
        run = _pro_run(x, y2, key)
        run.train_epoch()
        moves.append(float((run.state_dict()["w"].double() - w0).norm()) * PRO_N / run.cfg.lr)
    assert max(moves) <= sens * (1 + 1e-4), moves
    assert min(moves) >= sens * (1 - 1e-4), moves


# --------------------------------------------------------------------------- 7. the checkpoint's SHA-256

class _Mech:
    def __init__(self, value: float):
        self.net = nn.Linear(4, 2)
        nn.init.constant_(self.net.weight, value)

    def state_dict(self):
        return {"model": self.net.state_dict()}


def test_a_checkpoint_whose_tensor_bytes_changed_is_refused_by_its_digest(tmp_path):
    from ray import tune

    from trainables.runtime import _save_checkpoint, restore_checkpoint

    dirs = []
    for i, value in enumerate([1.0, 3.0], start=1):
        d = tmp_path / "trial" / f"checkpoint_{i:06d}"
        d.mkdir(parents=True)
        _save_checkpoint(d, _Mech(value), {"mlflow_run_id": "r1", "history": [{"epoch": e} for e in range(1, i + 1)]})
        dirs.append(d)
    latest = tune.Checkpoint(path=str(dirs[1]))
    state, _, note = restore_checkpoint(latest, torch.device("cpu"))
    assert note is None and float(state["model"]["weight"][0, 0]) == 3.0       # control: intact, used
    path = dirs[1] / "state.pt"
    data = bytearray(path.read_bytes())
    at = data.find(torch.full((8,), 3.0).numpy().tobytes())                    # the weight's stored floats
    assert at > 0
    data[at + 5] ^= 0x01                                                       # 3.0 -> 3.0000305
    path.write_bytes(bytes(data))
    # the file is still a readable checkpoint, only its values differ: no loader error can catch it
    silent = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    assert float(silent["model"]["weight"].max()) != 3.0
    state, meta, note = restore_checkpoint(latest, torch.device("cpu"))
    assert "checkpoint_000002" in note and "SHA-256" in note and "resumed from checkpoint_000001" in note
    assert float(state["model"]["weight"][0, 0]) == 1.0 and len(meta["history"]) == 1


# --------------------------------------------------------------------------- 8. DIVERGED

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_single_non_finite_weight_is_diverged(bad):
    from trainables.runtime import diverged_after

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    mech = types.SimpleNamespace(model=net)
    assert diverged_after(mech, 3) is None                                     # control: finite
    with torch.no_grad():
        net[2].weight[1, 2] = bad                                              # one entry of 8
    why = diverged_after(mech, 3)
    assert why is not None and "2.weight" in why and "epoch 3" in why
    with torch.no_grad():
        net[0].bias.fill_(bad)                                                 # and a whole parameter
    assert "and 1 more" in diverged_after(mech, 4)


# --------------------------------------------------------------------------- the release's refusals

class _Client:
    """What check_releasable reads from MLflow: the parent's spec artifact and the released run."""

    def __init__(self, spec: dict, child):
        self.spec, self.child = spec, child

    def download_artifacts(self, run_id, path, dst):
        assert path == "spec.yaml"
        out = Path(dst) / path
        out.write_text(yaml.safe_dump(self.spec))
        return str(out)

    def get_run(self, run_id):
        assert run_id == self.child.info.run_id
        return self.child


def _run(run_id: str, status: str = "FINISHED", tags=None, metrics=None):
    return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id, status=status),
                                 data=types.SimpleNamespace(tags=dict(tags or {}), metrics=dict(metrics or {}),
                                                            params={}))


def _releasable(**change):
    from trainables.diagnostics import TAG_DIAGNOSTICS

    spec = {"name": "s", "tuning_privacy": {"distribution": "poisson", "mean": 2}}
    parent = _run("p", tags={"mlflow.runName": "s", "dpsweep.kind": "sweep", "dpsweep.released_run_id": "c"},
                  metrics={"tuning_epsilon": 2.0, "tuning_delta": 1e-5})
    child = _run("c", tags={"dpsweep.noise": "secret", TAG_DIAGNOSTICS: "none"},
                 metrics={"acc_clean": 0.9, "epsilon": 1.0, "test_acc": 0.9})
    for what, value in change.items():
        if what == "spec":
            spec = value
        elif what == "status":
            parent.info.status = value
        elif what == "parent_tags":
            parent.data.tags = value(parent.data.tags)
        elif what == "child_tags":
            child.data.tags = value(child.data.tags)
        elif what == "child_metrics":
            child.data.metrics = {**child.data.metrics, **value}
    return _Client(spec, child), parent


def test_a_releasable_sweep_passes_the_checks():
    from sweeps.release import check_releasable

    client, parent = _releasable()
    spec, child = check_releasable(client, parent)
    assert spec["tuning_privacy"]["mean"] == 2 and child.info.run_id == "c"


def _without(key):
    return lambda tags: {k: v for k, v in tags.items() if k != key}


@pytest.mark.parametrize("change, message", [
    (dict(spec={"name": "s"}), "no tuning_privacy"),
    (dict(spec={"name": "s", "tuning_privacy": None}), "no tuning_privacy"),
    (dict(status="RUNNING"), "RUNNING, not FINISHED"),
    (dict(status="FAILED"), "FAILED, not FINISHED"),
    (dict(parent_tags=_without("dpsweep.released_run_id")), "no candidate was released"),
    (dict(child_tags=lambda t: {**t, "dpsweep.noise": "seed"}), "public seed"),
    (dict(child_tags=_without("dpsweep.noise")), "public seed"),
    (dict(child_metrics={"train_loss": 0.3}), r"non-private diagnostics \(train_loss\)"),
    (dict(child_metrics={"clipped_fraction": 0.5}), r"non-private diagnostics \(clipped_fraction\)"),
    (dict(child_metrics={"loss_near_chance": 0.0}), r"non-private diagnostics \(loss_near_chance\)"),
], ids=["no-tuning-privacy", "tuning-privacy-null", "running", "failed", "nothing-released", "seed-noise",
        "untagged-noise", "train-loss", "clipped-fraction", "loss-near-chance"])
def test_the_release_refuses_what_no_guarantee_covers(change, message):
    from sweeps.release import ReleaseRefused, check_releasable

    client, parent = _releasable(**change)
    with pytest.raises(ReleaseRefused, match=message):
        check_releasable(client, parent)


def test_the_release_refuses_a_candidate_whose_tag_lists_non_private_diagnostics():
    """The run's own record of what it logged (the tag trials write, TAG_DIAGNOSTICS) is enough to refuse
    it, whatever its metrics hold (the release once read a tag no trial writes)."""
    from sweeps.release import ReleaseRefused, check_releasable
    from trainables.diagnostics import TAG_DIAGNOSTICS

    client, parent = _releasable(child_tags=lambda t: {**t, TAG_DIAGNOSTICS: "train_acc, batch_size_mean"})
    with pytest.raises(ReleaseRefused, match="non-private diagnostics"):
        check_releasable(client, parent)


# --------------------------------------------------------------------------- the significance statement's level

def test_significance_decision_is_exactly_the_t_test_at_alpha():
    """Near the level a frequency test has no power (400 null sweeps cannot tell 0.05 from 0.1), so the
    decision is checked exactly, sweep by sweep, against scipy's paired and Welch t-tests at 0.05, on
    sweeps whose p-values lie between 0.0125 and 0.2 (some in (0.05, 0.1], some in (0.025, 0.05])."""
    import numpy as np
    from scipy import stats

    from sweeps.report.best import ALPHA
    from tests.test_selection import _rows, _select

    assert ALPHA == 0.05                              # the level docs/report.md states
    rng = np.random.default_rng(50)
    seen = {"paired": [], "welch": []}
    for _ in range(400):
        a = list(0.95 + rng.normal(0, 0.01, 5))
        b = list(0.95 + rng.normal(0, 0.01, 5))
        if np.mean(a) < np.mean(b):
            a, b = b, a                               # the best is a
        for kind, seeds in (("paired", None), ("welch", {0.5: [10, 11, 12, 13, 14]})):
            p = float((stats.ttest_rel(a, b) if kind == "paired" else stats.ttest_ind(a, b, equal_var=False)).pvalue)
            if not 0.0125 < p < 0.2:
                continue
            sel = _select(_rows({1.0: a, 0.5: b}, seeds=seeds))
            assert sel.test == ("paired t-test" if kind == "paired" else "Welch's t-test")
            assert sel.p_value == pytest.approx(p, rel=1e-9)
            assert sel.significant == (p < 0.05), (kind, p, sel.statement())
            seen[kind].append(p)
    for kind, ps in seen.items():
        assert sum(0.05 < p <= 0.1 for p in ps) >= 5 and sum(0.025 < p <= 0.05 for p in ps) >= 5, (kind, sorted(ps))


# --------------------------------------------------------------------------- LP-2ST (the recipe): one release per label

@pytest.mark.parametrize("method", ["lp2st", "lp1st"])
def test_the_recipe_releases_every_label_exactly_once(method, monkeypatch):
    """Ghazi et al.'s LP-MST is epsilon-label-DP because each label goes through RRWithPrior once: the
    labels handed to the releases, over all stages, are the training labels, each once (per-class
    counts equal; a second release of part 1 adds its labels again)."""
    from dpmech.label_dp import recipe as rc

    g = torch.Generator().manual_seed(3)
    n, k = 150, 10
    x = torch.rand(n, 1, 28, 28, generator=g) * 2 - 1
    y = torch.randint(0, k, (n,), generator=g)
    released = []
    real = rc.rr_with_prior

    def spy(labels, prior, eps, gen):
        released.append(labels.clone())
        return real(labels, prior, eps, gen)

    monkeypatch.setattr(rc, "rr_with_prior", spy)
    cfg = rc.RecipeConfig(epochs=1, batch_size=50, width=4, hidden=8)
    rc.train_label_dp(method, x, y, 1.0, seed=3, cfg=cfg, noise_key=NoiseKey(bytes(32)))
    assert len(released) == (2 if method == "lp2st" else 1)
    every = torch.cat(released)
    assert every.numel() == n, [r.numel() for r in released]
    assert torch.equal(torch.bincount(every, minlength=k), torch.bincount(y, minlength=k))


# --------------------------------------------------------------------------- not_learned: the exact binomial test

def test_not_learned_is_exactly_the_one_sided_binomial_test_at_its_level():
    """did_not_learn against scipy's one-sided binomtest at 0.01, at every count of correct answers
    around the threshold (where a frequency test cannot tell P(C >= c) from P(C > c)), on balanced and on
    imbalanced labels (chance = the majority class's frequency)."""
    from scipy.stats import binomtest

    from dpmech.robustness.evaluation import CHANCE_TEST_LEVEL, did_not_learn

    assert CHANCE_TEST_LEVEL == 0.01
    for y, p0 in ((torch.arange(200) % 10, 0.1), (torch.cat([torch.zeros(80), torch.arange(120) % 10]).long(), 0.46)):
        n = len(y)
        flags = []
        for c in range(n + 1):
            want = float(binomtest(c, n, p0, alternative="greater").pvalue > 0.01)
            got = did_not_learn(num_classes=10, acc_clean=c / n, n_test=n, y=y)
            assert got == want, (c, n, p0, got)
            flags.append(got)
        assert flags[0] == 1.0 and flags[-1] == 0.0                    # both sides of the threshold are seen
