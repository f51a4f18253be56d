"""JSONSchemaBench conformance: per schema, a clear refusal or only valid outputs.

Shared by tests/grammar/test_conformance.py (a sample) and bench/grammar_conformance.py (all
254). The data lives outside the repo, in `../shared/conformance/jsonschemabench/` next to the
repo root, or wherever $MOESERVE_CONFORMANCE_DIR points.

Per schema: compile; if refused, record the feature. Otherwise decode `decodes` times with a
random model and judge each output with the oracle, and feed each of the file's test
instances (compact JSON) to a fresh matcher: an instance marked invalid that the grammar
accepts is a soundness hole even if no random decode happened to hit it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.grammar_decoding import random_decode
from bench.oracle import check_output
from moeserve.grammar import GrammarCompiler, GrammarError, GrammarMatcher, GrammarSpec

CONFORMANCE_ENV = "MOESERVE_CONFORMANCE_DIR"


def conformance_dir() -> Path | None:
    """The jsonschemabench folder, or None when absent."""
    root = os.environ.get(CONFORMANCE_ENV)
    base = Path(root) if root else Path(__file__).resolve().parents[1].parent / "shared" / "conformance"
    folder = base / "jsonschemabench" if (base / "jsonschemabench").is_dir() else base
    return folder if folder.is_dir() and any(folder.glob("*.json")) else None


@dataclass
class Case:
    name: str
    schema: object
    tests: list[dict]


def load_cases(folder: Path) -> list[Case]:
    cases = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        cases.append(Case(path.stem, data["schema"], data.get("tests") or []))
    return cases


@dataclass
class SchemaResult:
    name: str
    status: str  # compiled | refused | error
    feature: str | None = None
    message: str = ""
    compile_s: float = 0.0
    backend: str | None = None  # which backend compiled it (xgrammar | llguidance)
    valid: int = 0
    invalid: list[str] = field(default_factory=list)  # "reason: text" per invalid output
    unterminated: int = 0
    tokens: int = 0
    forced: int = 0
    unsound: list[str] = field(default_factory=list)  # invalid instances the grammar accepts
    valid_rejected: int = 0  # valid instances the grammar refuses (narrowing; informational)
    fill_s: list[float] = field(default_factory=list)
    apply_s: list[float] = field(default_factory=list)


def check_case(compiler: GrammarCompiler, tokenizer, case: Case, *, decodes: int, seed: int, max_tokens: int = 2048) -> SchemaResult:
    spec = GrammarSpec.json_schema(case.schema)
    t0 = time.perf_counter()
    try:
        compiled = compiler.compile(spec)
    except GrammarError as e:
        return SchemaResult(case.name, "refused", e.feature or "unknown", e.message)
    except Exception as e:  # noqa: BLE001 - an unexpected exception is a bug to count, not to hide
        return SchemaResult(case.name, "error", type(e).__name__, f"compile: {e!r}")
    result = SchemaResult(case.name, "compiled", compile_s=time.perf_counter() - t0, backend=compiled.backend)
    try:
        for k in range(decodes):
            out = random_decode(compiler, compiled, tokenizer, seed=seed + k, max_tokens=max_tokens)
            result.tokens += len(out.token_ids)
            result.forced += out.forced
            result.fill_s += out.fill_s
            result.apply_s += out.apply_s
            if not out.terminated:
                result.unterminated += 1
                continue
            reason = check_output(spec, out.text)
            if reason is None and not out.utf8_ok:
                reason = "output bytes are not valid UTF-8"
            if reason is None and out.text != out.grammar_text:
                reason = "detokenized text differs from the bytes the grammar checked"
            if reason is None:
                result.valid += 1
            else:
                result.invalid.append(f"{reason}: {out.text[:300]!r}")
        for test in case.tests:
            instance = json.dumps(test["data"], separators=compiler.config.separators, ensure_ascii=False)
            ids = tokenizer.encode(instance, add_special_tokens=False)
            matcher = GrammarMatcher(compiled)
            accepted = matcher.accept_tokens(ids) == len(ids) and matcher.is_completed()
            if accepted and not test["valid"]:
                result.unsound.append(instance[:300])
            elif not accepted and test["valid"]:
                result.valid_rejected += 1
    except Exception as e:  # noqa: BLE001
        result.status = "error"
        result.message = f"decode: {e!r}"
    return result


def summarize(results: list[SchemaResult]) -> dict:
    """Counts for the report (and the assertions: invalid, unsound, errors must all be 0)."""
    fill = [t for r in results for t in r.fill_s]
    apply = [t for r in results for t in r.apply_s]
    return {
        "schemas": len(results),
        "compiled": sum(r.status == "compiled" for r in results),
        "compiled_by_llguidance": sum(r.backend == "llguidance" for r in results),
        "refused": sum(r.status == "refused" for r in results),
        "errors": sum(r.status == "error" for r in results),
        "valid_outputs": sum(r.valid for r in results),
        "invalid_outputs": sum(len(r.invalid) for r in results),
        "unterminated": sum(r.unterminated for r in results),
        "unsound_instances": sum(len(r.unsound) for r in results),
        "valid_instances_rejected": sum(r.valid_rejected for r in results),
        "tokens": sum(r.tokens for r in results),
        "forced_tokens": sum(r.forced for r in results),
        "refused_by_feature": dict(Counter(r.feature for r in results if r.status == "refused").most_common()),
        "mask_fill_us": _percentiles(fill),
        "mask_apply_us": _percentiles(apply),
    }


def _percentiles(samples: list[float]) -> dict:
    if len(samples) < 2:
        return {}
    q = statistics.quantiles([s * 1e6 for s in samples], n=100)
    return {"p50": round(q[49], 1), "p99": round(q[98], 1), "n": len(samples)}
