"""Fixtures shared across the test folders."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests: tiny models gain nothing from a second OpenMP
    thread on a small shared machine, and the bitwise comparisons between a shard group (whose
    ranks run one thread each) and a single process must not depend on threading."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
