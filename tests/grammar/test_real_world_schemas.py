"""Real-world schemas beside JSONSchemaBench: SchemaStore's (check-jsonschema vendors them, the `bench`
extra installs it) and the held-out set installed packages ship (`bench.grammar_conformance.installed_cases`):
each compiles or is refused with a named feature, and every random-model output validates."""

from __future__ import annotations

import pytest

from bench.conformance import check_case, summarize


@pytest.fixture(scope="module")
def real_world(compiler, tokenizer):
    """The SchemaStore schemas check-jsonschema vendors and the held-out schemas installed packages ship."""
    from bench.grammar_conformance import installed_cases, schemastore_cases, schemastore_dir

    sets = {"schemastore": schemastore_cases(schemastore_dir()), "installed": installed_cases()}
    return {name: [check_case(compiler, tokenizer, case, decodes=1, seed=7) for case in cases] for name, cases in sets.items()}


def test_real_world_schemas_compile_and_every_output_validates(real_world):
    for name, results in real_world.items():
        summary = summarize(results)
        bad = [(r.name, r.status, r.message, r.invalid[:1]) for r in results if r.status == "error" or r.invalid]
        assert summary["errors"] == 0 and summary["invalid_outputs"] == 0, (name, bad[:3])
    # 20 of 26 and 52 of 57 compiled when this was written (bench/reports/grammar_conformance-*.md)
    assert summarize(real_world["schemastore"])["compiled"] >= 20
    assert summarize(real_world["installed"])["compiled"] >= 52
