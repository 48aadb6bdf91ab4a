"""Selection a reviewer trusts (issue 34, points 1 and 2): the spec's ``selection`` section, the
selection split inside a trial (``trainables.config.selection_images``, ``heldout_<metric>``), and
the best configuration by its repeats with the significance of its lead (``sweeps.report.best``)."""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from sweeps.spec import SpecError, validate_spec

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = {"name": "sel", "trainables": [{"name": "dpsgd", "search": {"epsilon": [1.0, 8.0]}}],
        "common": {"train_size": 200, "test_size": 100, "epochs": 1, "batch_size": 32}}


def _spec(**sections):
    raw = copy.deepcopy(BASE)
    raw.update(sections)
    return validate_spec(raw)


# --------------------------------------------------------------------------- the spec section


def test_selection_split_reaches_every_trial():
    from sweeps.spec import expand_trials

    trials = expand_trials(_spec(selection={"split": "validation", "size": 50}))
    assert {(t["selection_split"], t["selection_size"]) for t in trials} == {("validation", 50)}
    trials = expand_trials(_spec(selection={"split": "test_half"}))
    assert {(t["selection_split"], t["selection_size"]) for t in trials} == {("test_half", None)}
    assert {t["selection_split"] for t in expand_trials(_spec())} == {"none"}  # negative control


@pytest.mark.parametrize("sections, message", [
    ({"selection": {"split": "validation"}}, "selection.size: required with split validation"),
    ({"selection": {"split": "none", "size": 3}}, "selection.size: only used with split validation or test_half"),
    ({"selection": {"split": "validation", "size": 200}}, "selection.size: 200 selection images leave none of the 200 "
                                                          "training images (common.train_size)"),
    ({"selection": {"split": "test_half", "size": 100}}, "selection.size: 100 selection images leave none of the 100 "
                                                         "test images (common.test_size)"),
    ({"selection": {"split": "half"}}, "selection.split: must be one of"),
    ({"selection": {"statistic": "best"}}, "selection.statistic: must be one of"),
    ({"search": {"metric": "heldout_acc_clean", "mode": "max"}},
     "search.metric: 'heldout_acc_clean' is measured on the held-out images"),
])
def test_selection_section_errors_are_one_line(sections, message):
    with pytest.raises(SpecError) as err:
        _spec(**sections)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_selection_keys_belong_to_the_section():
    raw = copy.deepcopy(BASE)
    raw["common"]["selection_split"] = "test_half"
    raw["selection"] = {"split": "test_half"}
    with pytest.raises(SpecError, match=r"^common.selection_split: set by the spec's selection section"):
        validate_spec(raw)


def test_private_selection_refuses_a_validation_split():
    """tuning_privacy: validation images are private training data; they would steer the released
    choice without noise. test_half (public test images) is accepted."""
    raw = {"name": "tp", "trainables": [{"name": "dpsgd", "search": {"lr": {"choice": [0.1, 0.5]}}}],
           "common": {"train_size": 200, "test_size": 100, "epochs": 1, "batch_size": 32, "epsilon": 2.0},
           "search": {"algorithm": "random", "metric": "acc_clean", "mode": "max"},
           "tuning_privacy": {"distribution": "poisson", "mean": 2}}
    validate_spec({**raw, "selection": {"split": "test_half"}})
    with pytest.raises(SpecError, match=r"^selection.split: validation images are carved from the training data"):
        validate_spec({**raw, "selection": {"split": "validation", "size": 20}})


def test_validation_split_shrinks_the_privacy_plan():
    from trainables.config import planned_train_size
    from trainables.dpsgd import DPSGDTrialConfig as DPSGDConfig

    cfg = DPSGDConfig(train_size=200, selection_split="validation", selection_size=50, epsilon=1.0, batch_size=32)
    assert planned_train_size(cfg) == 150
    assert planned_train_size(DPSGDConfig(train_size=200, epsilon=1.0, batch_size=32)) == 200


# --------------------------------------------------------------------------- the split in a trial


def _tensors(n_train=40, n_test=30):
    g = torch.Generator().manual_seed(0)
    x, xt = torch.randn(n_train, 1, 2, 2, generator=g), torch.randn(n_test, 1, 2, 2, generator=g)
    return x, torch.arange(n_train), xt, torch.arange(n_test) + 1000


@pytest.mark.parametrize("split, size", [("validation", 10), ("test_half", None), ("test_half", 12)])
def test_selection_images_partition_the_data(split, size):
    from trainables.dpsgd import DPSGDTrialConfig as DPSGDConfig
    from trainables.config import selection_images

    x, y, xt, yt = _tensors()
    cfg = DPSGDConfig(train_size=40, test_size=30, selection_split=split, selection_size=size, epsilon=1.0,
                      batch_size=8)
    xs, ys, xsel, ysel, xh, yh = selection_images(x, y, xt, yt, cfg)
    train, sel, held = set(ys.tolist()), set(ysel.tolist()), set(yh.tolist())
    assert not (train & sel) and not (sel & held) and not (train & held)
    if split == "validation":
        assert len(sel) == 10 and train | sel == set(y.tolist()) and held == set(yt.tolist())
    else:
        assert len(sel) == (size or 15) and sel | held == set(yt.tolist()) and train == set(y.tolist())
    again = selection_images(x, y, xt, yt, cfg)  # public and deterministic: data_seed only
    assert torch.equal(again[3], ysel)
    other = selection_images(x, y, xt, yt, cfg.model_copy(update={"data_seed": 1}))
    assert not torch.equal(other[3], ysel)
    none = selection_images(x, y, xt, yt, DPSGDConfig(train_size=40, epsilon=1.0, batch_size=8))
    assert none[4] is None and torch.equal(none[3], yt)  # negative control: no split, nothing held out


DPSGD = {"trainable": "dpsgd", "epsilon": 5.0, "train_size": 200, "test_size": 60, "epochs": 1, "batch_size": 50,
         "model": "tb_cnn", "noise_source": "seed"}


def _run(monkeypatch, config: dict):
    from ray import tune

    from trainables.registry import get_trainable

    results = []
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: types.SimpleNamespace(get_trial_id=lambda: "t0"))
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: results.append(dict(metrics)))
    get_trainable(config["trainable"]).fn(config)
    return results


def test_trial_scores_selection_and_held_out_images(monkeypatch):
    """test_half: acc_clean on the 20 selection images, heldout_acc_clean on the other 40; the
    training is the same as without a split (research-mode noise), so the two recombine exactly to
    the accuracy on all 60; without a split there is no heldout_ metric (negative control)."""
    plain = _run(monkeypatch, DPSGD)[-1]
    split = _run(monkeypatch, {**DPSGD, "selection_split": "test_half", "selection_size": 20})[-1]
    assert not any(k.startswith("heldout_") for k in plain)
    assert {"heldout_acc_clean", "heldout_not_learned"} <= set(split)
    assert "heldout_epsilon" not in split and split["epsilon"] == pytest.approx(plain["epsilon"])
    assert (20 * split["acc_clean"] + 40 * split["heldout_acc_clean"]) / 60 == pytest.approx(plain["acc_clean"])
    assert split["acc_clean"] * 20 == pytest.approx(round(split["acc_clean"] * 20))


def test_trial_with_validation_split_trains_on_fewer_images(monkeypatch):
    out = _run(monkeypatch, {**DPSGD, "selection_split": "validation", "selection_size": 50})[-1]
    assert out["sampling_rate"] == pytest.approx(50 / 150)    # batch 50 of the 150 images left for training
    assert "heldout_acc_clean" in out and out["heldout_acc_clean"] * 60 == pytest.approx(round(out["heldout_acc_clean"] * 60))


# --------------------------------------------------------------------------- the best configuration (point 1)

def _rows(configs: dict[float, list[float]], seeds=None) -> list[dict]:
    """Console rows: one configuration per max_grad_norm, one trial per value (seed = its index)."""
    rows = []
    for c, values in configs.items():
        for i, v in enumerate(values):
            seed = (seeds or {}).get(c, list(range(len(values))))[i]
            rows.append({"trial_id": f"c{c}-{i}", "trainable": "dpsgd", "status": "DONE", "cfg.max_grad_norm": c,
                         "cfg.seed": seed, "acc_clean": v})
    return rows


def _select(rows, mode="max", statistic="mean"):
    from sweeps.report.best import config_key_from_cfg, select_configuration

    return select_configuration(rows, "acc_clean", mode, statistic, config_of=config_key_from_cfg,
                                seed_of=lambda r: r["cfg.seed"], done=lambda r: r["status"] == "DONE")


def test_the_best_is_the_configuration_with_the_best_mean_not_the_luckiest_seed():
    """The issue's case: one seed of configuration A scores 0.9555, the best single trial, but A's
    mean is 0.9488; B's mean is higher. The best is B, with mean, sd and n."""
    rows = _rows({1.0: [0.9555, 0.9421], 0.5: [0.9530, 0.9520]})
    sel = _select(rows)
    assert sel.best.key[1][1] == "0.5" and sel.best.n == 2
    assert sel.best.mean == pytest.approx(0.9525) and sel.best.sd == pytest.approx(np.std([0.9530, 0.9520], ddof=1))
    assert sel.runner_up.mean == pytest.approx(0.9488)
    assert max(rows, key=lambda r: r["acc_clean"])["cfg.max_grad_norm"] == 1.0  # the lucky seed is A's
    # the statistic: worst seed agrees here; min mode picks the lowest mean
    assert _select(rows, statistic="worst").best.key == sel.best.key
    assert _select(rows, mode="min").best.key == sel.runner_up.key
    assert _select(_rows({1.0: [0.9, 0.1, 0.95], 0.5: [0.6, 0.6, 0.6]}), statistic="median").best.key[1][1] == "1.0"


def test_significance_paired_on_matching_seeds_else_welch():
    rng = np.random.default_rng(1)
    seed_effect = rng.normal(0, 0.02, 5)  # shared by both configurations on a seed: pairing removes it
    a = list(0.95 + seed_effect + rng.normal(0, 0.001, 5))
    b = list(0.94 + seed_effect + rng.normal(0, 0.001, 5))
    sel = _select(_rows({1.0: a, 0.5: b}))
    assert sel.test == "paired t-test" and sel.pairs == 5 and sel.significant, sel.statement()
    assert "significantly above the runner-up (paired t-test on 5 matching seeds" in sel.statement()
    # the same values on unmatched seeds: Welch's test cannot remove the seed effect, and finds nothing
    sel = _select(_rows({1.0: a, 0.5: b}, seeds={0.5: [10, 11, 12, 13, 14]}))
    assert sel.test == "Welch's t-test" and not sel.significant
    assert "not significantly different over the seeds (Welch's t-test, 5 and 5 seeds" in sel.statement()


def test_significance_is_calibrated_under_no_difference():
    """Negative control, statistically: two configurations with the same true mean; over 400
    simulated sweeps of 5 seeds the paired test calls about 5 % significant (binomial band)."""
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(400):
        seed_effect = rng.normal(0, 0.02, 5)
        a = list(0.95 + seed_effect + rng.normal(0, 0.005, 5))
        b = list(0.95 + seed_effect + rng.normal(0, 0.005, 5))
        hits += bool(_select(_rows({1.0: a, 0.5: b})).significant)
    assert 8 <= hits <= 36, hits        # 400 x 0.05 = 20; the 99.9 % binomial band is about 7..37
    rng = np.random.default_rng(8)   # positive control: a real difference of 3 sd of the noise
    power = sum(bool(_select(_rows({1.0: list(0.95 + rng.normal(0, 0.005, 5)),
                                   0.5: list(0.935 + rng.normal(0, 0.005, 5))})).significant) for _ in range(100))
    assert power >= 70, power


def test_one_trial_per_configuration_is_not_tested():
    sel = _select(_rows({1.0: [0.9], 0.5: [0.8]}))
    assert sel.best.n == 1 and sel.test == "" and "not tested" in sel.statement()
    assert "search.num_samples" in sel.statement()


def test_console_best_lines_show_the_configuration_its_spread_and_held_out_score():
    from sweeps.report.best import Best, describe_best

    rows = _rows({1.0: [0.9555, 0.9421], 0.5: [0.9530, 0.9520]})
    for r in rows:
        r["heldout_acc_clean"] = r["acc_clean"] - 0.004
    sel = _select(rows)
    best = Best("acc_clean", "max", sel.best.rows[0], "RUN", "", 4, False, True, sel, "test_half")
    text = describe_best(best, ["cfg.max_grad_norm", "cfg.seed"], 4)
    assert text.startswith("best:     configuration (max_grad_norm=0.5): acc_clean = 0.9525 ± 0.00071 (mean ± sd "
                           "over n = 2 seeds)"), text
    assert "runner-up (max_grad_norm=1) acc_clean = 0.9488 ± 0.0095" in text and "paired t-test on 2 matching seeds" in text
    assert "held-out acc_clean = 0.9485 ± 0.00071 (n = 2) on the test images selection did not read" in text
    assert "seed=" not in text.splitlines()[0]
