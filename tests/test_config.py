"""The one config tree: the YAML, the CLI flags and `LLM(...)` with the same settings build the same
tree, every component's defaults are the tree's, and relative paths resolve beside the file."""

from __future__ import annotations

import re

import pytest
import torch

from deployments.cli import build_parser, serve_config
from moeserve.config import AppConfig, EngineSection, SpeculativeSection, resolve_path
from moeserve.engine.factory import draft_path, kv_blocks, model_path, scheduler_config, speculation

SETTINGS_YAML = """
model:
  path: checkpoints/demo-moe
engine:
  max_num_seqs: 8
  max_model_len: 512
  kv_cache_memory: 4MiB
speculative:
  draft: none
"""


def test_yaml_cli_and_llm_options_give_the_same_config(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text(SETTINGS_YAML)
    from_yaml = AppConfig.load(path)
    args = build_parser().parse_args(["serve", "--model", "checkpoints/demo-moe", "--draft", "none",
                                      "--max-num-seqs", "8", "--max-model-len", "512",
                                      "--kv-cache-memory", "4MiB"])
    from_cli = serve_config(args)
    from_llm = AppConfig.from_options("checkpoints/demo-moe", "none", max_num_seqs=8, max_model_len=512,
                                      kv_cache_memory="4MiB")
    assert from_yaml.model_dump() == from_cli.model_dump() == from_llm.model_dump()
    assert from_yaml == from_cli == from_llm
    assert (from_yaml.engine.max_num_seqs, from_yaml.engine.kv_cache_memory) == (8, 4 * 2**20)


def test_every_component_default_is_the_trees():
    tree = AppConfig()
    scheduler = scheduler_config(tree)  # the one component config derived from the tree: its limits are the tree's
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (
        EngineSection.model_fields["max_num_seqs"].default, EngineSection.model_fields["max_num_batched_tokens"].default)
    assert tree.speculative.disable_by_batch_size == SpeculativeSection.model_fields["disable_by_batch_size"].default
    import inspect

    from deployments.engine_server import EngineServer

    # the engine replica has no config copy of its own to disagree: it reads the tree's sections
    assert inspect.signature(EngineServer).parameters["config"].annotation == "AppConfig"


def test_the_shipped_yaml_states_the_defaults():
    """deployments/serve_config.yaml spells out the engine settings; they are the tree's defaults
    (`LLM()` and `moeserve serve` with no file run the same engine)."""
    from moeserve.config import PROJECT_ROOT

    shipped = AppConfig.load(PROJECT_ROOT / "deployments" / "serve_config.yaml")
    assert shipped.engine == AppConfig().engine and shipped.speculative == AppConfig().speculative
    assert scheduler_config(shipped) == scheduler_config(AppConfig())


def test_the_json_style_reaches_the_grammar_compiler():
    from moeserve.engine.core_client import build_core

    compact = AppConfig.from_dict({"grammar": {"json_style": "compact", "max_spec_chars": 4096},
                                   "speculative": {"draft": "none"}})
    grammar = compact.grammar.grammar_config()
    assert (grammar.separators, grammar.max_spec_chars) == ((",", ":"), 4096)
    # the default: spaced, as the demo pair writes
    assert AppConfig().grammar.grammar_config().separators == (", ", ": ")
    threads = torch.get_num_threads()  # build_core sets the core process's threads
    try:
        core = build_core((compact, 1))
    finally:
        torch.set_num_threads(threads)
    assert core.compiler.config == grammar


def test_relative_paths_resolve_beside_the_file_first(tmp_path):
    (tmp_path / "my-model").mkdir()
    path = tmp_path / "app.yaml"
    path.write_text("model:\n  path: my-model\n")
    assert AppConfig.load(path).model.path == str(tmp_path / "my-model")
    default = model_path(AppConfig())
    assert default == resolve_path("checkpoints/demo-moe") and default.endswith("checkpoints/demo-moe")


def test_unknown_options_are_refused_by_name():
    with pytest.raises(ValueError, match="max_num_seq: not an engine option"):
        AppConfig.from_options(max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        AppConfig.from_options(max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_budget_tokens: 100 cannot hold one sequence"):
        AppConfig.from_options(kv_budget_tokens=100, max_model_len=512)
    with pytest.raises(ValueError, match="draft_path is not set"):
        speculation(AppConfig.from_dict({"speculative": {"draft": "model", "draft_path": None}}))
    with pytest.raises(ValueError, match="min_shards <= num_shards <= max_shards, got 3, 2, None"):
        AppConfig.from_dict({"shards": {"num_shards": 2, "min_shards": 3}})
    with pytest.raises(ValueError, match="second home for every expert needs num_shards >= 2"):
        AppConfig.from_dict({"shards": {"redundancy": 1}})


def test_moeserve_generate_runs_on_the_demo_pair():
    """`moeserve generate` (scripts/run.sh generate ...) builds its engine through LLM(...) and streams a reply."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "deployments.cli", "generate", "Do you have rye bread?", "--max-tokens",
                          "6", "--draft", "ngram", "--num-spec-tokens", "3", "-v"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "tokens/s; speculation=ngram" in out.stderr


def test_moeserve_generate_constrains_the_reply_to_a_schema_or_a_regex(tmp_path):
    """`--json-schema FILE` and `--regex`: the streamed reply is valid; a bad regex is a clear error (exit 2)."""
    import json
    import subprocess
    import sys

    import jsonschema

    schema = {"type": "object", "properties": {"bread": {"enum": ["rye", "spelt"]}, "loaves": {"type": "integer"}},
              "required": ["bread", "loaves"], "additionalProperties": False}
    (tmp_path / "order.json").write_text(json.dumps(schema))

    def generate(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deployments.cli", "generate", "Two rye loaves, please.",
                               "--max-tokens", "48", "--draft", "none", *flags], capture_output=True, text=True,
                              timeout=300)

    out = generate("--json-schema", str(tmp_path / "order.json"))
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), schema)
    out = generate("--regex", "(yes|no), [a-z ]{1,20}")
    assert out.returncode == 0 and re.fullmatch("(yes|no), [a-z ]{1,20}", out.stdout.strip()), out
    out = generate("--regex", "([")
    assert out.returncode == 2 and "error: invalid regex" in out.stderr, out.stderr


def test_the_overflow_policy_set_in_the_yaml_reaches_every_moe_layer_and_metrics():
    from moeserve.engine.core import EngineCore
    from moeserve.engine.factory import build_engine

    tree = AppConfig.from_dict({"routing": {"overflow": "drop", "capacity_factor": 1.0}, "speculative": {"draft": "none"}})
    assert (tree.routing.overflow, tree.routing.capacity_factor, tree.routing.min_capacity) == ("drop", 1.0, 4)
    engine = build_engine(tree)
    assert {b.routing for b in engine.runner.model.moe_blocks} == {tree.routing}
    gauges = EngineCore(engine).stats()["routing"]
    assert gauges["overflow_drop"] == 1.0 and gauges["overflow_none"] == 0.0 and gauges["capacity_factor"] == 1.0


def test_the_kv_budget_in_bytes_and_the_paged_cache_reach_the_engine():
    from moeserve.engine.llm import LLM

    memory = [AppConfig.from_options(kv_cache_memory=v).engine.kv_cache_memory for v in (2048, "2048", "512MiB", "2 GiB", "1.5GB")]
    assert memory == [2048, 2048, 2**29, 2**31, 15 * 10**8]
    for bad in ("lots", -5):
        with pytest.raises(ValueError, match="kv_cache_memory\n  could not parse value and unit from byte string"):
            AppConfig.from_options(kv_cache_memory=bad)
    with pytest.raises(ValueError, match="not both"):
        AppConfig.from_dict({"engine": {"kv_cache_memory": "8MiB", "kv_budget_tokens": 4096}})
    tree = AppConfig.from_dict({"engine": {"kv_cache_memory": "8MiB"}})
    # demo MoE: 4 layers x 2 kv heads x head dim 32 x (key + value) x 4 bytes = 2 KiB per token, 32 KiB a block
    assert kv_blocks(tree) == 256 and scheduler_config(tree).kv_budget == 255 * 16
    llm = LLM(draft="none", kv_cache_memory="8MiB", prefix_caching=False, block_size=32)
    runner = llm.engine.runner
    assert (runner.blocks.num_blocks, runner.block_size, runner.prefix_caching) == (128, 32, False)
    assert runner.cache.nbytes == 8 * 2**20  # the whole budget, the scratch block included, allocated at start
    assert llm.engine.scheduler.cfg.kv_budget == 127 * 32
    # the cache is always paged: the setting that chose another is gone, and saying so is an error
    with pytest.raises(ValueError, match="engine.kv_cache\n  Extra inputs are not permitted"):
        AppConfig.from_dict({"engine": {"kv_cache": "paged"}})


def test_a_runner_handed_in_keeps_its_own_cache_accounting():
    """A runner handed in (as a shard group's is) with its own block size and no prefix cache: the
    scheduler counts its blocks and does not hold back copies of a prompt for a prefix cache it lacks."""
    from model_shards import load_checkpoint
    from moeserve.engine import ModelRunner
    from moeserve.engine.factory import build_engine

    cfg = AppConfig.from_options(draft="none", max_num_seqs=2, max_model_len=64)
    assert (cfg.engine.block_size, cfg.engine.prefix_caching) == (16, True)
    runner = ModelRunner(load_checkpoint(model_path(cfg)), 2, 64, block_size=8, prefix_caching=False)
    engine = build_engine(cfg, runner=runner)
    assert (engine.scheduler.cfg.block_size, engine.scheduler.cfg.share_prefill) == (8, False)


def test_auto_speculation_drafts_with_the_draft_model_only_when_it_shares_the_tokenizer(tmp_path):
    """auto (the default): the demo pair shares one tokenizer, so the draft model; a target with
    another tokenizer (or a draft folder that is missing) falls back to prompt lookup."""
    assert speculation(AppConfig()) == "model"
    assert draft_path(AppConfig()) == resolve_path("checkpoints/demo-draft")
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {}}}')
    assert speculation(AppConfig.from_options(str(other))) == "ngram"
    assert speculation(AppConfig.from_options(draft_path=str(tmp_path / "missing"))) == "ngram"
    assert speculation(AppConfig.from_options(draft="ngram")) == "ngram"  # an explicit choice stands
