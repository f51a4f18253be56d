"""Grammar-layer conformance and mask timings on JSONSchemaBench (all 254 schemas).

    python -m bench.grammar_conformance [--decodes 8] [--tokenizer checkpoints/demo-moe]
    python -m bench.grammar_conformance --schemastore [--one-of as_any_of]
    python -m bench.grammar_conformance --installed [--one-of as_any_of]
    python -m bench.grammar_conformance --cloudformation [--slice K] [--one-of as_any_of]

`--schemastore`: instead, the real-world SchemaStore schemas that check-jsonschema vendors (CI
configs, compose, dependabot, ...; the `bench` extra installs it); once held out, since tuned on.
`--installed`: schemas installed packages ship (`installed_cases`), held out until its first run
(12 of 57 refused; the README tells what was narrowed after). `--cloudformation`: every 20th of the
AWS CloudFormation resource schemas cfn-lint ships, from the `--slice`-th on (`pip install --no-deps cfn-lint`;
only its data is read). Slice 0 was held out until its first run (20 of 95 refused) and tuned on after;
slice 10 stayed held out until the tuning was done. `--one-of`: the `grammar.one_of` setting to compile with.

For each schema: compile it (or record the refusal and its feature), decode `--decodes` times
with a random model under the mask, judge each output with the oracle (json + jsonschema with
formats), and check the file's invalid test instances are refused by the grammar. Prints the
counts and writes bench/reports/grammar_conformance.{json,md}. Also times mask
fill (per decode step) and apply (per step, and on synthetic batches up to a 128k vocabulary),
and compile vs cache hit. Without --tokenizer it trains the tests' tiny byte-level BPE (~1 s).

Goal (DESIGN.md property 3): invalid outputs 0, errors 0; every refusal names its feature.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.conformance import check_case, conformance_dir, load_cases, summarize  # noqa: E402
from bench.report import write  # noqa: E402
from bench.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from moeserve.config import GrammarSection
from moeserve.grammar import GrammarCompiler, GrammarSpec, allocate_bitmask, apply_bitmask, apply_bitmask_torch  # noqa: E402


def main() -> None:
    args = parse_args()
    folder = Path("installed packages") if args.installed or args.cloudformation else schemastore_dir() if args.schemastore else \
        Path(args.data) if args.data else conformance_dir()
    if not (args.installed or args.cloudformation) and (folder is None or not folder.is_dir()):
        sys.exit("conformance data not found: pass --data or set MOESERVE_CONFORMANCE_DIR")
    tokenizer = load_tokenizer(args.tokenizer)
    compiler = GrammarCompiler(tokenizer, args.vocab_size, config=GrammarSection(one_of=args.one_of).grammar_config())
    cases = installed_cases() if args.installed else cloudformation_cases(start=args.slice) if args.cloudformation else schemastore_cases(folder) if args.schemastore else load_cases(folder)
    cases = cases[: args.limit]
    print(f"{len(cases)} schemas from {folder}; vocab {compiler.vocab_size}; {args.decodes} decodes each")

    started = time.perf_counter()
    results = []
    for i, case in enumerate(cases):
        result = check_case(compiler, tokenizer, case, decodes=args.decodes, seed=args.seed, max_tokens=args.max_tokens)
        results.append(result)
        if result.status == "error" or result.invalid or result.unsound or result.unterminated:
            print(f"  !! {case.name}: {result.status} {result.message} {result.invalid[:1]} {result.unsound[:1]}")
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(cases)} ({time.perf_counter() - started:.0f} s)")
    summary = summarize(results)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    summary["compile_ms"] = percentiles([r.compile_s * 1e3 for r in results if r.status == "compiled"], 1)
    summary["cache_hit_us"] = cache_hit_us(compiler, cases)
    summary["apply_us_synthetic"] = synthetic_apply_us()
    summary["refusal_examples"] = refusal_examples(results)

    rows = [
        {"name": r.name, "status": r.status, "feature": r.feature, "message": r.message, "valid": r.valid,
         "invalid": r.invalid, "unterminated": r.unterminated, "unsound": r.unsound, "compile_ms": round(r.compile_s * 1e3, 2)}
        for r in results
    ]  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "refusal_examples"}, indent=1))
    if not args.no_report:
        name = "grammar_conformance" + ("-installed" if args.installed else "-schemastore" if args.schemastore else
                                        "-cloudformation" + (f"-slice{args.slice}" if args.slice else "")
                                        if args.cloudformation else "") + (
            f"-{args.one_of}" if args.one_of != "exact" else "")
        path = write(name, {"summary": summary, "schemas": rows}, markdown(summary, folder, args))[1]
        print(f"wrote {path} and its .json")
    compiler.close()
    if summary["invalid_outputs"] or summary["errors"] or summary["unsound_instances"]:
        sys.exit(1)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="folder of JSONSchemaBench files (default: ../shared/conformance next to the repo)")
    p.add_argument("--tokenizer", help="transformers tokenizer folder (default: the tests' tiny BPE)")
    p.add_argument("--vocab-size", type=int, default=None, help="model vocab size (default: the tokenizer's)")
    p.add_argument("--decodes", type=int, default=8, help="random-model decodes per compiled schema")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="only the first N schemas")
    p.add_argument("--no-report", action="store_true", help="print only; do not rewrite bench/reports/")
    p.add_argument("--schemastore", action="store_true", help="the SchemaStore schemas (check-jsonschema's)")
    p.add_argument("--installed", action="store_true", help="schemas installed packages ship (installed_cases)")
    p.add_argument("--cloudformation", action="store_true", help="AWS CloudFormation resource schemas (cloudformation_cases)")
    p.add_argument("--slice", type=int, default=0, help="--cloudformation: the first of every 20 schemas to take")
    p.add_argument("--one-of", choices=("exact", "as_any_of"), default="exact", help="grammar.one_of")
    return p.parse_args()


def schemastore_dir() -> Path | None:
    try:
        from importlib.resources import files

        return Path(str(files("check_jsonschema.builtin_schemas") / "vendor"))
    except ImportError:
        sys.exit("--schemastore needs check-jsonschema (pip install -e '.[bench]')")


def schemastore_cases(folder: Path) -> list:
    """Each vendored schema as a case without test instances."""
    from bench.conformance import Case

    return [Case(path.stem, json.loads(path.read_text()), []) for path in sorted(folder.glob("*.json"))]


INSTALLED = [("jsonschema_specifications", f"schemas/{d}/metaschema.json") for d in ("draft4", "draft6", "draft7")] + [
    ("setuptools", "config/setuptools.schema.json"), ("setuptools", "config/distutils.schema.json"),
    ("schemathesis", "config/schema.json"), ("schemathesis", "wfc/schema.json"), ("ray", "autoscaler/ray-schema.json")]
K8S_SCHEMAS = "kubernetes-json-schema/v1.29.0-local-strict"
_K8S_REF = re.compile(r'"/api/_definitions\.json#/\$defs/|"#/\$defs/')


def installed_cases() -> list:
    """Schemas that installed packages ship (metaschemas, pyproject's, Schemathesis' and Ray's configs) and
    every 12th Kubernetes kind of kubernetes-validate's, its definitions bundled into it."""
    from importlib.resources import files

    from bench.conformance import Case

    cases = [Case(f"{package}/{path}", json.loads((files(package) / path).read_text()), []) for package, path in INSTALLED]
    folder = Path(str(files("kubernetes_validate") / K8S_SCHEMAS))
    definitions = json.loads((folder / "_definitions.json").read_text())["$defs"]
    kinds = [p for p in sorted(folder.glob("*.json")) if p.name not in ("_definitions.json", "all.json")]
    return cases + [Case(f"k8s/{p.stem}", _bundled(p.read_text(), definitions), []) for p in kinds[::12]]


def cloudformation_cases(every: int = 20, start: int = 0) -> list:
    """Every `every`-th AWS CloudFormation resource schema (by type name) cfn-lint ships, from the `start`-th;
    read as data, so cfn-lint's own dependencies need not be installed."""
    from importlib.metadata import PackageNotFoundError, distribution

    from bench.conformance import Case

    try:
        folder = Path(str(distribution("cfn-lint").locate_file("cfnlint/data/schemas/resources")))
    except PackageNotFoundError:
        sys.exit("--cloudformation needs cfn-lint's data: pip install --no-deps cfn-lint")
    schemas = sorted((json.loads(p.read_text()) for p in folder.glob("*.json")), key=lambda s: s["typeName"])
    return [Case(s["typeName"], s, []) for s in schemas[start::every]]


def _bundled(text: str, definitions: dict) -> dict:
    """A kubernetes-validate schema with the definitions it references (transitively) in its own $defs."""
    schema, defs = json.loads(_K8S_REF.sub('"#/$defs/', text)), {}
    need = re.findall(r'"#/\$defs/([^"]+)"', json.dumps(schema))
    while need:
        name = need.pop()
        if name not in defs:
            defs[name] = definitions[name]
            need += re.findall(r'"#/\$defs/([^"]+)"', json.dumps(defs[name]))
    return {**schema, "$defs": defs}


def load_tokenizer(path: str | None):
    if path is None:
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def percentiles(samples: list[float], digits: int = 1) -> dict:
    if len(samples) < 2:
        return {}
    q = statistics.quantiles(samples, n=100)
    return {"p50": round(q[49], digits), "p99": round(q[98], digits), "n": len(samples)}


def cache_hit_us(compiler: GrammarCompiler, cases) -> dict:
    samples = []
    for case in cases[:50]:
        spec = GrammarSpec.json_schema(case.schema)
        t0 = time.perf_counter()
        try:
            compiler.compile(spec)
        except Exception:  # noqa: BLE001,S112 - refusals are cached too; only the timing matters here
            pass
        samples.append((time.perf_counter() - t0) * 1e6)
    return percentiles(samples)


def synthetic_apply_us() -> dict:
    """apply_bitmask on random masks: the CPU kernel and the torch fallback, by batch and vocab."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 8):
        for vocab in (1024, 32768, 131072):
            bitmask = allocate_bitmask(batch, vocab)
            bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int32))
            logits = torch.randn(batch, vocab, generator=gen)
            for name, fn in (("kernel", apply_bitmask), ("torch", apply_bitmask_torch)):
                samples = []
                for _ in range(200):
                    work = logits.clone()
                    t0 = time.perf_counter()
                    fn(work, bitmask)
                    samples.append((time.perf_counter() - t0) * 1e6)
                out[f"{name} B={batch} V={vocab}"] = percentiles(samples)
    return out


def refusal_examples(results) -> dict:
    examples = defaultdict(list)
    for r in results:
        if r.status == "refused" and len(examples[r.feature]) < 2:
            examples[r.feature].append(f"{r.name}: {r.message}")
    return dict(examples)


def markdown(s: dict, folder: Path, args: argparse.Namespace) -> str:
    title = ("schemas installed packages ship (held out until its first run)" if args.installed else
             "SchemaStore schemas (check-jsonschema's vendored copies)" if args.schemastore else
             f"AWS CloudFormation resource schemas, every 20th from the {args.slice}th" if args.cloudformation else
             "JSONSchemaBench")
    lines = [
        f"# Grammar conformance: {title}",
        "",
        f"`grammar.one_of: {args.one_of}`. Data: `{folder.name}` ({s['schemas']} schemas). Random-model decodes per compiled schema: {args.decodes}, "
        f"max {args.max_tokens} tokens. Tokenizer: {args.tokenizer or 'tests tiny byte-level BPE (1000 tokens)'}.",
        "",
        "| schemas | compiled | refused (4xx) | errors | valid outputs | invalid outputs | unterminated | invalid test instances accepted | valid test instances refused |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {s['schemas']} | {s['compiled']} | {s['refused']} | {s['errors']} | {s['valid_outputs']} | {s['invalid_outputs']} "
        f"| {s['unterminated']} | {s['unsound_instances']} | {s['valid_instances_rejected']} |",
        "",
        f"Compiled by xgrammar: {s['compiled'] - s['compiled_by_llguidance']}; by llguidance (schemas the xgrammar "
        f"path refuses for a feature llguidance enforces exactly): {s['compiled_by_llguidance']}. "
        "Valid test instances refused are narrowings (fixed property order, strict mode, compact JSON), not errors.",
        "",
        "## Refused, by feature",
        "",
        "| feature | schemas | example |",
        "|---|---|---|",
    ]
    for feature, count in s["refused_by_feature"].items():
        example = s["refusal_examples"].get(feature, [""])[0].replace("|", "\\|")
        lines.append(f"| `{feature}` | {count} | {example[:160]} |")
    lines += [
        "",
        "## Timings (this machine)",
        "",
        f"- decode steps: {s['tokens']} tokens, {s['forced_tokens']} of them jump-forward "
        f"({100 * s['forced_tokens'] / max(1, s['tokens']):.0f}%)",
        f"- mask fill per step (us): {s['mask_fill_us']}",
        f"- mask apply per step (us): {s['mask_apply_us']}",
        f"- compile (ms): {s['compile_ms']}; cache hit (us): {s['cache_hit_us']}",
        "- apply on synthetic masks (us):",
    ]
    lines += [f"  - {k}: {v}" for k, v in s["apply_us_synthetic"].items()]
    lines += ["", f"Total {s['seconds']} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
