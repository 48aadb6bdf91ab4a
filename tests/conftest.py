"""Shared fixtures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    """pytest-xdist workers share the machine's cores: each worker's torch (and the processes it
    starts, through ``OMP_NUM_THREADS``) gets its share, at least one thread. Two workers on two
    cores each running two OpenMP threads spend much of their time waiting on each other's cores:
    measured 2026-12-07, four files of torch tests took 85 s that way and 56 s with a thread each.
    A value the user set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on a 2-core machine (CI's): one torch thread avoids oversubscription. The
    thread count is restored after the module, so other modules keep the default."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Seconds each test file took (calls, set-ups and tear-downs), measured on two workers of a 2-core machine:
# ``make test`` hands files to its two workers in the order below, the longest first, so the last file to
# start is a short one and neither worker waits long for the other at the end. Refresh it after adding a long
# file: DPSWEEP_TEST_COSTS=tests/file_costs.json make test
COSTS = Path(__file__).with_name("file_costs.json")
_measured: dict[str, float] = {}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items):
    """Files by their measured cost, the longest first, each file's tests in their order (``--dist
    loadfile``: a long file that starts last finishes last on one worker while the other waits). A file
    with no measurement yet goes with the long ones if it holds slow tests (end-to-end sweeps, real
    training), else with the short ones."""
    costs = json.loads(COSTS.read_text()) if COSTS.exists() else {}
    heavy = {_file(item.nodeid) for item in items if item.get_closest_marker("slow")}
    default = max(costs.values(), default=0.0)

    def cost(item) -> float:
        name = _file(item.nodeid)
        return costs.get(name, default if name in heavy else 0.0)

    items.sort(key=lambda item: -cost(item))


def pytest_runtest_logreport(report):
    if os.environ.get("DPSWEEP_TEST_COSTS"):
        _measured[_file(report.nodeid)] = _measured.get(_file(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """With DPSWEEP_TEST_COSTS=<path>, the files' measured seconds go there (the controller of an xdist
    run sees every worker's reports)."""
    target = os.environ.get("DPSWEEP_TEST_COSTS")
    if target and _measured and not hasattr(session.config, "workerinput"):
        ordered = dict(sorted(((k, round(v, 1)) for k, v in _measured.items()), key=lambda kv: -kv[1]))
        Path(target).write_text(json.dumps(ordered, indent=1) + "\n")
