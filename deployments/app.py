"""The one place where deployments are bound: config -> the Serve application.

    client -> gateway (FastAPI + gRPC, autoscaled) --one streaming call per request--> engine

Used three ways, all through `build_app`:

- `moeserve serve [--config FILE]` (moeserve/cli.py) deploys it on an embedded local Ray;
- `serve run deployments/serve_config.yaml` / `serve deploy ...` (Ray's CLI) import
  `deployments.app:build_app` with the YAML's `args`;
- KubeRay's serveConfigV2 embeds the same Serve config.

The other parts plug in here:
- shard group: not a deployment. With `shards.num_shards > 1` each engine replica forms its
  own group (rank 0 in the replica, the other ranks as Ray actors in a placement group;
  deployments/engine_server.py `load_engine`), so autoscaling the engine scales whole groups;
- draft model: in the engine's process by default (`speculative.draft: model`); the separate
  draft deployment (deployments/draft.py `bind_draft`) is the hook `_bind_draft`, whose bound
  app would be passed to the engine's bind() so Serve hands the engine a handle to it;
- router-service actor: the hook `_bind_router_service` (deployments/router_actor.py).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from deployments.config import AppConfig
from deployments.engine_server import EngineServer
from deployments.gateway import Gateway

APP_NAME = "moeserve"


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Serve's application builder: `args` is an AppConfig dict, or {"config": FILE, ...overrides}."""
    cfg = args if isinstance(args, AppConfig) else AppConfig.from_dict(args or {})
    return build(cfg)


def build(cfg: AppConfig) -> Application:
    """Bind engine and gateway (and, as they land, shard group, draft and router service)."""
    for hook in (_bind_draft, _bind_router_service):
        hook(cfg)  # not wired yet: both return None
    engine = serve.deployment(EngineServer, name="engine", **cfg.deployments.engine.serve_options()).bind(
        cfg.engine_server_config()
    )
    ingress = serve.ingress()(Gateway)  # the app comes from Gateway.__serve_build_asgi_app__ per replica
    gateway = serve.deployment(ingress, name="gateway", **cfg.deployments.gateway.serve_options())
    return gateway.bind(engine, cfg.gateway_config())


def _bind_draft(cfg: AppConfig) -> Any:
    return None  # the engine builds an in-process proposer from cfg.speculative


def _bind_router_service(cfg: AppConfig) -> Any:
    return None
