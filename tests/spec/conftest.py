"""Shared by the speculative-decoding tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every speculative-decoding module runs on one torch thread (tests/conftest.py)."""
