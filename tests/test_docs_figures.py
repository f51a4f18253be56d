"""Measured numbers live in bench reports and the README, each with its command; comments say
why, never how fast (STYLE.md, habit 11: a timing in a comment goes stale silently).

README rule. The README is cut into blocks: a paragraph (lines between blank lines or
headings), a list item, a table; fenced code is left out. A *figure* is a number that reads
as a measurement: a ratio (`3.4x`, `0.89-1.00x`), a percentage (`91%`), anything in
tokens/s, or a duration (`12 ms`, `~45 s`, `1.7 s`). Numbers inside inline code are config
keys, flags or values, not figures, and sizes (MiB, GB) are not figures either: they are
properties of a model or a setting. A block that holds a figure must name where it is
reproduced: its bench command (`python -m bench.NAME`) or report (`bench/reports/NAME`),
or, for the demo models' own quality figures, their command (`python -m demo.NAME`) or
report (`checkpoints/TRAINING.md`). CONFIG_VALUES lists the few durations in prose
that are settings, not measurements. Every bench module, demo module and report the README
names must exist.

Source rule. Comments and docstrings of the source packages (and the Serve config and k8s
manifests generated from it) quote no measured speed: no ratio, no sub-second duration, no
approximate or ranged duration in seconds, no tokens/s figure, no "N% slower/faster".
CONFIG_VALUES lists the few durations there that are settings.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

_NUM = r"\d+(?:[.,]\d+)*"
_RANGE = rf"(?:~\s?)?{_NUM}(?:\s?[-–]\s?{_NUM})?"
FIGURE = re.compile(
    rf"(?<![\w.]){_RANGE}x\b"  # a ratio
    rf"|(?<![\w.]){_RANGE}\s?%"  # a percentage
    r"|\btokens/s\b"  # a rate
    rf"|(?<![\w.]){_RANGE}\s?(?:ms|us|µs|s|seconds?|minutes?|hours?)\b"  # a duration
)
SOURCE = re.compile(r"python -m (?:bench|demo)\.\w+|bench/reports/[\w.-]+|checkpoints/TRAINING\.md")
# Durations in README prose and in comments that are settings (defaults), not measurements.
CONFIG_VALUES = (
    "every 25 ms",  # engine.stream_interval_s, its default
    "every 200 ms",  # engine.stream_interval_max_s, its default
)

TIMING = re.compile(
    rf"(?<![\w.]){_RANGE}x\b"  # a ratio: "1.10x against 1.25x"
    rf"|(?<![\w.]){_RANGE}\s?(?:ms|us|µs)\b"  # a sub-second duration: "costs ~20 us"
    rf"|~\s?{_NUM}\s?(?:s|seconds?|minutes?)\b"  # an approximate duration: "~40 s"
    rf"|(?<![\w.]){_NUM}\s?[-–]\s?{_NUM}\s?(?:s|seconds?)\b"  # a ranged one: "4.5-5.5 s"
    rf"|{_NUM}\s?tokens/s\b"  # a rate
    rf"|{_RANGE}\s?%\s(?:slower|faster)"  # "10% slower"
)
SOURCE_DIRS = ("moeserve", "model_shards", "router_service", "deployments", "k8s")


def blocks(markdown: str) -> list[tuple[int, str]]:
    """(first line number, text) of every paragraph, list item and table; fenced code is skipped."""
    out: list[tuple[int, str]] = []
    current: list[str] = []
    start, fenced, in_table = 0, False, False

    def flush() -> None:
        if current:
            out.append((start, "\n".join(current)))
            current.clear()

    for number, line in enumerate(markdown.splitlines(), 1):
        if line.lstrip().startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        table = line.lstrip().startswith("|")
        item = re.match(r"\s*(?:[-*+]|\d+\.)\s", line) is not None
        if not line.strip() or line.startswith("#") or item or table != in_table:
            flush()
        in_table = table
        if line.strip() and not line.startswith("#"):
            if not current:
                start = number
            current.append(line)
    flush()
    return out


def figures(text: str, allowed: tuple[str, ...] = CONFIG_VALUES) -> list[str]:
    """The figures in a block of README text (inline code and allowed phrases left out)."""
    text = " ".join(text.split())
    for phrase in allowed:
        text = text.replace(phrase, " ")
    text = re.sub(r"`[^`\n]*`", " ", text)
    return [m.group(0).strip() for m in FIGURE.finditer(text)]


def unsourced(markdown: str) -> list[str]:
    """'line N: figures' for each block that has figures and names no bench command or report."""
    return [f"line {start}: {', '.join(found)}" for start, text in blocks(markdown)
            if (found := figures(text)) and not SOURCE.search(text)]


def comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and bare string statement (docstrings) of a .py file, or
    of every comment of a YAML file."""
    source = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        return [(n, line.split("#", 1)[1]) for n, line in enumerate(source.splitlines(), 1) if "#" in line]
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))
    return out


def timings(text: str) -> list[str]:
    """The measured timings a comment quotes (settings in CONFIG_VALUES left out)."""
    text = " ".join(text.split())
    for phrase in CONFIG_VALUES:
        text = text.replace(phrase, " ")
    return [m.group(0).strip() for m in TIMING.finditer(text)]


def _source_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*")
                  if p.suffix in (".py", ".yaml", ".yml") and "__pycache__" not in p.parts
                  and not p.name.endswith("_pb2.py") and not p.name.endswith("_pb2_grpc.py"))


def test_the_block_rule_flags_a_bare_figure_and_passes_a_sourced_or_configured_one():
    md = ("Intro.\n\nIt runs 3.4x faster\nat batch 1.\n\n- an item at 12 ms (`python -m bench.paged_kv`)\n"
          "- an item at 91%\n\n```\n5x in code\n```\n| a | 2.5x |\n|---|---|\nChunks go every 25 ms, `--seconds 30`.\n\n"
          "## Heading 7x\nSee `bench/reports/generation.md`: 1.6x.\n")
    assert unsourced(md) == ["line 3: 3.4x", "line 7: 91%", "line 12: 2.5x"]
    assert figures("Mixtral-8x7B, 16 MiB, W=2, a 2-core box, `stream_interval_s: 0.2`") == []
    assert figures("~45 s cold, 0.89-1.00x, 1,307 tokens/s, 7-17% slower") == ["~45 s", "0.89-1.00x", "tokens/s",
                                                                              "7-17%"]


def test_every_readme_figure_names_its_bench_command_or_report():
    bare = unsourced(README.read_text())
    assert not bare, ("README blocks with measured figures but no `python -m bench.NAME` or `bench/reports/NAME` "
                      "(add the command or report that reproduces them):\n" + "\n".join(bare))


def test_every_bench_command_and_report_the_readme_names_exists():
    text = README.read_text()
    modules = set(re.findall(r"python -m ((?:bench|demo)(?:\.\w+)+)", text))
    reports = {r.rstrip(".") for r in re.findall(r"bench/reports/[\w.-]+|checkpoints/TRAINING\.md", text)}
    assert {"bench.generation", "bench.speculative"} <= modules and "bench/reports/generation.md" in reports
    missing = [m for m in sorted(modules) if not (ROOT / (m.replace(".", "/") + ".py")).is_file()
               and not (ROOT / m.replace(".", "/") / "__init__.py").is_file()]
    missing += [r for r in sorted(reports) if not (ROOT / r).is_file()]
    assert not missing, f"README names bench modules or reports that do not exist: {missing}"


def test_the_comment_scan_finds_a_timing_and_spares_the_why(tmp_path):
    assert timings("a pass costs ~5 ms and a position ~20-30 us") == ["~5 ms", "~20-30 us"]
    assert timings("1.10x against 1.25x, side by side") == ["1.10x", "1.25x"]
    assert timings("sp_0 takes 4.5-5.5 s; ~40 s the first time; 3288 tokens/s; ran up to ~10% slower") == [
        "4.5-5.5 s", "~40 s", "3288 tokens/s", "~10% slower"]
    assert timings("every 25 ms, growing to every\n  200 ms; Serve's default: 30 s; Mixtral-8x7B; k + 1 times") == []
    source = '"""Doc: 2.8x slower."""\nX = 1  # costs ~20 us\nY = f"{n / dt:.1f} tokens/s"\n'
    (tmp_path / "probe.py").write_text(source)
    (tmp_path / "probe.yaml").write_text("a: 1  # every 25 ms; took 12 ms\nb: '3.4x'\n")
    assert [(n, timings(t)) for n, t in comments(tmp_path / "probe.py") if timings(t)] == [
        (2, ["~20 us"]), (1, ["2.8x"])]
    assert [(n, timings(t)) for n, t in comments(tmp_path / "probe.yaml") if timings(t)] == [(1, ["12 ms"])]


def test_source_comments_quote_no_measured_timings():
    files = _source_files()
    assert any(p.name == "serve_config.yaml" for p in files) and len(files) > 50
    found = [f"{p.relative_to(ROOT)}:{n}: {', '.join(t)}" for p in files for n, text in comments(p)
             if (t := timings(text))]
    assert not found, ("measured timings in comments go stale; say why instead and leave the number to a "
                       "bench report:\n" + "\n".join(found))
