"""The served application's config: moeserve's one config tree (moeserve/config.py) plus the
deployments' parts of it. The same dict is `moeserve serve --config FILE`'s file, the `args:` of
the application in deployments/serve_config.yaml, and what KubeRay's serveConfigV2 embeds."""

from __future__ import annotations

from deployments.engine_loader import EngineServerConfig
from moeserve import config as tree
from moeserve.config import DATA_ROOT, PROJECT_ROOT, deep_merge, resolve_path
from moeserve.engine.factory import EngineConfig

__all__ = ["DATA_ROOT", "PROJECT_ROOT", "AppConfig", "deep_merge", "resolve_path"]


class AppConfig(tree.AppConfig):
    """The config tree, able to hand each deployment its part."""

    def engine_server_config(self) -> EngineServerConfig:
        """The engine replica's part: the engine's own, plus queueing, streaming and shards."""
        e, sh = self.engine, self.shards
        return EngineServerConfig(EngineConfig.from_app(self), e.max_queued_requests, sh.num_shards, sh.strategy,
                                  sh.gpus_per_shard, e.torch_threads, report_expert_load_s=e.expert_load_report_s,
                                  stream_interval_s=e.stream_interval_s,
                                  stream_interval_max_s=max(e.stream_interval_s, e.stream_interval_max_s),
                                  core_process=e.core_process, live_replacement=sh.live_replacement,
                                  replacement_min_gain=sh.replacement_min_gain)
