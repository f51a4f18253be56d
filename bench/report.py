"""Bench reports: JSON (every number) + Markdown (the tables) + PNG plots, in bench/reports/."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPORTS = Path(__file__).resolve().parent / "reports"


def environment(threads: int) -> dict[str, Any]:
    """What a reader needs to judge the numbers: versions, cores, threads, load at the start."""
    import torch
    import transformers

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "load_average_at_start": list(os.getloadavg()),
    }


def portable(setup: dict[str, Any]) -> dict[str, Any]:
    """The bench's settings with paths inside the repository made relative to it."""
    root = REPORTS.parent.parent
    out = {}
    for key, value in setup.items():
        if isinstance(value, str) and Path(value).is_absolute() and Path(value).is_relative_to(root):
            value = str(Path(value).relative_to(root))
        out[key] = value
    return out


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """Floats with 2 decimals; anything else as str() (a bench.timing.Ratio: its median and interval)."""
    def cell(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write(name: str, data: dict[str, Any], markdown: str, figures: dict[str, Any] | None = None) -> list[Path]:
    """Writes bench/reports/NAME.json, NAME.md and NAME-*.png; returns the paths."""
    REPORTS.mkdir(parents=True, exist_ok=True)
    data = {**data, "load_average_at_end": list(os.getloadavg())}
    paths = [REPORTS / f"{name}.json", REPORTS / f"{name}.md"]
    paths[0].write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    paths[1].write_text(markdown.rstrip() + "\n")
    for suffix, fig in (figures or {}).items():
        path = REPORTS / f"{name}-{suffix}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        paths.append(path)
    return paths


def _jsonable(value: Any) -> Any:
    """A bench.timing.Ratio as its dict (median, interval, rounds); other numbers (numpy, torch) as floats."""
    as_dict = getattr(value, "as_dict", None)
    return as_dict() if callable(as_dict) else float(value)
