"""The GPU check (benchmarks/gpu_check.py, issue 37) in its tiny CPU mode, so that the script never rots
before a GPU machine runs it, and its negative controls: a planted device bug in the clipping engine (a
route's clipped sum on the wrong device, or in float32 where float64 was asked) makes it fail, naming the
part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
KEPT = ("inst", "bmm", "grouped")       # the routes whose clipped sum comes from kept per-example gradients


def run_check(tmp_path: Path, *args: str, timeout: int = 300) -> tuple[int, str, dict]:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return run_check(tmp_path_factory.mktemp("gpu_check"))


def test_tiny_mode_runs_every_section_and_passes(tiny):
    from dpmech.privacy.clipping import ROUTES

    rc, log, report = tiny
    assert rc == 0, log[-3000:]
    assert report["status"] == "pass" and report["failed"] == [] and report["mode"] == "tiny"
    assert report["device"].startswith("cpu") and report["versions"]["torch"] and report["date"]
    assert list(report["sections"]) == ["correctness", "speed", "packing", "real_run"]
    for name, sec in report["sections"].items():
        assert sec["status"] == "pass" and sec["wall_s"] > 0, (name, sec)
    parts = report["sections"]["correctness"]["parts"]
    assert {k: v["status"] for k, v in parts.items()} == {k: "pass" for k in
                                                          ("clipping", "dpsgd_step", "attacks", "certifiers", "checkpoint")}
    clip = parts["clipping"]
    for route in ROUTES:
        for dtype in ("float64", "float32"):
            if route.startswith("compiled"):           # compile time does not fit the tiny mode: skipped, said so
                assert "torch.compile" in clip["skipped"][route]
            else:
                entry = clip["routes"][f"{route} {dtype}"]
                assert entry["ok"] and entry["sum_rel_err"] <= clip["tolerance_rel"][dtype]
    assert clip["routes"]["measured float64"]["sum_rel_err"] < 1e-12   # far inside the tolerance the control breaks
    step = parts["dpsgd_step"]
    assert step["same_batches"] and step["params_rel_err"] <= 1e-9
    assert step["noise_draws_handed"] == step["noise_draws_expected"] > 0
    assert all(a["same_decisions"] for a in parts["attacks"]["attacks"].values())
    assert parts["certifiers"]["pixeldp"]["same_counts_and_predictions"]
    assert parts["certifiers"]["smoothing"]["same_counts_predictions_radii"]
    assert parts["checkpoint"]["dpsgd_trainer"]["status"] == "pass"


def test_tiny_mode_records_the_figures_of_each_part(tiny):
    _, _, report = tiny
    speed = report["sections"]["speed"]["parts"]
    for model, sizes in speed["dpsgd_step"]["models"].items():
        entry = sizes["8"]
        assert entry["rounds"] >= 1 and entry["measured_ratio"] > 0 and set(entry["ratio"]) >= {"ghost", "inst", "measured"}
        assert entry["measured_routes"], model
    assert speed["certification"]["throughput_ratio"] > 0 and speed["smoothing"]["images_s"] > 0
    packing = report["sections"]["packing"]
    assert packing["together"]["processes"] == 2 and len(packing["together"]["workers"]) == 2
    assert packing["throughput_ratio"] > 0 and packing["alone"]["workers"][0]["max_rss_mib"] > 0
    run = report["sections"]["real_run"]
    assert 0 <= run["acc_clean"] <= 1 and run["epsilon_rdp"] <= 3.0 + 1e-9 and run["steps"] > 0
    assert run["cpu_figure"]["acc_mean"] > 0.97        # beside the CPU figure of dpsgd_mnist_full.json


@pytest.mark.parametrize("bug", ["grad_device", "grad_dtype"])
def test_a_planted_device_bug_fails_the_check_and_names_the_part(tmp_path, bug):
    rc, log, report = run_check(tmp_path, "--sections", "correctness.clipping", "--plant-bug", bug)
    assert rc == 1, log[-2000:]
    assert report["status"] == "fail" and report["failed"] == ["correctness.clipping"]
    assert "FAILED: correctness.clipping" in log
    routes = report["sections"]["correctness"]["parts"]["clipping"]["routes"]
    bad = {k for k, v in routes.items() if not v["ok"]}
    # "mixed" and "measured" choose a kept route for some layers of the check's network, so they may fail too
    chooser = {"mixed", "measured"}
    dtypes = ("float64", "float32") if bug == "grad_device" else ("float64",)
    assert {f"{r} {d}" for r in KEPT for d in dtypes} <= bad
    assert all(k.split()[0] in set(KEPT) | chooser and k.split()[1] in dtypes for k in bad)
    if bug == "grad_device":      # the gradient is found on the wrong device (or assigning it fails)
        assert all("gradients_misplaced" in routes[k] or "error" in routes[k] for k in bad)
    else:                         # float32 arithmetic in a float64 step: seen by a wide margin
        assert min(routes[f"{r} float64"]["sum_rel_err"] for r in KEPT) > 10 * 1e-9
    assert all(v["ok"] for k, v in routes.items() if k.split()[0] not in set(KEPT) | chooser)   # the others


def test_a_short_budget_skips_sizes_and_says_which(tmp_path):
    rc, log, report = run_check(tmp_path, "--sections", "speed.dpsgd_step", "--budget", "0.01")
    assert rc == 0, log[-2000:]
    part = report["sections"]["speed"]["parts"]["dpsgd_step"]
    assert part["status"] == "skipped" and part["models"] == {}
    assert any("tb_cnn at batch 8" in s for s in part["skipped"])


def test_bad_sections_are_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--sections", "speed.nothing"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--sections: speed has the parts" in proc.stderr


def test_batchnorm_replacement_matches_opacus():
    # the speed section's networks are converted without Opacus (the GPU machine may lack it): the same
    # modules as Opacus's ModuleValidator.fix, which the DP-SGD trainer applies
    from opacus.validators import ModuleValidator

    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_check import bn_to_gn
    from dpmech.networks.pixeldp import PixelDPWideResNet

    ours = bn_to_gn(PixelDPWideResNet(None, depth=10, width=1, noise_after=0))
    theirs = ModuleValidator.fix(PixelDPWideResNet(None, depth=10, width=1, noise_after=0))
    norm = [(n, type(m).__name__, getattr(m, "num_groups", None), getattr(m, "num_channels", None), getattr(m, "affine", None))
            for n, m in ours.named_modules() if isinstance(m, (nn.GroupNorm, nn.BatchNorm2d))]
    ref = [(n, type(m).__name__, getattr(m, "num_groups", None), getattr(m, "num_channels", None), getattr(m, "affine", None))
           for n, m in theirs.named_modules() if isinstance(m, (nn.GroupNorm, nn.BatchNorm2d))]
    assert norm == ref and norm and all(t == "GroupNorm" for _, t, *_ in norm)


def test_missing_trainer_dependencies_skip_with_the_reason():
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu_check

    why = gpu_check.trainer_missing({"opacus": "x", "dp-accounting": "y"})
    assert "opacus and dp-accounting" in why and "docs/gpu.md" in why
    assert gpu_check.trainer_missing({"statsmodels": "z"}) is None
    res = gpu_check.check_dpsgd_step(None, {"dp-accounting": "y"})
    assert res == {"status": "skipped", "reason": gpu_check.trainer_missing({"dp-accounting": "y"})}


def test_without_opacus_and_dp_accounting_the_trainer_parts_skip_and_the_rest_runs(tmp_path):
    # the GPU machine lacks both unless their wheels are carried (docs/gpu.md): the check says so in one
    # line, skips the parts that build a DPSGDTrainer with the reason, and runs the others
    out = tmp_path / "gpu_check.json"
    hide = ("import runpy, sys\n"
            "for m in ('opacus', 'dp_accounting'):\n"
            "    sys.modules[m] = None\n"
            f"sys.argv = [{str(SCRIPT)!r}] + sys.argv[1:]\n"
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", hide, "--tiny", "--device", "cpu", "--out", str(out), "--sections",
                           "correctness.dpsgd_step", "correctness.checkpoint", "real_run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "missing: opacus" in proc.stdout and "dp-accounting" in proc.stdout.splitlines()[0]
    report = json.loads(out.read_text())
    assert set(report["missing"]) == {"opacus", "dp-accounting"}
    parts = report["sections"]["correctness"]["parts"]
    assert parts["dpsgd_step"]["status"] == "skipped" and "opacus and dp-accounting" in parts["dpsgd_step"]["reason"]
    assert parts["checkpoint"]["status"] == "pass"                     # the PixelDP half needs neither
    assert parts["checkpoint"]["dpsgd_trainer"]["status"] == "skipped"
    assert report["sections"]["real_run"]["status"] == "skipped"


def test_a_quick_check_never_overwrites_the_committed_result(tmp_path):
    """Issue 49.10: ``--tiny`` without ``--out`` wrote benchmarks/results/gpu_check.json (a GPU run's
    place); a full run on the CPU must not replace a GPU result either."""
    import torch

    from benchmarks.gpu_check import NAME, output_path

    cpu = torch.device("cpu")
    out, why = output_path(None, True, cpu, results=tmp_path)
    assert out.parent != tmp_path and why is None                       # tiny: the temporary folder
    assert output_path(None, False, cpu, results=tmp_path) == (tmp_path / f"{NAME}.json", None)  # nothing to keep
    (tmp_path / f"{NAME}.json").write_text(json.dumps({"device": "cuda:0 (NVIDIA H100)", "gpu": {"name": "H100"}}))
    out, why = output_path(None, False, cpu, results=tmp_path)
    assert out == tmp_path / f"{NAME}.cpu.json" and "holds a GPU run" in why
    # control: a GPU run replaces it, and an explicit --out is taken as given
    assert output_path(None, False, torch.device("cuda", 0), results=tmp_path)[0] == tmp_path / f"{NAME}.json"
    assert output_path(str(tmp_path / "x.json"), True, cpu, results=tmp_path)[0] == tmp_path / "x.json"
