"""Test hook for tests/test_interrupts.py: holds a sweep at one moment so the test can interrupt
it there. Active only in processes started with ``DPSWEEP_TEST_HOOK=<moment>:<marker dir>`` and
this directory on PYTHONPATH (the driver and, through the environment Ray passes on, its trial
processes). When the moment comes, the process writes ``<marker dir>/<moment>-<pid>`` and sleeps
(``DPSWEEP_TEST_HOOK_SLEEP`` seconds, default 120): the interrupt finds it there.

moments: ``dataset`` (the driver prepares the data, before Ray or any MLflow run), ``epoch``
(inside a trial's first training epoch), ``evaluation`` (the trial evaluates after its last
epoch), ``final_log`` (the trial logs its final artifacts to MLflow), ``finished`` (the trial's
child run is FINISHED in MLflow, its final result not yet reported to Ray), ``completed`` (the
driver has been told a trial completed, before Tune's next experiment snapshot records it).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time

_HOOK = os.environ.get("DPSWEEP_TEST_HOOK", "")


def _hold(moment: str) -> None:
    marker_dir = _HOOK.split(":", 1)[1]
    with open(os.path.join(marker_dir, f"{moment}-{os.getpid()}"), "w") as f:
        f.write(moment)
    time.sleep(float(os.environ.get("DPSWEEP_TEST_HOOK_SLEEP", "120")))


def _before(fn, moment):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _hold(moment)
        return fn(*args, **kwargs)
    return wrapper


def _patch_data(module):
    module.ensure_available = _before(module.ensure_available, "dataset")


def _patch_pixeldp(module):
    cls = module.PixelDPMechanism
    cls.train_epoch = _before(cls.train_epoch, "epoch")


def _patch_runtime(module):
    module.evaluate = _before(module.evaluate, "evaluation")


def _patch_artifacts(module):
    module.log_final_artifacts = _before(module.log_final_artifacts, "final_log")


def _patch_tracking(module):
    finish = module.TrialTracker.finish

    @functools.wraps(finish)
    def finish_then_hold(self, status="FINISHED"):
        finish(self, status)
        if status == "FINISHED":
            _hold("finished")

    module.TrialTracker.finish = finish_then_hold


def _patch_runner(module):
    cls = module.CheckpointCleaner
    complete = cls.on_trial_complete

    @functools.wraps(complete)
    def complete_then_hold(self, *args, **kwargs):
        complete(self, *args, **kwargs)
        _hold("completed")

    cls.on_trial_complete = complete_then_hold


_PATCHES = {
    "dataset": ("dpmech.datasets.splits", _patch_data),
    "epoch": ("trainables.pixeldp", _patch_pixeldp),
    "evaluation": ("trainables.runtime", _patch_runtime),
    "final_log": ("trainables.artifacts", _patch_artifacts),
    "finished": ("trainables.tracking", _patch_tracking),
    "completed": ("sweeps.runner", _patch_runner),
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches one module right after it is executed."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


if _HOOK:
    _name, _patch = _PATCHES[_HOOK.split(":", 1)[0]]
    sys.meta_path.insert(0, _PatchOnImport(_name, _patch))
