"""A sweep never claims success it did not have (issue 24, points 10 and 11).

Point 10: SIGINT or SIGTERM at any moment (before Ray, before the first trial, inside the first
epoch, during the final MLflow log, after the trials closed their runs; once or twice) exits 130 or
143 (the first signal's), the parent run KILLED, no child run left RUNNING, no trial process left to
touch one, the resume command printed, and resume finishes the sweep without logging anything twice.
(The evaluation after the last epoch, a moment with the trials' runs open like the first epoch, was
a case of its own until 2026-12-07; the hook still offers it.) Point 11: each sweep its own
directory; one definition of "finished" (the trial's final result / its FINISHED child run) for the
console count, the interrupt line and ``resume``, which never runs a trial MLflow already has
FINISHED.

The end-to-end tests run ``dpsweep run`` as a subprocess on tiny PixelDP trials; a test hook
(``tests/interrupt_hooks/sitecustomize.py``) holds the driver or the trials at the moment to
interrupt and leaves a marker file naming the process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.test_sweep_e2e import ROOT, _runs, _spec

HOOKS = Path(__file__).resolve().parent / "interrupt_hooks"


# --------------------------------------------------------------------------- unit: no Ray


def _trial(trial_id: str, status: str, evaluated: bool | None):
    last = {} if evaluated is None else ({"evaluated": 1.0, "acc_clean": 0.5} if evaluated else {"epoch": 1})
    return SimpleNamespace(trial_id=trial_id, status=status, last_result=last, config={}, local_path="/x")


def _results(trials):
    return SimpleNamespace(_experiment_analysis=SimpleNamespace(trials=trials))


def test_trials_ray_calls_terminated_without_a_final_result_are_not_finished():
    """Ray's clean-up after an interrupt marks the running trials TERMINATED: without their final
    result they are unfinished (the bug: both counted as done, exit 0)."""
    from sweeps.cli import _unfinished

    stopped = _results([_trial("a", "TERMINATED", False), _trial("b", "TERMINATED", None)])
    assert _unfinished(stopped, 2) == (2, 0)
    assert _unfinished(stopped, 2, interrupted=True, early_stops=True) == (2, 0)
    # a scheduler stops trials for good before their evaluation: complete, not finished
    assert _unfinished(stopped, 2, early_stops=True) == (0, 0)
    mixed = _results([_trial("a", "TERMINATED", True), _trial("b", "RUNNING", False), _trial("c", "ERROR", None)])
    assert _unfinished(mixed, 5) == (1 + 2, 1)  # b, and two trials never created
    # finished in MLflow though Ray never had its final result: finished (resume will not run it)
    assert _unfinished(mixed, 3, finished_ids={"b"}) == (0, 2)


class _StoppedTuner:
    """fit() as Ray returns it after a signal before any trial reported: every trial TERMINATED."""

    def fit(self):
        return _results([_trial("a", "TERMINATED", None), _trial("b", "TERMINATED", None)])


def test_a_sweep_whose_trials_never_reported_is_interrupted_not_successful(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from sweeps.cli import _fit_and_finish
    from sweeps.spec import validate_spec
    from sweeps.tracking import start_parent_run
    from trainables.tracking import TrialTracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = validate_spec({"name": "nr", "trainables": [{"name": "pixeldp"}]})
    info = start_parent_run(uri, "nr", "sweep", spec.raw, {})
    child = TrialTracker.open(info, trial_id="a", trial_name="a", trainable="pixeldp")
    assert _fit_and_finish(_StoppedTuner(), info, str(tmp_path / "exp"), uri, spec, 2) == 130
    err = capsys.readouterr().err
    assert "0 of 2 trials finished" in err and f"resume {tmp_path / 'exp'}" in err
    client = MlflowClient(uri)
    assert client.get_run(info["parent_run_id"]).info.status == "KILLED"
    assert client.get_run(child.run_id).info.status == "KILLED"


def test_progress_count_is_of_finished_trials_among_all_trials(capsys):
    """The [k/N] count comes from the trials' final results, not from a counter that a resumed
    sweep restores stale; a trial a scheduler stopped is not counted as finished."""
    from sweeps.runner import ProgressPrinter

    printer = ProgressPrinter(total=3)
    printer.done = 7  # as restored from an older experiment state
    trials = [_trial("a", "TERMINATED", True), _trial("b", "TERMINATED", True), _trial("c", "RUNNING", False)]
    printer.on_trial_complete(0, trials, trials[1])
    printer.on_trial_complete(0, trials, trials[2])
    out = capsys.readouterr().out.splitlines()
    assert "finished b [2/3] acc_clean 0.5000" in out[0]
    assert "stopped  c by the scheduler after epoch 1" in out[1] and "[" not in out[1].split("]", 1)[1]


def test_two_sweeps_with_one_name_in_one_second_get_their_own_directories(tmp_path, monkeypatch):
    import secrets

    from sweeps.runner import unique_run_name

    storage = str(tmp_path / "ray_results")
    names = [unique_run_name("same", storage) for _ in range(5)]  # well within one second
    assert len(set(names)) == 5 and all((tmp_path / "ray_results" / n).is_dir() for n in names)
    stamp = names[0].split("-")[1:3]
    assert len(stamp[0]) == 8 and len(stamp[1]) == 6 and len(names[0].split("-")[3]) == 6
    # the same second and the same random part drawn twice: the taken name is skipped, never shared
    import datetime

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2001, 1, 2, 3, 4, 5)

    monkeypatch.setattr(datetime, "datetime", Frozen)
    draws = iter(["aaaaaa", "aaaaaa", "bbbbbb", "cccccc"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(draws))
    assert unique_run_name("same", storage) == "same-20010102-030405-aaaaaa"
    assert unique_run_name("same", storage) == "same-20010102-030405-bbbbbb"
    assert unique_run_name("same", "s3://bucket/x") == "same-20010102-030405-cccccc"  # remote: nothing created
    assert sorted(p.name for p in (tmp_path / "ray_results").iterdir() if p.name.startswith("same-2001")) == [
        "same-20010102-030405-aaaaaa", "same-20010102-030405-bbbbbb"]


def test_signal_handler_one_path_for_sigint_and_sigterm():
    from sweeps.signals import Interrupts

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR1)
    tune_stops = []

    def tune_handler(signum, frame):  # what Tune installs in fit() for its graceful stop
        tune_stops.append(signum)

    # outside the graceful part a signal raises at once; SIGTERM exits 143
    with Interrupts() as it:
        assert os.environ["TUNE_DISABLE_SIGINT_HANDLER"] == "1"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        assert (it.exit_code, it.name) == (143, "SIGTERM")
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT),
            signal.getsignal(signal.SIGUSR1)) == before
    assert "TUNE_DISABLE_SIGINT_HANDLER" not in os.environ

    # inside it: the first signal goes to Tune's graceful stop, the second raises
    with Interrupts() as it, it.graceful():
        signal.signal(signal.SIGUSR1, tune_handler)
        signal.raise_signal(signal.SIGINT)
        assert tune_stops == [signal.SIGUSR1] and it.interrupted and it.exit_code == 130
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)

    # a signal before Tune has its handler waits for Tune's loop (ForwardInterrupt)
    tune_stops.clear()
    with Interrupts() as it, it.graceful():
        signal.raise_signal(signal.SIGTERM)
        assert tune_stops == [] and not it.forward()
        signal.signal(signal.SIGUSR1, tune_handler)
        from sweeps.runner import ForwardInterrupt

        ForwardInterrupt().on_step_begin(0, [])
        assert tune_stops == [signal.SIGUSR1] and it.exit_code == 143
        assert not it.forward()  # once

    # while the end is being recorded, one signal is only remembered; a second gives up
    with Interrupts() as it, it.shield():
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    signal.signal(signal.SIGUSR1, before[2])


# --------------------------------------------------------------------------- end to end: dpsweep run


class _Sweep:
    """``dpsweep run`` (or ``resume``) in a subprocess, its output collected by a thread."""

    def __init__(self, tmp_path: Path, argv: list[str], hook: str | None = None):
        self.markers = tmp_path / "markers"
        self.markers.mkdir(exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOKS), str(ROOT)]), "OMP_NUM_THREADS": "1"}
        env.pop("DPSWEEP_TEST_HOOK", None)
        if hook:
            env["DPSWEEP_TEST_HOOK"] = f"{hook}:{self.markers}"
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "sweeps.cli", *argv], cwd=tmp_path, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, ready, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while not ready():
            if self.proc.poll() is not None or time.time() > deadline:
                self.proc.kill()
                pytest.fail(f"the moment to interrupt never came (exit {self.proc.poll()}):\n{self.out}")
            time.sleep(0.1)

    def marked(self, moment: str) -> list[int]:
        """The processes that reached ``moment`` (the hook's marker files)."""
        return [int(p.name.rsplit("-", 1)[1]) for p in self.markers.glob(f"{moment}-*")]

    def finish(self, timeout: float = 240) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"dpsweep did not exit {timeout:g} s after the interrupt:\n{self.out}")
        self.reader.join(10)
        return rc


def _tiny_spec(tmp_path: Path, name: str) -> Path:
    spec = _spec(tmp_path, name, [0.5, 1.0])  # two trials side by side (max_concurrent_trials 2)
    raw = yaml.safe_load(spec.read_text())
    raw["common"].update({"train_size": 200, "epochs": 1})
    spec.write_text(yaml.safe_dump(raw))
    return spec


def _alive(pid: int) -> bool:
    """The process runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _still_running(pids, timeout: float = 30.0) -> list[int]:
    """The processes of ``pids`` still running after up to ``timeout`` seconds: Ray ends a stopped
    trial's worker process asynchronously, in under a second on a quiet machine and in several on a
    loaded one, so the test waits for them to end instead of sampling once."""
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _assert_interrupted(sweep: _Sweep, rc: int, expected_rc: int, tmp_path: Path, name: str, uri: str,
                        trial_pids: list[int] = ()):
    out = sweep.out
    assert rc == expected_rc, out
    exp_dirs = [p for p in (tmp_path / "ray_results").iterdir() if p.is_dir()]
    assert len(exp_dirs) == 1, out
    assert "continue with: " in out and f"resume {exp_dirs[0]}" in out, out
    assert "Traceback" not in out, out
    assert "Tuner.restore" not in out and "TensorBoard" not in out, out  # Ray's own hints stay off
    client, parents, children = _runs(uri, name)
    assert len(parents) == 1 and parents[0].info.status == "KILLED", out
    assert "resume" in parents[0].data.tags["dpsweep.interrupted"]
    assert [r.info.run_name for r in children if r.info.status == "RUNNING"] == [], out
    # no trial process is left that could set its run RUNNING again (and none did before it ended)
    assert _still_running(trial_pids) == []
    assert all(r.info.status != "RUNNING" for r in _runs(uri, name)[2])
    return exp_dirs[0], children


slow = pytest.mark.slow  # the end-to-end tests below (Ray, subprocesses)


@slow
def test_sigint_before_ray_and_any_mlflow_run_records_nothing(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sweep = _Sweep(tmp_path, ["run", str(_tiny_spec(tmp_path, "early")), "--tracking-uri", uri], hook="dataset")
    sweep.wait_for(lambda: sweep.marked("dataset"))
    sweep.proc.send_signal(signal.SIGINT)
    rc = sweep.finish(60)
    assert rc == 130, sweep.out
    assert "interrupted (SIGINT) before the sweep started" in sweep.out and "Traceback" not in sweep.out
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(uri).get_experiment_by_name("early")
    assert exp is None or MlflowClient(uri).search_runs([exp.experiment_id]) == []
    assert not (tmp_path / "ray_results").exists() or not any((tmp_path / "ray_results").iterdir())


@slow
@pytest.mark.parametrize("moment, signals, expected_rc", [
    ("before_first_trial", [signal.SIGTERM], 143),
    ("epoch", [signal.SIGINT], 130),                  # the case: both trials inside their first epoch
    # a second signal while Ray stops the trials, the first a SIGTERM (the exit code is the first's);
    # the evaluation after the last epoch is the same as any moment with the trials' runs open
    ("final_log", [signal.SIGTERM, signal.SIGINT], 143),
])
def test_an_interrupt_at_any_moment_kills_the_parent_and_says_how_to_resume(tmp_path, moment, signals, expected_rc):
    name = f"int-{moment.replace('_', '-')}"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    hook = None if moment == "before_first_trial" else moment
    sweep = _Sweep(tmp_path, ["run", str(_tiny_spec(tmp_path, name)), "--tracking-uri", uri], hook=hook)
    if hook is None:  # the parent run exists, no trial has started
        sweep.wait_for(lambda: any(line.startswith("experiment ") for line in sweep.lines))
    else:
        sweep.wait_for(lambda: sweep.marked(moment))
    for sig in signals:
        sweep.proc.send_signal(sig)
        time.sleep(1.0)
    rc = sweep.finish()
    exp_dir, children = _assert_interrupted(sweep, rc, expected_rc, tmp_path, name, uri, sweep.marked(moment))
    assert f"interrupted ({signal.Signals(signals[0]).name}): 0 of 2 trials finished" in sweep.out
    if hook is not None:  # the trials were inside: their runs ended KILLED
        assert children and all(r.info.status == "KILLED" for r in children)
    if moment == "epoch":  # the case goes on: resume finishes both, nothing logged twice
        _resume_finishes_each_trial_once(tmp_path, exp_dir, uri, name)


def _resume_finishes_each_trial_once(tmp_path: Path, exp_dir: Path, uri: str, name: str) -> None:
    """``dpsweep resume`` of an interrupted sweep: exit 0, the parent FINISHED, one FINISHED run per
    trial (the KILLED ones reopened, not duplicated), each epoch's metrics and each final metric logged
    once, every trial certified, no checkpoint left (a resume from a mid-trial checkpoint, with
    per-epoch steps, is test_cluster_faults.py's killed-driver test)."""
    resumed = _Sweep(tmp_path, ["resume", str(exp_dir)])
    assert resumed.finish(300) == 0, resumed.out
    client, parents, children = _runs(uri, name)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    epochs = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())["common"]["epochs"]
    for run in children:
        for key in ("train_loss", "test_acc"):
            assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == list(
                range(1, epochs + 1)), (run.info.run_name, key)
        assert [m.step for m in client.get_metric_history(run.info.run_id, "acc_clean")] == [epochs]
        assert "cert_acc_0.1" in run.data.metrics       # the resumed trials reach their certification
    assert sorted(exp_dir.glob("*/checkpoint_*")) == []  # finished trials' checkpoints are gone


@slow
def test_resume_never_reruns_a_trial_mlflow_has_finished(tmp_path):
    """SIGTERM after both trials closed their child runs FINISHED but before Ray had their final
    results: the interrupt line, MLflow and resume agree that 2 of 2 finished; resume reports them
    from MLflow without training or logging anything again."""
    name = "int-finished"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sweep = _Sweep(tmp_path, ["run", str(_tiny_spec(tmp_path, name)), "--tracking-uri", uri], hook="finished")
    sweep.wait_for(lambda: len(sweep.marked("finished")) == 2)
    sweep.proc.send_signal(signal.SIGTERM)
    rc = sweep.finish()
    exp_dir, children = _assert_interrupted(sweep, rc, 143, tmp_path, name, uri, sweep.marked("finished"))
    assert "interrupted (SIGTERM): 2 of 2 trials finished" in sweep.out
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    client = _runs(uri, name)[0]
    before = {r.info.run_id: (r.info.end_time, [(m.value, m.timestamp) for m in
                                                client.get_metric_history(r.info.run_id, "acc_clean")])
              for r in children}

    resumed = _Sweep(tmp_path, ["resume", str(exp_dir)])
    assert resumed.finish(300) == 0, resumed.out
    assert " progress " not in resumed.out  # nothing trained again
    assert resumed.out.count(" DONE") == 2 and "[2/2]" in resumed.out, resumed.out
    client, parents, children = _runs(uri, name)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    after = {r.info.run_id: (r.info.end_time, [(m.value, m.timestamp) for m in
                                               client.get_metric_history(r.info.run_id, "acc_clean")])
             for r in children}
    assert after == before  # not reopened, nothing logged again
