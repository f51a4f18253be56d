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


def test_the_gpu_bench_runs_its_smoke_shape_on_the_cpu(tmp_path, monkeypatch):
    """bench/gpu.py is for GPU machines; its --smoke shape runs the same code on the CPU."""
    from bench import gpu, report

    monkeypatch.setattr(report, "REPORTS", tmp_path)
    assert gpu.main(["--smoke", "--no-compile"]) == 0
    md = (tmp_path / "gpu-smoke.md").read_text()
    assert "| eager | 1 |" in md and "| eager | 4 |" in md
