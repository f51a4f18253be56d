"""The one place where deployments are bound: config -> the Serve application (gateway -> engine,
and the draft deployment with `speculative.placement: deployment`).

`build_app` serves `moeserve serve`, Ray's `serve run|deploy deployments/serve_config.yaml` and
KubeRay's serveConfigV2 alike. A shard group is not a deployment: each engine replica forms its own,
so autoscaling the engine scales whole groups.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from deployments.engine_server import EngineServer
from deployments.gateway import Gateway
from moeserve.config import AppConfig, resolve_path
from moeserve.engine.factory import speculation

APP_NAME = "moeserve"


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Serve's application builder: `args` is an AppConfig dict, or {"config": FILE, ...overrides}."""
    cfg = args if isinstance(args, AppConfig) else AppConfig.from_dict(args or {})
    return build(cfg)


def build(cfg: AppConfig) -> Application:
    """Bind gateway -> engine (-> draft deployment)."""
    draft = _bind_draft(cfg)
    engine = serve.deployment(EngineReplica, name="engine", **cfg.deployments.engine.serve_options()).bind(cfg, draft=draft)
    ingress = serve.ingress()(Gateway)  # the app comes from Gateway.__serve_build_asgi_app__ per replica
    gateway = serve.deployment(ingress, name="gateway", **cfg.deployments.gateway.serve_options())
    return gateway.bind(engine, cfg)


class EngineReplica(EngineServer):
    """The engine deployment. With a draft deployment, it first asks that once for its worker's
    channel, awaiting the answer: the constructor runs on the replica's event loop, where Serve's
    router for the handle runs too (Serve's throughput-optimized mode), so it must not block there."""

    async def __init__(self, config: AppConfig, draft: DeploymentHandle | None = None) -> None:  # Serve awaits it
        channel = None if draft is None else await asyncio.wait_for(draft.options(method_name="channel").remote(), 60)
        super().__init__(config, draft=channel)


def _bind_draft(cfg: AppConfig) -> Application | None:
    """The draft model as its own deployment (`speculative.placement: deployment`); None when the
    engine drafts in its own process (the default: a call per step is a good part of a decode
    step) or does not use the draft model."""
    s = cfg.speculative
    if s.placement != "deployment" or speculation(cfg) != "model":  # "auto" resolved
        return None
    from deployments.draft import DraftServerConfig, bind_draft

    e = cfg.engine
    return bind_draft(
        DraftServerConfig(resolve_path(s.draft_path), max_num_seqs=e.max_num_seqs, max_model_len=e.max_model_len,
                          device=e.device, dtype=cfg.model.dtype,
                          cpus=tuple(s.draft_cpus) if s.draft_cpus is not None else None),
        cfg.deployments.draft.serve_options(),
    )
