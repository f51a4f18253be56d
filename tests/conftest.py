"""Fixtures shared across the test folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Folders whose tests start Ray clusters, Serve apps or `moeserve serve` (Ray finds a cluster
# already running on the machine and joins it; Serve listens on fixed ports): under pytest-xdist
# (scripts/test.sh runs two workers) they all run on one worker, one after another.
ONE_AT_A_TIME = {"deployments", "k8s", "multinode"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.path).parent.name in ONE_AT_A_TIME:
            item.add_marker(pytest.mark.xdist_group("ray"))


if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core: a second torch thread would only contend
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests: tiny models gain nothing from a second OpenMP
    thread on a small shared machine, and the bitwise comparisons between a shard group (whose
    ranks run one thread each) and a single process must not depend on threading."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
