"""The gateway: OpenAI-compatible HTTP (FastAPI, SSE) and gRPC in front of the engine.

`Gateway` is a plain class: construct it with an engine client (an EngineServer in tests, a
Serve handle in deployments/app.py) and serve `gateway.http_app` with any ASGI server. The app's
lifespan runs the gRPC server, so its port lives with the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray.serve.handle import DeploymentHandle

from deployments.frontend import Frontend, ServeRequest
from deployments.http_edge import ApiKeys, error_responses, install_edge
from deployments.metrics import GatewayMetrics
from deployments.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    chat_request,
    completion_request,
    full_response,
    sse_events,
)
from deployments.token_channel import TokenClient
from deployments.tools import ToolCalling
from moeserve.config import AppConfig, resolve_path
from moeserve.errors import ErrorCode, ServingError
from moeserve.protocol import GenerateChunk, GenerateRequest

ROUTE_COMPLETIONS = "/v1/completions"
ROUTE_CHAT = "/v1/chat/completions"
ROUTES = (ROUTE_COMPLETIONS, ROUTE_CHAT, "/v1/models", "/health", "/metrics", "/playground")
PLAYGROUND = Path(__file__).resolve().parent / "playground" / "index.html"


class ServeEngineClient:
    """The engine deployment through a Serve handle: one streaming call per request (a call costs
    more than a decode step), its chunks on the call or, `direct`, on the replica's token socket
    (deployments/token_channel.py). Leaving the stream early cancels the call, which aborts the request."""

    def __init__(self, handle: DeploymentHandle, config: AppConfig) -> None:
        self._handle = handle
        self._stream = handle.options(stream=True)
        self._tokens = TokenClient(config.engine.stream_interval) if config.gateway.direct_tokens else None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if self._tokens is not None:
            async for chunk in self._tokens.generate(self._stream, request):
                yield chunk
            return
        response = self._stream.generate.remote(request)
        finished = False
        try:
            async for chunk in response:
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                response.cancel()

    async def health(self) -> dict[str, Any]:
        return await self._handle.health.remote()

    async def stats(self) -> dict[str, Any]:
        return await self._handle.stats.remote()


class Gateway:
    """Validates and tokenizes requests, streams token ids from the engine and text to the client."""

    def __init__(self, engine: Any, config: AppConfig, tokenizer: Any = None) -> None:
        """config: the whole tree (`gateway`, the model's name and path, engine.max_model_len)."""
        self.config, self.edge = config, config.gateway
        if tokenizer is None:
            from moeserve.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(resolve_path(config.model.path))
        self.metrics = GatewayMetrics()
        self.auth = ApiKeys(self.edge)
        if isinstance(engine, DeploymentHandle):  # anything else (an EngineServer in tests) is used as it is
            engine = ServeEngineClient(engine, config)
        self.frontend = Frontend(config, tokenizer, engine, self.metrics)
        self.grpc_server: Any = None
        self.http_app = self._build_app()

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve's late-bound ingress hook: the app is built per replica, never pickled."""
        return self.http_app

    # ---- the app ---------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="moeserve", lifespan=self._lifespan)
        install_edge(app, ROUTES, self.edge.max_body_bytes, self.metrics, self.auth, self.edge.public_paths)
        generate = error_responses(400, 401, 404, 413, 429, 500, 503, 504)
        stream = {200: {"description": "the completion, or its SSE stream (text/event-stream) with stream=true"}}
        app.post(ROUTE_COMPLETIONS, responses=stream | generate)(self.completions)
        app.post(ROUTE_CHAT, responses=stream | generate)(self.chat_completions)
        app.get("/v1/models", responses=error_responses(401))(self.models)
        app.get("/health", responses=error_responses(503))(self.health)
        app.get("/metrics", responses={200: {"content": {"text/plain": {}}, "description": "Prometheus"}})(
            self.prometheus)
        app.get("/admin/experts", responses=error_responses(400, 401, 503))(self.experts)
        app.get("/playground", response_class=HTMLResponse, include_in_schema=False)(self.playground)
        app.openapi = lambda: _openapi(app)
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        if self.edge.grpc_port:
            from deployments.grpc_server import start_grpc_server

            self.grpc_server, _ = await start_grpc_server(self.frontend, self.edge.grpc_host, self.edge.grpc_port,
                                                          auth=self.auth)
        try:
            yield
        finally:
            if self.grpc_server is not None:
                await self.grpc_server.stop(grace=2.0)

    # ---- routes ----------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest) -> Response:
        """OpenAI `POST /v1/completions` (one prompt, n choices), streaming or not."""
        hex_id = uuid.uuid4().hex
        req = completion_request(body, f"req-{hex_id}")
        builder = ResponseBuilder(f"cmpl-{hex_id}", body.model, chat=False, token_bytes=self.frontend.token_bytes)
        return await self._respond(req, ROUTE_COMPLETIONS, builder, body.stream, body.include_usage)

    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        """OpenAI `POST /v1/chat/completions` through the tokenizer's chat template."""
        hex_id = uuid.uuid4().hex
        req, calling = chat_request(body, f"req-{hex_id}")
        builder = ResponseBuilder(f"chatcmpl-{hex_id}", body.model, chat=True, token_bytes=self.frontend.token_bytes)
        return await self._respond(req, ROUTE_CHAT, builder, body.stream, body.include_usage, calling)

    async def _respond(self, req: ServeRequest, route: str, builder: ResponseBuilder, stream: bool,
                       include_usage: bool, calling: ToolCalling | None = None) -> Response:
        # every choice's first token is in before the status line, so early errors keep their status
        merged = await self.frontend.generate(self.frontend.prepare(req, route))
        if not stream:
            return JSONResponse(await full_response(merged, req.n, builder, calling))
        return StreamingResponse(sse_events(merged, req.n, builder, include_usage, calling),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def models(self) -> dict[str, Any]:
        """OpenAI `GET /v1/models`: the one served model."""
        card = {"id": self.config.model.name, "object": "model", "created": 0, "owned_by": "moeserve",
                "max_model_len": self.config.engine.max_model_len}
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        """200 when this gateway and the engine answer; 503 otherwise."""
        try:
            engine = await self.frontend.engine.health()
        except Exception as e:
            return JSONResponse({"status": "unavailable", "error": f"{type(e).__name__}: {e}"}, status_code=503)
        return JSONResponse({"status": "ok", "engine": engine})

    async def prometheus(self) -> Response:
        """Prometheus text format: this replica's request metrics and one engine replica's gauges."""
        try:
            stats = await self.frontend.engine.stats()
        except Exception:  # metrics must answer even when the engine does not
            stats = None
        return Response(self.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def experts(self, world_size: int = 2) -> Response:
        """Admin: expert load and the router service's placement for `world_size` ranks (or local ones)."""
        import ray

        from deployments.router_actor import RouterService, find_router_actor

        world_size = max(1, min(world_size, 64))
        actor = await asyncio.to_thread(find_router_actor) if ray.is_initialized() else None
        if actor is None:
            from model_shards.config import ModelConfig

            cfg = ModelConfig.from_file(resolve_path(self.config.model.path))
            empty = RouterService(cfg.num_layers, max(cfg.num_experts, 1))
            summary, placement = empty.summary(), empty.placement(world_size)
            try:
                own = (await self.frontend.engine.stats()).get("experts")
            except Exception:  # statistics answer even when the engine does not
                own = None
            if own and any(layer["tokens"] for layer in own):
                summary |= {"sources": ["this replica"], "layers": own}
        else:
            try:
                summary = await actor.summary.remote()
                placement = await actor.placement.remote(world_size)
            except ray.exceptions.RayActorError as e:  # killed: the next engine report creates it again
                raise ServingError(ErrorCode.UNAVAILABLE, f"router service unavailable: {type(e).__name__}") from None
        return JSONResponse(summary | {"placement": {"world_size": placement.world_size,
                                                     "rank_experts": placement.rank_experts}})

    async def playground(self) -> HTMLResponse:
        """The playground page (one file, no CDN): chat, each token's experts and speculation, live stats."""
        return HTMLResponse(PLAYGROUND.read_text(encoding="utf-8"))


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its 422 entries: a body that fails validation is a 400 here."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation["responses"].pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema
