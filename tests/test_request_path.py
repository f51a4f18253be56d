"""The request path stays short (DESIGN: one execution path): a streamed chat request, traced through
the gateway and an engine in one process (`python -m bench.request_path`), runs code in at most 20
product files, and the README lists exactly those."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_plain_chat_crosses_at_most_20_files_and_the_readme_lists_them():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "bench.request_path", "--draft", "none"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    files = re.findall(r"^\s*\d+\. `([^`]+)`$", out, flags=re.M)
    assert files and len(files) <= 20, files
    assert not {"deployments/tools.py", "deployments/token_channel.py"} & set(files)  # tools and direct tokens: opt-in
    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("20 files today"):]
    listed = re.findall(r"`([a-z_/]+\.py)`", listed[: listed.index("What each does")])
    assert sorted(listed) == sorted(files)
