"""JSONSchemaBench (254 real-world schemas): each one is refused with a named feature, or every
random-model output validates and every invalid test instance is refused by the grammar.

The full report with more decodes per schema is bench/grammar_conformance.py; this test runs
one decode per schema so it stays well under a minute. It skips only when the data folder
(`../shared/conformance/` beside the repo, or $MOESERVE_CONFORMANCE_DIR) is absent.
"""

from __future__ import annotations

import pytest

from bench.conformance import check_case, conformance_dir, load_cases, summarize

FOLDER = conformance_dir()
pytestmark = pytest.mark.skipif(FOLDER is None, reason="conformance data folder not found")


@pytest.fixture(scope="module")
def results(compiler, tokenizer):
    return [check_case(compiler, tokenizer, case, decodes=1, seed=7) for case in load_cases(FOLDER)]


def test_all_schemas_seen(results):
    assert len(results) == 254


def test_no_invalid_output_and_no_crash(results):
    summary = summarize(results)
    bad = [(r.name, r.status, r.message, r.invalid[:1], r.unsound[:1]) for r in results if r.status == "error" or r.invalid or r.unsound]
    assert summary["errors"] == 0 and summary["invalid_outputs"] == 0 and summary["unsound_instances"] == 0, bad[:5]
    assert summary["unterminated"] == 0, [r.name for r in results if r.unterminated]


def test_refusals_name_a_feature(results):
    for r in results:
        if r.status == "refused":
            assert r.feature and r.feature != "unknown" and len(r.message) > 10, (r.name, r.message)


def test_most_schemas_compile(results):
    # 217 of 254 compiled when this was written; a drop means a rewrite or a support check regressed.
    assert summarize(results)["compiled"] >= 205

