"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch


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
