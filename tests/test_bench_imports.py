"""Every benchmark script imports (they run for minutes, so CI only checks they are intact)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "bench").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", BENCH)
def test_bench_module_imports(name):
    module = importlib.import_module(f"bench.{name}")
    assert module.__doc__, f"bench/{name}.py needs a docstring saying how to run it"
