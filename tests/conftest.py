"""Shared fixtures."""

from __future__ import annotations

import os

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


def pytest_collection_modifyitems(session, config, items):
    """Files that hold slow tests (end-to-end sweeps, real training) first, each file's tests in
    their order: ``make test`` runs the suite on two pytest-xdist workers a file at a time
    (``--dist loadfile``), and a long file that starts last finishes last on one worker while the
    other waits."""
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: 0 if item.path in heavy else 1)
