"""moeserve's one config tree (pydantic, frozen, validated at construction): every option once, with its one default.

Every way in builds this tree: `moeserve serve --config FILE` and its flags, the `args:` of the
application in deployments/serve_config.yaml (`serve run` / `serve deploy`, KubeRay's
serveConfigV2), and `LLM(**options)` (`AppConfig.from_options`). Each component receives the tree
or its own sections, never a copy field by field.

A file may hold either this dict or a whole Serve config (then the first application's
`args` is used). A relative path is looked up beside the config file first, then in the
data root: the source checkout (checkpoints/ and deployments/ beside the package) when running
from one, else the installed package, which ships the demo checkpoints (so
`checkpoints/demo-moe` works after a plain `pip install`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, NonNegativeInt, model_validator

PACKAGE_ROOT = Path(__file__).resolve().parent
PROJECT_ROOT = PACKAGE_ROOT.parent  # the source checkout, when running from one
DATA_ROOT = PROJECT_ROOT if (PROJECT_ROOT / "checkpoints").is_dir() else PACKAGE_ROOT


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    path: str = "checkpoints/demo-moe"
    name: str = "demo-moe"  # the `model` clients send; the tokenizer is the checkpoint folder's
    # auto: bfloat16 on a GPU, float32 on the CPU (model_shards/device.py)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class EngineSection(_Section):
    # Where the model, its KV cache and the draft run. auto: the GPU when this process sees one, else
    # the CPU. A shard group's ranks run on their own GPUs when shards.gpus_per_shard > 0.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_num_seqs: int = Field(16, ge=1)  # running batch: sequences at once
    max_model_len: int = Field(1024, ge=2)
    max_num_batched_tokens: int = Field(2048, ge=1)
    # The paged KV cache (model_shards/kv_cache.py), reserved whole at start, never grown: KV tokens for
    # all running sequences (0: max_num_seqs x max_model_len) in blocks, plus a scratch block.
    kv_budget_tokens: int = Field(0, ge=0)
    # Or the budget in bytes ("2GiB", "512MiB", a number): as many blocks as fit, scratch included.
    kv_cache_memory: ByteSize = ByteSize(0)
    block_size: int = Field(16, ge=1, le=1024)
    prefix_caching: bool = True  # reuse the KV of shared prompt prefixes (full blocks)
    # Backpressure: past max_num_seqs running + this many waiting, new requests get 503 / RESOURCE_EXHAUSTED.
    max_queued_requests: int = Field(64, ge=0)
    # torch threads of the engine; unset: torch's default in-process, all cores but one in the core process
    torch_threads: int | None = Field(None, ge=1)
    # How often each replica pushes its expert-load counters to the router-service actor (0: never).
    expert_load_report_s: float = Field(10.0, ge=0)
    # Chunks of a stream after its first token at most this often (every chunk is two Serve hops),
    # growing linearly with the live requests to stream_interval_max_s at max_num_seqs (`stream_interval`).
    stream_interval_s: float = Field(0.025, ge=0, le=1)
    stream_interval_max_s: float = Field(0.2, ge=0, le=1)  # below stream_interval_s: taken as that
    # The step loop in a process of its own (no GIL shared with Serve); see deployments/engine_server.py.
    core_process: bool = True
    # Decode and verify passes (and the in-process draft's steps) as torch.compile'd graphs, compiled at engine
    # start (model_shards/compiled_step.py). Off by default: that wait comes at every start (gain: generation.md).
    compile: bool = False

    @model_validator(mode="after")
    def _one_budget(self) -> EngineSection:
        if self.kv_cache_memory and self.kv_budget_tokens:
            raise ValueError("set kv_budget_tokens or kv_cache_memory, not both")
        if self.kv_budget_tokens and self.kv_budget_tokens < self.max_model_len:
            raise ValueError(f"kv_budget_tokens: {self.kv_budget_tokens} cannot hold one sequence of "
                             f"max_model_len {self.max_model_len}")
        return self

    def stream_interval(self, live: int) -> float:
        """Seconds between a stream's chunks (after its first) while `live` requests are in the replica."""
        top = max(self.stream_interval_s, self.stream_interval_max_s)
        load = min(1.0, max(0, live - 1) / max(1, self.max_num_seqs - 1))
        return self.stream_interval_s + (top - self.stream_interval_s) * load


class SpeculativeSection(_Section):
    # model: the dense draft checkpoint (draft_path); ngram: prompt lookup; auto: the draft model
    # when it shares the target's tokenizer (the demo pair), else prompt lookup
    draft: Literal["auto", "none", "ngram", "model"] = "auto"
    draft_path: str | None = "checkpoints/demo-draft"
    num_tokens: int = Field(8, ge=1, le=16)  # k, or with adaptive the most k may be
    # k (at most num_tokens) chosen each step for the batch from its rows' acceptance rates and
    # the step costs measured at that batch size; 0 where speculation does not pay (e.g. a big batch)
    adaptive: bool = True
    # model draft: in the engine's process, or its own Serve deployment (one call per engine step)
    placement: Literal["in_process", "deployment"] = "in_process"
    # placement deployment: pin each draft worker process to these CPU ids of its node (None: the OS's)
    draft_cpus: list[NonNegativeInt] | None = Field(None, min_length=1)
    # No speculation while this many sequences run (0: never); off by default: adaptive k drafts where
    # it pays at each batch size (bench/reports/spec_batch_sweep.md compares the two).
    disable_by_batch_size: int = Field(0, ge=0)


class RoutingSection(_Section):
    """Expert capacity of every MoE layer (router_service/capacity.py): `none` is exact; `drop` and
    `reroute` (to the next-best expert with room) cap each expert at
    max(min_capacity, ceil(capacity_factor * tokens * top_k / experts)) routes per forward pass."""

    overflow: Literal["none", "drop", "reroute"] = "none"
    capacity_factor: float = Field(1.25, gt=0)
    min_capacity: int = Field(4, ge=0)


class ShardsSection(_Section):
    num_shards: int = Field(1, ge=1)  # > 1: expert-parallel shard group per engine replica
    gpus_per_shard: float = Field(0.0, ge=0)  # 1 on a GPU cluster (NCCL), 0 on CPU (gloo)
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"  # placement of the shards
    # Live re-placement: after each expert-load report, move the group's experts between two steps to
    # the router service's plan when the busiest rank's load drops by replacement_min_gain (a fraction).
    live_replacement: bool = False
    replacement_min_gain: float = Field(0.1, gt=0, lt=1)
    # When a rank dies the others serve on (deployments/shard_group.py): 1: every expert also on a
    # second rank (expert memory per rank doubles), nothing read; 0: they read the dead rank's experts.
    redundancy: int = Field(0, ge=0, le=1)
    # Elastic width (deployments/elastic.py): the group follows the load between these (None:
    # num_shards), a change held for resize_after_s; below min_shards (a rank died) it grows back.
    min_shards: int | None = Field(None, ge=1)
    max_shards: int | None = Field(None, ge=1)
    resize_after_s: float = Field(10.0, ge=0)

    @model_validator(mode="after")
    def _second_homes_need_two(self) -> ShardsSection:
        if not (self.min_shards or self.num_shards) <= self.num_shards <= (self.max_shards or self.num_shards):
            raise ValueError(f"shards: needs min_shards <= num_shards <= max_shards, got "
                             f"{self.min_shards}, {self.num_shards}, {self.max_shards}")
        if self.redundancy and self.num_shards < 2:
            raise ValueError("redundancy: a second home for every expert needs num_shards >= 2")
        if self.redundancy and self.live_replacement:
            raise ValueError("redundancy and live_replacement: the router's plans do not keep second homes yet")
        return self


class GrammarSection(_Section):
    """Structured output: what grammar compilation gets (moeserve/grammar/compiler.py's GrammarConfig)."""

    # How JSON under a schema is written: "spaced" {"a": 1} as json.dumps and most models write it, or
    # "compact" {"a":1}: the style the model learned (the demo pair: spaced); the other answers worse.
    json_style: Literal["spaced", "compact"] = "spaced"
    # A grammar compiling longer than this is refused (400): room for JSONSchemaBench sp_0, the slowest.
    compile_timeout_s: float = Field(10.0, gt=0)
    # Longest schema, regex or grammar accepted (the largest JSONSchemaBench schema is ~158 k characters).
    max_spec_chars: int = Field(256 * 1024, ge=1)
    # A oneOf whose branches may overlap: "exact" refuses it unless narrowed apart; "as_any_of" runs it
    # as anyOf (an output may then match two branches: invalid under the schema).
    one_of: Literal["exact", "as_any_of"] = "exact"

    def grammar_config(self) -> Any:
        from moeserve.grammar import GrammarConfig

        separators = (", ", ": ") if self.json_style == "spaced" else (",", ":")
        return GrammarConfig(separators=separators, compile_timeout_s=self.compile_timeout_s,
                             max_spec_chars=self.max_spec_chars, one_of=self.one_of)


class GatewaySection(_Section):
    grpc_port: int | None = Field(9000, ge=0, le=65535)  # None or 0: no gRPC
    grpc_host: str = "0.0.0.0"
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    request_timeout_s: float | None = Field(300.0, gt=0)
    # API keys (deployments/http_edge.py); $MOESERVE_API_KEY adds more, comma-separated. None: open.
    api_keys: list[str] = Field(default_factory=list)
    max_streams_per_key: int = Field(0, ge=0)  # concurrent requests per key (0: no limit), then 429
    public_paths: list[str] = Field(default_factory=lambda: ["/health", "/metrics", "/playground"])  # open with keys
    max_retries: int = Field(2, ge=0)  # resumes of one stream after an engine replica or shard failure
    direct_tokens: bool = False  # tokens on the engine replica's own socket, not the Serve call (token_channel.py)


class AutoscalingSection(_Section):
    """Serve's autoscaling_config (the fields we set; see Ray Serve's docs for their meaning)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = None
    target_ongoing_requests: float = Field(..., gt=0)
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    # the window Serve averages ongoing requests over before deciding (Serve's default: 30 s)
    look_back_period_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSection:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class DeploymentSection(_Section):
    """Serve options for one deployment: autoscaling (or a fixed num_replicas) and admission."""

    num_replicas: int | None = Field(None, ge=1)
    autoscaling: AutoscalingSection | None = None
    max_ongoing_requests: int = Field(..., ge=1)
    max_queued_requests: int = -1  # Serve's own queue in front of the replicas; -1 = unbounded
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # e.g. {"node:__internal_head__": 0.001}
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float = 20.0

    @model_validator(mode="after")
    def _one_scaling_mode(self) -> DeploymentSection:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("set num_replicas or autoscaling, not both")
        return self

    def serve_options(self) -> dict[str, Any]:
        """Keyword arguments for serve.deployment(...)."""
        opts = self.model_dump(include={"max_ongoing_requests", "max_queued_requests", "health_check_period_s",
                                        "health_check_timeout_s", "graceful_shutdown_timeout_s"})
        opts["ray_actor_options"] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": self.resources}
        if self.autoscaling is not None:
            opts["autoscaling_config"] = self.autoscaling.model_dump(exclude_none=True)
        else:
            opts["num_replicas"] = self.num_replicas or 1
        return opts


def _gateway_defaults() -> DeploymentSection:
    # A gateway request mostly waits on its engine stream, so one replica holds hundreds; scale out at
    # 64 streams each (256 > that target leaves room for the delay before a new replica is up).
    return DeploymentSection(
        autoscaling=AutoscalingSection(min_replicas=1, max_replicas=2, target_ongoing_requests=64,
                                       upscale_delay_s=5, downscale_delay_s=60),
        max_ongoing_requests=256, num_cpus=0.5,
    )


def _engine_defaults() -> DeploymentSection:
    # One engine replica is one model copy running one batch. Its own admission control (max_num_seqs
    # running + max_queued_requests waiting) is the real limit, so Serve's must not be lower (Ray's
    # default of 5 would cap the batch at 5). Scale out when the batch is ~3/4 full; max_replicas 1:
    # on a 2-core box a second copy only splits the same cores; raise it on a cluster.
    return DeploymentSection(
        autoscaling=AutoscalingSection(min_replicas=1, max_replicas=1, target_ongoing_requests=12,
                                       upscale_delay_s=10, downscale_delay_s=120),
        max_ongoing_requests=80, num_cpus=1.0, graceful_shutdown_timeout_s=30,
    )


class DeploymentsSection(_Section):
    gateway: DeploymentSection = Field(default_factory=_gateway_defaults)
    engine: DeploymentSection = Field(default_factory=_engine_defaults)
    # speculative.placement deployment: each engine asks a replica for its channel once at start
    draft: DeploymentSection = Field(default_factory=lambda: DeploymentSection(num_replicas=1, max_ongoing_requests=8))


class AppConfig(_Section):
    """Everything `build_app` needs; each component gets its own sections of it."""

    model: ModelSection = Field(default_factory=ModelSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection)
    shards: ShardsSection = Field(default_factory=ShardsSection)
    routing: RoutingSection = Field(default_factory=RoutingSection)
    grammar: GrammarSection = Field(default_factory=GrammarSection)
    gateway: GatewaySection = Field(default_factory=GatewaySection)
    deployments: DeploymentsSection = Field(default_factory=DeploymentsSection)

    @model_validator(mode="after")
    def _serve_admits_a_full_batch(self) -> AppConfig:
        limit = self.deployments.engine.max_ongoing_requests
        if limit < self.engine.max_num_seqs:
            raise ValueError(f"deployments.engine.max_ongoing_requests ({limit}) is below engine.max_num_seqs "
                             f"({self.engine.max_num_seqs}): Serve would never let the batch fill")
        return self

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> AppConfig:
        """Read a YAML file (this config, or a Serve config whose first app's args are it).
        Relative checkpoint paths in the file are resolved beside it first."""
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if "applications" in data:
            apps = data["applications"] or [{}]
            data = apps[0].get("args") or {}
        return cls.from_dict(deep_merge(_paths_beside(data, Path(path).resolve().parent), overrides or {}))

    @classmethod
    def from_options(cls, model: str | None = None, draft: str | None = None, **options: Any) -> AppConfig:
        """The tree from flat keyword options (`LLM(...)`, CLI flags): `model` a checkpoint folder,
        `draft` none | ngram | model | a draft checkpoint folder, and any field of the model,
        engine or speculative sections by its own name (`max_num_seqs=8`, `num_tokens=3`, `dtype=...`)."""
        tree: dict[str, dict[str, Any]] = {"model": {}, "engine": {}, "speculative": {}}
        if model is not None:
            tree["model"]["path"] = model
        if draft is not None:
            named = draft in SpeculativeSection.model_fields["draft"].annotation.__args__
            tree["speculative"] |= {"draft": draft} if named else {"draft": "model", "draft_path": draft}
        for name, value in options.items():
            section = next((s for s, m in _FLAT_SECTIONS.items() if name in m.model_fields), None)
            if section is None:
                raise ValueError(f"{name}: not an engine option (see moeserve/config.py)")
            tree[section][name] = value
        return cls.from_dict(tree)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AppConfig:
        """From build_app's args: the config itself, or {"config": FILE, ...overrides}."""
        data = dict(data)
        path = data.pop("config", None)
        if path is not None:
            return cls.load(resolve_path(str(path)), data)
        return cls.model_validate(data)

    def with_overrides(self, overrides: dict[str, Any]) -> AppConfig:
        return type(self).model_validate(deep_merge(self.model_dump(), overrides))


def default_of(section: type[BaseModel], name: str) -> Any:
    """A section field's default, for the dataclasses that carry one component's part of the tree."""
    return section.model_fields[name].default


def resolve_path(path: str) -> str:
    """An absolute path: relative ones are taken from the data root (see the module docstring)."""
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else DATA_ROOT / p)


def _paths_beside(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Checkpoint paths of a config file that exist relative to the file, made absolute."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for section, key in (("model", "path"), ("speculative", "draft_path")):
        value = (out.get(section) or {}).get(key)
        if isinstance(value, str) and not Path(value).is_absolute() and (folder / value).exists():
            out[section][key] = str(folder / value)
    return out


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_FLAT_SECTIONS = {"model": ModelSection, "engine": EngineSection, "speculative": SpeculativeSection}
