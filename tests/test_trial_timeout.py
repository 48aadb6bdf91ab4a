"""A hung trial (issue 49.4): a user model that blocks in its forward pass ran forever, with no warning
and no key for a time limit; a resume hung again. Now ``failure.trial_timeout`` stops an attempt
(trainables.watchdog: the reason on its run, TrialTimeout raised in the trial, the worker ended if it
is blocked in C), and the console says when a running trial has reported nothing for
``failure.silence_warning`` seconds (sweeps.watch)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from trainables.watchdog import TrialTimeout, TrialWatchdog


def _in_thread(body) -> dict:
    out: dict = {}

    def run():
        try:
            body(out)
        except BaseException as exc:  # noqa: BLE001
            out["raised"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


def test_a_trial_running_python_code_is_stopped_with_the_reason():
    seen = {"record": [], "close": 0, "exit": []}

    def busy(out):
        dog = TrialWatchdog(0.3, seen["record"].append, lambda: seen.__setitem__("close", seen["close"] + 1),
                            grace_s=5, exit_fn=seen["exit"].append).start()
        out["dog"] = dog
        try:
            while True:          # a Python loop: the asynchronous exception reaches it
                sum(range(100))
        finally:
            dog.stop()
    out = _in_thread(busy)
    out["thread"].join(10)
    assert isinstance(out.get("raised"), TrialTimeout) and "failure.trial_timeout (0.3 s)" in str(out["raised"])
    assert len(seen["record"]) == 1 and "0.3 s" in seen["record"][0]
    assert seen["close"] == 0 and seen["exit"] == []     # it stopped by itself: the process lives on


def test_a_trial_blocked_in_c_is_ended_after_the_grace():
    seen = {"record": [], "close": 0, "exit": []}
    release = threading.Event()

    def blocked(out):
        dog = TrialWatchdog(0.2, seen["record"].append, lambda: seen.__setitem__("close", seen["close"] + 1),
                            grace_s=0.3, exit_fn=lambda code: (seen["exit"].append(code), release.set()))
        dog.start()
        release.wait(30)         # blocked in C: no bytecode runs, the exception cannot arrive
        out["dog"] = dog
    out = _in_thread(blocked)
    assert release.wait(10)
    assert seen["record"] and seen["close"] == 1 and seen["exit"] == [70]


def test_control_a_trial_that_ends_in_time_is_left_alone():
    seen = []
    dog = TrialWatchdog(5, seen.append, lambda: seen.append("close"), exit_fn=seen.append).start()
    time.sleep(0.05)
    dog.stop()
    time.sleep(0.1)
    assert seen == [] and not dog.fired


# ---------------------------------------------------------------- the console


def _watch(**kw):
    from sweeps.watch import SilenceWatch

    now = [0.0]
    watch = SilenceWatch(clock=lambda: now[0], **kw)
    return watch, now


def test_a_quiet_trial_is_said_once_per_quiet_stretch(capsys, monkeypatch):
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    watch, now = _watch(silence_s=60, timeout_s=300)
    trial = SimpleNamespace(trial_id="t1", status="RUNNING")
    watch.on_trial_start(0, [trial], trial)
    now[0] = 59
    watch.on_step_end(0, [trial])
    assert capsys.readouterr().out == ""
    now[0] = 61
    watch.on_step_end(0, [trial])
    watch.on_step_end(0, [trial])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "t1 has reported nothing for 61 s" in lines[0] and "300 s" in lines[0]
    assert "busy" not in lines[0]
    watch.on_trial_result(0, [trial], trial, {})          # it spoke: a new stretch may be said again
    now[0] = 130
    watch.on_step_end(0, [trial])
    assert "has reported nothing for 69 s" in capsys.readouterr().out


def test_a_busy_machine_is_named_and_a_timeout_is_said(capsys, monkeypatch):
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (45.0, 45.0, 45.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    watch, now = _watch(silence_s=10)
    trial = SimpleNamespace(trial_id="t2", status="RUNNING")
    watch.on_trial_start(0, [trial], trial)
    now[0] = 11
    watch.on_step_end(0, [trial])
    out = capsys.readouterr().out
    assert "nothing will stop it" in out and "load 45 on 2 cores" in out and "niceness 15" in out
    watch, now = _watch(silence_s=10, timeout_s=20)
    watch.on_trial_start(0, [trial], trial)
    now[0] = 21
    watch.on_trial_error(0, [trial], trial)
    assert "t2 timed out" in capsys.readouterr().out


def test_the_spec_keys_are_checked():
    from sweeps.spec import SpecError, validate_spec

    base = {"name": "t", "common": {"train_size": 64, "test_size": 32, "certify_images": 0},
            "trainables": [{"name": "pixeldp", "search": {"epochs": 1}}]}
    spec = validate_spec({**base, "failure": {"trial_timeout": 600, "silence_warning": 120}})
    assert spec.failure.trial_timeout == 600 and spec.failure.silence_warning == 120
    for bad in (0, -5, ".inf"):
        with pytest.raises(SpecError, match="^failure.trial_timeout"):
            validate_spec({**base, "failure": {"trial_timeout": float(bad) if bad != ".inf" else float("inf")}})


HANG = '''
import os
import time
from torch import nn


class Hangs(nn.Module):
    """Blocks forever in its training forward pass (a hung user model)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        n = 1
        for s in input_shape:
            n *= s
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(n, num_classes))

    def forward(self, x):
        # in a trial's worker only: the driver's validation runs the model too (the per-example check)
        if self.training and "RAY_RAYLET_PID" in os.environ:
            time.sleep(3600)
        return self.net(x)


def net(input_shape, num_classes):
    return Hangs(input_shape, num_classes)
'''


@pytest.mark.slow
def test_a_hung_trial_through_dpsweep_run_is_failed_with_its_reason(tmp_path):
    """The issue's reproduction through the real entry point: the console says the trial went quiet,
    the attempt is stopped at its limit, its run is FAILED with TrialTimeout in dpsweep.error, exit 1."""
    import os
    import subprocess
    import sys

    import yaml

    from tests.test_sweep_e2e import ROOT, _runs

    (tmp_path / "hangpkg").mkdir()
    (tmp_path / "hangpkg" / "__init__.py").write_text("")
    (tmp_path / "hangpkg" / "nets.py").write_text(HANG)
    spec = tmp_path / "hang.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "hang", "storage": str(tmp_path / "ray_results"), "mlflow": {"experiment": "hang"},
        "common": {"dataset": "mnist", "train_size": 128, "test_size": 64, "epochs": 1},
        "trainables": [{"name": "dpsgd", "search": {"model": "hangpkg.nets:net", "epsilon": 8.0, "batch_size": 32}}],
        "resources": {"cpu": 1}, "failure": {"max_retries": 0, "trial_timeout": 12, "silence_warning": 5}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "sweeps.cli", "run", str(spec), "--tracking-uri", uri],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert time.monotonic() - t0 < 300
    assert "has reported nothing for" in done.stdout and "timed out" in done.stdout, out[-3000:]
    _, parents, children = _runs(uri, "hang")
    assert len(children) == 1 and children[0].info.status == "FAILED", out[-3000:]
    assert children[0].data.tags["dpsweep.error"].startswith("TrialTimeout: the trial ran past failure.trial_timeout")
