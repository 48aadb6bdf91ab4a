"""benchmarks/dp_certified_mnist.py, issue 36 item 3: dpal_sound, SecureSGD and PixelDP on the certified
chart. The --demo of each new unit kind trains, certifies and writes a unit file with curves; each is
smoothed with the Gaussian input noise it trains with; the summary, the docs table and the figure give
each mechanism rows / curves of its own, labelled with what its epsilon protects, and keep it out of the
DP-SGD envelope the issue's targets are for."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import dp_certified_mnist as bench

NEW = ("dpal_sound", "secure_sgd", "pixeldp")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpcm") / "demo.json"
    bench.main(["--demo", "--out", str(out), "--methods", *NEW, "gaussian", "--epsilons", "3", "none",
                "--sigmas", "0.5", "--threads", "2"])
    return out


def test_demo_writes_a_unit_file_with_curves_for_each_new_kind(demo):
    runs = demo.with_suffix("")
    stems = {p.stem for p in runs.glob("*.json")}
    # dpal_sound and secure_sgd at epsilon 3 only (never non-private), pixeldp only in the non-private row
    assert {"dpal_sound_eps_3_sigma01-0.5_n200_seed0", "secure_sgd_eps_3_sigma01-0.5_n200_seed0",
            "pixeldp_non_private_sigma01-0.5_n200_seed0"} <= stems
    assert not any(s.startswith(("dpal_sound_non_private", "secure_sgd_non_private", "pixeldp_eps")) for s in stems)
    for method in NEW:
        (path,) = runs.glob(f"{method}_*.json")
        unit = json.loads(path.read_text())
        assert unit["method"] == method and unit["n"] == 200 and unit["images"] == 20
        assert set(unit["cert_acc_01"]) == {bench.key01(r) for r in bench.CURVE_RADII_01}
        radius01, correct = np.array(unit["radius_01"]), np.array(unit["correct"])
        for r, acc in unit["cert_acc_01"].items():          # the curve is the per-image radii's
            assert acc == pytest.approx(100 * np.mean(correct & (radius01 >= float(r))))
        # smoothed with the noise it trains with: std 2 sigma_01 in [-1, 1]
        assert unit["sigma_pm1_certified"] == pytest.approx(2 * unit["sigma_01"], rel=1e-9)
        assert unit["epsilon_protects"] == bench.MECHANISMS[method]["protects"]
        assert (runs / "models" / f"{unit['model']}.pt").exists()


def test_each_epsilon_is_what_it_is(demo):
    units = json.loads(demo.read_text())["units"]
    sound, secure, pix = (units[f"{m}_{r}_sigma01-0.5_n200_seed0"] for m, r in
                          (("dpal_sound", "eps_3"), ("secure_sgd", "eps_3"), ("pixeldp", "non_private")))
    for u in (sound, secure):          # a DP-SGD ledger's training-data epsilon, at delta 1e-5 and 1e-6
        assert u["epsilon"] <= 3.0 + 1e-9 and u["epsilon_delta_1e-6"] > u["epsilon"] and u["delta"] == 1e-5
    assert secure["config"]["noise_after"] == 0 and secure["robustness"]["noise_scale"] == pytest.approx(1.0)
    assert secure["robustness"]["robustness_epsilon"] <= bench.ROBUST_EPS       # recomputed from the noise used
    # PixelDP: no training-data epsilon at all; its robustness epsilon kept under its own name
    assert pix["epsilon"] is None and pix["epsilon_delta_1e-6"] is None and pix["noise_multiplier"] is None
    assert pix["robustness"]["robustness_epsilon_config"] == 1.0 and pix["robustness"]["noise_scale"] == 1.0
    assert sound["config"]["smoothing_sigma"] == 1.0 and sound["config"]["noise_augmentation_sigma"] == 0


def test_summary_gives_each_mechanism_its_own_rows_outside_the_dpsgd_envelope(demo):
    summary = json.loads(demo.read_text())
    mech = summary["mechanisms"]
    assert set(mech) == set(NEW) and set(mech["pixeldp"]) == {"non_private"} and set(mech["dpal_sound"]) == {"eps_3"}
    for method, rows in mech.items():
        for e in rows.values():
            assert e["epsilon_protects"] == bench.MECHANISMS[method]["protects"] and e["target"] is None
            assert {c["method"] for c in e["config"].values()} == {method}
    assert "protects no training data" in mech["pixeldp"]["non_private"]["epsilon_protects"]
    assert mech["pixeldp"]["non_private"]["epsilon"] is None
    # the issue's eps_3 envelope stays the DP-SGD methods' even where another mechanism certifies more
    for row in ("eps_3", "non_private"):
        assert {c["method"] for c in summary[row]["config"].values()} == {"gaussian"}


def test_docs_rows_and_figure_say_what_each_epsilon_protects(demo, tmp_path):
    summary = json.loads(demo.read_text())
    table = bench.docs_table(summary)
    assert "| dpal_sound, eps 3; eps 3.00 at delta 1e-5" in table
    assert "epsilon protects training examples (DP-SGD ledger) |" in table
    assert "secure_sgd, eps 3; eps 3.00 at delta 1e-5" in table and "the noise layer's eps_r 1 protects none" in table
    assert "| pixeldp (robustness eps 1, delta 0.05); epsilon protects no training data (a robustness parameter; " \
           "trained without DP) |" in table
    assert "Other mechanisms not run yet" in table and "dpal_sound, eps 1" in table   # the rows still to run
    # the figure: a family per mechanism, labelled by the report's own protects_short
    import matplotlib

    matplotlib.use("Agg")
    from sweeps.report import certified

    drawn = []
    real = certified.draw_radius_figure
    certified.draw_radius_figure = lambda curves, path, **kw: drawn.extend(curves) or real(curves, path, **kw)
    try:
        assert bench.draw_figure(summary, tmp_path / "fig.png")
    finally:
        certified.draw_radius_figure = real
    fam = {c.family: c.protects for c in drawn}
    assert fam["dpal_sound, eps 3"] == "DP: training examples" == fam["secure_sgd, eps 3"]
    assert fam["pixeldp (robustness eps 1, delta 0.05)"] == "not DP: a robustness parameter, protects no training data"
    assert fam["DP-SGD eps 3"] == "DP: training examples" and (tmp_path / "fig.png").exists()
    assert all(c.config["method"] == "gaussian" for c in drawn if c.family in ("DP-SGD eps 3", "same code, non-private"))


def test_noise_layer_std_matches_the_dpsgd_units_sigma():
    """The construction bound L of SecureSGD (HGM) and PixelDP is chosen so the noise layer's std is the
    DP-SGD units' sigma_[-1,1]; the trained model is smoothed with exactly that std."""
    from dpmech.pixeldp.trainer import PixelDPConfig
    from dpmech.secure_sgd.trainer import SecureSGDConfig

    for s01 in bench.SIGMAS_01:
        for method, cls in (("secure_sgd", SecureSGDConfig), ("pixeldp", PixelDPConfig)):
            cfg, _ = bench.make_mechanism_config("eps_3" if method == "secure_sgd" else "non_private", method,
                                                 s01, 0)
            assert isinstance(cfg, cls) and cfg.noise_after == 0
            scale = cfg.noise_scale
            assert scale == pytest.approx(2 * s01, rel=1e-9)
    with pytest.raises(ValueError, match="method"):
        bench.make_mechanism_config("eps_3", "dpcert", 0.5, 0)


def test_recipes_follow_the_rows():
    sound, _ = bench.make_mechanism_config("eps_3", "dpal_sound", 0.5, 1)
    secure, _ = bench.make_mechanism_config("eps_1", "secure_sgd", 1.0, 0)
    pix, _ = bench.make_mechanism_config("non_private", "pixeldp", 0.25, 0)
    tb = bench.RECIPES
    assert (sound.epsilon, sound.epochs, sound.batch_size, sound.lr, sound.max_grad_norm) == (3.0, 40, 512, 0.5, 0.1)
    assert (secure.epsilon, secure.epochs, secure.max_grad_norm, secure.clipping) == (1.0, 15, 0.1, "ghost")
    assert (pix.epochs, pix.lr, pix.batch_size, pix.optimizer) == (tb["non_private"]["epochs"], 0.05, 512, "sgd")
