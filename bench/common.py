"""Shared bits of the benchmark scripts: report writing and medians."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch

REPORTS = Path(__file__).resolve().parent / "reports"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine()}


def write_report(name: str, data: dict, markdown: str) -> Path:
    """Writes bench/reports/NAME.json and NAME.md; returns the Markdown path."""
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / f"{name}.json").write_text(json.dumps(data | {"machine": machine()}, indent=2))
    md = REPORTS / f"{name}.md"
    md.write_text(markdown)
    return md
