"""ScatterNet features (dpmech.networks.scatternet) and the classifiers on them (dpmech.networks.dpsgd_models): the
features are kymatio's, the order-0 channel is the Gaussian low-pass average (checked by hand),
the disk cache round-trips, recovers from corrupt or partial files and serialises concurrent
writers, the models train with every clipping engine to the same clipped sum, the trial keys are
validated, and a tiny `features: scatternet` trial runs end to end through the trainable."""

from __future__ import annotations

import math
import threading
import time
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dpmech.networks.scatternet as sn
from dpmech.privacy.secret import NoiseKey
from dpmech.networks.dpsgd_models import FEATURE_MODELS, build_dp_model, build_feature_model

pytestmark = [pytest.mark.filterwarnings("ignore:Full backward hook is firing"), pytest.mark.usefixtures("one_thread")]


def images(n: int, seed: int = 0, shape=(1, 28, 28)) -> torch.Tensor:
    """Images in [-1, 1] with some structure (smoothed noise), seeded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, *shape, generator=g)
    x = F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    return x * 2 - 1


# ------------------------------------------------------------------ the transform
def test_features_are_kymatios_scattering_of_the_mapped_images():
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    x = images(5)
    ref = ScatteringTorch2D(J=2, shape=(28, 28), L=8)
    unit = sn.ScatterNet((1, 28, 28))                         # T&B: [0, 1] inputs
    pm1 = sn.ScatterNet((1, 28, 28), input_range="pm1")
    assert unit(x).shape == (5, 81, 7, 7) == (5, *sn.feature_shape((1, 28, 28)))
    assert torch.allclose(unit(x), ref((x + 1) / 2).reshape(5, 81, 7, 7), atol=1e-6)
    assert torch.allclose(pm1(x), ref(x).reshape(5, 81, 7, 7), atol=1e-6)
    assert not torch.allclose(unit(x), pm1(x), atol=1e-3)     # the range is part of the transform
    # orders >= 1 are positively homogeneous (zero-mean wavelets): S(2u - 1) = 2 S(u) there
    assert torch.allclose(pm1(x)[:, 1:], 2 * unit(x)[:, 1:], atol=1e-5)
    # C channels -> 81 C channels, each channel transformed on its own
    rgb = images(2, shape=(3, 32, 32))
    out = sn.ScatterNet((3, 32, 32))(rgb)
    assert out.shape == (2, 243, 8, 8) and sn.feature_shape((3, 32, 32)) == (243, 8, 8)
    assert torch.allclose(out[:, 81:162], sn.ScatterNet((1, 32, 32))(rgb[:, 1:2]), atol=1e-6)
    assert sn.num_channels(2, 8) == 81 and sn.num_channels(3, 6) == 1 + 18 + 108


def _periodic_gaussian_average(x: np.ndarray, sigma: float, pad: int, size: int, step: int) -> np.ndarray:
    """By hand: reflect-pad the image to ``size``, average it with a unit-sum Gaussian of std
    ``sigma`` (periodic on the padded grid), keep every ``step``-th pixel of the original image."""
    xp = np.pad(x, pad, mode="reflect")
    u = np.arange(size)
    d = np.minimum(u, size - u).astype(np.float64)            # periodic distance to 0
    g1 = np.exp(-d ** 2 / (2 * sigma ** 2))
    kernel = np.outer(g1, g1)
    kernel /= kernel.sum()                                    # a weighted average
    out = np.zeros((x.shape[0] // step, x.shape[1] // step))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            ci, cj = pad + i * step, pad + j * step
            rows = (ci - u) % size
            cols = (cj - u) % size
            out[i, j] = (xp[np.ix_(u, u)] * kernel[np.ix_(rows, cols)]).sum()
    return out


def test_order_zero_channel_is_the_low_pass_average():
    """Oyallon & Mallat's S_0 x = (x * phi_J)(2^J n): a Gaussian average (kymatio: std 0.8 2^(J-1),
    reflect padding to 36 x 36 on MNIST) at every 4th pixel, computed here without kymatio."""
    x = images(2, seed=3)
    s = sn.ScatterNet((1, 28, 28), input_range="pm1")(x)
    for k in range(2):
        ref = _periodic_gaussian_average(x[k, 0].double().numpy(), 0.8 * 2 ** (2 - 1), 4, 36, 4)
        assert np.allclose(s[k, 0].numpy(), ref, atol=2e-4)
        # negative control: the same average of another image does not match
        other = _periodic_gaussian_average(x[1 - k, 0].double().numpy(), 1.6, 4, 36, 4)
        assert not np.allclose(s[k, 0].numpy(), other, atol=1e-2)
    const = torch.full((1, 1, 28, 28), 0.3)
    c = sn.ScatterNet((1, 28, 28), input_range="pm1")(const)
    assert torch.allclose(c[:, 0], torch.full((1, 7, 7), 0.3), atol=1e-4)   # the average of a constant
    assert c[:, 1:].abs().max() < 1e-5                                       # zero-mean wavelets see nothing


def test_scattering_is_differentiable_in_its_input():
    x = images(2).requires_grad_(True)
    sn.ScatterNet((1, 28, 28))(x).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_bad_parameters_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^features: scatternet with J=3 needs image height and width divisible by"):
        sn.ScatterNet((1, 28, 28), J=3)
    with pytest.raises(ValueError, match="^input_range must be one of"):
        sn.ScatterNet((1, 28, 28), input_range="zero_one")
    with pytest.raises(ValueError, match=r"^x must be \[N, 1, 28, 28\]"):
        sn.ScatterNet((1, 28, 28))(torch.zeros(2, 1, 32, 32))
    with pytest.raises(ValueError, match=r"^x must be a tensor \[N, C, H, W\]"):
        sn.scatter_features(torch.zeros(3, 28, 28), cache=False)


# ------------------------------------------------------------------ the cache
def _files(tmp_path):
    return sorted(p for p in tmp_path.rglob("*.pt"))


def test_cache_round_trip_by_content(tmp_path, monkeypatch):
    x = images(40)
    first = sn.scatter_features(x, dataset="mnist", cache_dir=tmp_path, chunk_rows=16)
    assert torch.allclose(first, sn.ScatterNet((1, 28, 28))(x), atol=1e-6)
    files = _files(tmp_path)
    assert len(files) == 3 and all(p.parent.name == "scatternet-kymatio0.3.0-J2-L8-unit" for p in files)
    calls = []
    monkeypatch.setattr(sn, "_compute", lambda *a: calls.append(1) or (_ for _ in ()).throw(AssertionError("computed")))
    again = sn.scatter_features(x, dataset="mnist", cache_dir=tmp_path, chunk_rows=16)
    assert torch.equal(again, first) and not calls                           # every chunk from disk
    monkeypatch.undo()
    # appended rows (an audit's canaries) reuse the chunks before them; other pixels are other keys
    more = torch.cat([x[:32], images(5, seed=9)])
    seen = []
    real = sn._compute
    monkeypatch.setattr(sn, "_compute", lambda net, chunk, dev: seen.append(chunk.shape[0]) or real(net, chunk, dev))
    out = sn.scatter_features(more, dataset="mnist", cache_dir=tmp_path, chunk_rows=16)
    assert seen == [5] and torch.equal(out[:32], first[:32])
    # another input range is another directory
    sn.scatter_features(x[:3], dataset="mnist", cache_dir=tmp_path, input_range="pm1")
    assert any(p.parent.name.endswith("-pm1") for p in _files(tmp_path))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong_chunk", "half_written"])
def test_corrupt_or_partial_cache_is_recomputed(tmp_path, damage):
    x = images(20)
    good = sn.scatter_features(x, dataset="mnist", cache_dir=tmp_path, chunk_rows=10)
    (a,) = [p for p in _files(tmp_path) if sn._digest(x[:10])[:32] in p.name]       # the first chunk's file
    (b,) = [p for p in _files(tmp_path) if p != a]
    if damage == "truncated":
        a.write_bytes(a.read_bytes()[: a.stat().st_size // 2])
    elif damage == "garbage":
        a.write_bytes(b"not a torch file")
    elif damage == "wrong_chunk":       # a valid file holding another chunk's features
        a.write_bytes(b.read_bytes())
    else:                               # a writer killed after the temporary file: no final file
        a.unlink()
        (a.parent / f".{a.name}.123.tmp").write_bytes(b"partial")
    out = sn.scatter_features(x, dataset="mnist", cache_dir=tmp_path, chunk_rows=10)
    assert torch.equal(out, good)
    obj = torch.load(a, weights_only=True)                    # the file was replaced by a valid one
    assert torch.equal(obj["features"], good[:10])


def test_a_failed_write_leaves_no_cache_file(tmp_path, monkeypatch):
    x = images(4)

    def dies(obj, fh):
        fh.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(sn.torch, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        sn.scatter_features(x, dataset="mnist", cache_dir=tmp_path)
    assert _files(tmp_path) == [] and not list(tmp_path.rglob("*.tmp"))
    monkeypatch.undo()
    assert torch.allclose(sn.scatter_features(x, dataset="mnist", cache_dir=tmp_path), sn.ScatterNet((1, 28, 28))(x),
                          atol=1e-6)


def test_concurrent_writers_compute_each_chunk_once(tmp_path, monkeypatch):
    """Two workers (threads here; the fcntl lock is per open file, so it serialises them as it
    does processes) asking for the same features: each chunk is computed once, both get it."""
    x = images(24)
    real, computed = sn._compute, []

    def slow(net, chunk, device):
        computed.append(chunk.shape[0])
        time.sleep(0.3)                  # widen the race window
        return real(net, chunk, device)

    monkeypatch.setattr(sn, "_compute", slow)
    results = [None, None]

    def worker(i):
        results[i] = sn.scatter_features(x, dataset="mnist", cache_dir=tmp_path, chunk_rows=12)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(results[0], results[1])
    assert computed == [12, 12]          # two chunks, each once (without the lock: up to four)


# ------------------------------------------------------------------ models
def test_feature_models_and_their_errors():
    lin = build_feature_model("linear", (81, 7, 7), 10, seed=0)
    cnn = build_feature_model("scatter_cnn", (81, 7, 7), 10, seed=0)
    assert sum(p.numel() for p in lin.parameters()) == 81 * 49 * 10 + 10
    assert cnn(torch.randn(3, 81, 7, 7)).shape == (3, 10)
    assert build_feature_model("scatter_cnn", (243, 8, 8), 10)(torch.randn(2, 243, 8, 8)).shape == (2, 10)
    same = build_feature_model("linear", (81, 7, 7), 10, seed=0)
    assert torch.equal(lin.fc.weight, same.fc.weight)                       # seeded
    assert not torch.equal(lin.fc.weight, build_feature_model("linear", (81, 7, 7), 10, seed=1).fc.weight)
    # the GroupNorm is per example and data-independent: an example's output ignores the others
    f = torch.randn(4, 81, 7, 7)
    assert torch.allclose(lin(f)[:1], lin(f[:1]), atol=1e-6)
    with pytest.raises(ValueError, match="^feature_norm_groups must divide the 81 feature channels"):
        build_feature_model("linear", (81, 7, 7), 10, groups=10)
    with pytest.raises(ValueError, match="^model must be one of 'linear', 'scatter_cnn'"):
        build_feature_model("tb_cnn", (81, 7, 7), 10)
    with pytest.raises(ValueError, match="^model: 'scatter_cnn' is defined on 7 x 7"):
        build_feature_model("scatter_cnn", (81, 6, 6), 10)
    with pytest.raises(ValueError, match="^model: 'linear' is a classifier on ScatterNet features"):
        build_dp_model("linear", "mnist")


def _per_example_clipped_sum(model, x, y, c):
    """Reference: each example's gradient by its own backward pass, clipped, summed."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        g = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
        norm = torch.sqrt(sum((t * t).sum() for t in g))
        factor = min(1.0, c / (float(norm) + 1e-6))
        total = [a + factor * t for a, t in zip(total, g)]
    return torch.cat([t.flatten() for t in total])


@pytest.mark.parametrize("name", FEATURE_MODELS)
def test_bk_clipped_sum_on_feature_models_equals_the_reference_in_float64(name):
    from dpmech.privacy.clipping import BookKeeper

    model = build_feature_model(name, (81, 7, 7), 10, seed=2).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 81, 7, 7, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 10, (12,), generator=g)
    c = 0.05                                                 # below most norms: clipping is active
    ref = _per_example_clipped_sum(model, x, y, c)
    bk = BookKeeper(model)
    bk.enabled = True
    logits = model(x)
    bk.enabled = False
    norms = bk.clipped_sum(F.cross_entropy(logits, y, reduction="none").sum(), c)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    bk.remove()
    assert (norms > c).sum() >= 6
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-12)
    # negative control: the unclipped sum is far from it
    unclipped = torch.autograd.grad(F.cross_entropy(model(x), y, reduction="sum"), list(model.parameters()))
    assert not torch.allclose(torch.cat([t.flatten() for t in unclipped]), ref, rtol=1e-2)


@pytest.mark.parametrize("name", FEATURE_MODELS)
def test_engines_take_the_same_step_and_a_few_dp_steps_learn(name):
    from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 81, 7, 7, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    idx = torch.arange(0, 64, 2)
    steps = {}
    for mode in ("bk", "ghost", "flat"):
        cfg = DPSGDConfig(epsilon=None, noise_multiplier=0.0, max_grad_norm=0.01, batch_size=32, lr=1.0,
                          momentum=0.0, clipping=mode, seed=0)
        tr = DPSGDTrainer(build_feature_model(name, (81, 7, 7), 10, seed=5), x, y, cfg, noise_key=NoiseKey.reproducible(cfg.seed))
        before = torch.cat([p.detach().flatten().clone() for p in tr.model.parameters()])
        tr._step(idx)
        steps[mode] = torch.cat([p.detach().flatten() for p in tr.model.parameters()]) - before
    assert torch.allclose(steps["bk"], steps["ghost"], atol=1e-6)
    assert torch.allclose(steps["bk"], steps["flat"], atol=1e-6)
    # a few noisy steps on a learnable task (labels from a fixed linear rule) lower the loss
    w = torch.randn(81 * 49, 10, generator=g)
    yy = (x.flatten(1) @ w).argmax(1)
    cfg = DPSGDConfig(epsilon=None, noise_multiplier=0.5, max_grad_norm=1.0, batch_size=32, lr=0.5,
                      momentum=0.9, clipping="bk", seed=0)
    tr = DPSGDTrainer(build_feature_model(name, (81, 7, 7), 10, seed=5), x, yy, cfg, noise_key=NoiseKey.reproducible(cfg.seed))
    with torch.no_grad():
        start = float(F.cross_entropy(tr.model(x), yy))
    for _ in range(3):
        tr.train_epoch()
    with torch.no_grad():
        assert float(F.cross_entropy(tr.model(x), yy)) < start
    assert tr.privacy()["steps"] == 6 and tr.noise_multiplier == 0.5


# ------------------------------------------------------------------ the trial keys
def _validate(**cfg):
    from trainables.dpsgd import DPSGDTrialConfig
    from trainables.runtime import validate_config

    return validate_config({"trainable": "dpsgd", **cfg}, DPSGDTrialConfig)


@pytest.mark.parametrize("cfg, message", [
    ({"model": "linear"}, "features must be 'scatternet' with model 'linear'"),
    ({"features": "scatternet"}, "model must be 'linear' or 'scatter_cnn' with features 'scatternet'"),
    ({"features": "scatternet", "model": "tb_cnn"}, "model must be 'linear' or 'scatter_cnn'"),
    ({"features": "scatternet", "model": "linear", "noise_augmentation_sigma": 0.5},
     "noise_augmentation_sigma must be 0 with features 'scatternet'"),
    ({"features": "scatternet", "model": "linear", "feature_norm_groups": 10},
     "feature_norm_groups must divide the 81 ScatterNet channels of 'mnist'"),
    ({"features": "scatternet", "model": "linear", "dataset": "cifar10", "feature_norm_groups": 162},
     "feature_norm_groups must divide the 243 ScatterNet channels of 'cifar10'"),
])
def test_trial_key_rules(cfg, message):
    with pytest.raises(ValueError) as err:
        _validate(**cfg)
    # a model-level rule (it involves two keys): the runtime's "config.config: Value error, <rule>"
    assert str(err.value).startswith(f"config.config: Value error, {message}"), str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_features_value_names_the_key():
    with pytest.raises(ValueError, match=r"^config.features: Input should be 'none' or 'scatternet'"):
        _validate(features="scatter")


def test_a_spec_sweeping_both_keys_is_checked_per_combination(tmp_path):
    """The cross-key rule is model-level, so a spec may sweep features and model together; a
    combination that breaks it is refused with the rule."""
    from sweeps.spec import SpecError, expand_trials, validate_spec

    base = {"name": "t", "common": {"train_size": 500, "test_size": 50, "certify_images": 0}}
    ok = validate_spec({**base, "trainables": [{"name": "dpsgd", "search": {
        "features": "scatternet", "model": ["linear", "scatter_cnn"], "feature_norm_groups": [27, 81]}}]})
    assert len(expand_trials(ok)) == 4
    with pytest.raises(SpecError, match="features must be 'scatternet' with model 'linear'"):
        expand_trials(validate_spec({**base, "trainables": [{"name": "dpsgd", "search": {"model": "linear"}}]}))


def test_valid_feature_configs_and_an_unchanged_privacy_event():
    from trainables.dpsgd import privacy_event

    cfg = _validate(features="scatternet", model="scatter_cnn", feature_norm_groups=0, clipping="ghost")
    assert cfg.features == "scatternet" and cfg.model == "scatter_cnn"
    assert _validate(features="scatternet", model="linear", dataset="cifar10", feature_norm_groups=81).model == "linear"
    common = dict(epsilon=3.0, batch_size=4096, epochs=2, train_size=None)
    images_event = privacy_event(_validate(model="tb_cnn", **common))
    assert privacy_event(_validate(features="scatternet", model="linear", **common)) == images_event
    assert privacy_event(_validate(features="scatternet", model="linear", **{**common, "epochs": 3})) != images_event


def test_feature_keys_do_not_reach_dpal_sound():
    """``model`` of dpal_sound shares the image-model rule: the feature classifiers are not offered there."""
    from trainables.dpal_sound import DPALSoundTrialConfig
    from trainables.runtime import validate_config

    with pytest.raises(ValueError, match="^config.model: Value error, must be one of 'pixeldp_cnn'"):
        validate_config({"trainable": "dpal_sound", "model": "linear"}, DPALSoundTrialConfig)


# ------------------------------------------------------------------ a trial end to end
def _run(monkeypatch, config: dict) -> list[dict]:
    from ray import tune

    from trainables.registry import get_trainable

    results = []
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: types.SimpleNamespace(get_trial_id=lambda: "t0"))
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: results.append(dict(metrics)))
    get_trainable(config["trainable"]).fn(config)
    return results


TINY = {"trainable": "dpsgd", "dataset": "mnist", "train_size": 512, "test_size": 100, "batch_size": 128,
        "epochs": 2, "epsilon": 3.0, "lr": 4.0, "max_grad_norm": 0.1, "features": "scatternet", "model": "linear",
        "input_range": "unit", "certify_images": 0, "seed": 0}


def test_tiny_scatternet_trial_end_to_end(monkeypatch, tmp_path):
    """Through the trainable function: trains on cached features, reports the planned epsilon,
    and its accuracy is the deployed model's (scattering + classifier on the test images)."""
    from dpmech.datasets.splits import load_splits
    from trainables.dpsgd import DPSGDMechanism, DPSGDTrialConfig, privacy_event
    from dpmech.privacy.accounting import epsilon as event_epsilon

    monkeypatch.setattr(sn, "cache_root", lambda: tmp_path)
    tiny = {**TINY, "noise_source": "seed"}   # the research mode: the run by hand below replays its noise
    results = _run(monkeypatch, tiny)
    final = results[-1]
    assert [r["epoch"] for r in results] == [1, 2, 2] and final["evaluated"] == 1.0
    assert final["acc_clean"] > 0.5                          # 512 images, 2 epochs: far above chance (0.1)
    cfg = DPSGDTrialConfig(**{k: v for k, v in tiny.items() if k != "trainable"})
    assert final["epsilon"] == pytest.approx(event_epsilon(privacy_event(cfg), cfg.delta), rel=1e-9)
    assert final["epsilon"] <= 3.0
    assert len(list(tmp_path.rglob("*.pt"))) == 2           # train and test features cached

    # the same trial by hand: the final accuracy is the deployed model's, end to end on images
    train, test = load_splits("mnist", train_size=512, test_size=100, seed=0)
    mech = DPSGDMechanism(cfg, *train.tensors, torch.device("cpu"), noise_key=NoiseKey.reproducible(cfg.seed))
    while mech.epoch < cfg.epochs:
        mech.train_epoch()
    xt, yt = test.tensors
    deployed = mech.model
    assert isinstance(deployed[0], sn.ScatterNet) and deployed[1] is mech.trainer.model
    with torch.no_grad():
        end_to_end = int((deployed(xt).argmax(1) == yt).sum()) / yt.shape[0]
    assert mech.test_accuracy(xt, yt) == pytest.approx(end_to_end, abs=1e-9)
    assert final["acc_clean"] == pytest.approx(end_to_end, abs=1e-9)       # same key, same run


def test_attacks_run_on_the_deployed_model(monkeypatch, tmp_path):
    """An attack takes its gradients through the scattering: FGSM at a large size lowers accuracy."""
    monkeypatch.setattr(sn, "cache_root", lambda: tmp_path)
    final = _run(monkeypatch, {**TINY, "epochs": 1, "test_size": 40, "attacks": {"fgsm": [0.5]},
                               "attack_norm": "linf"})[-1]
    assert final["acc_fgsm_0.5"] < final["acc_clean"]
    assert math.isfinite(final["epsilon"])
