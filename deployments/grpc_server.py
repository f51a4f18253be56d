"""gRPC front end (moeserve.v1.GenerateService), a grpcio aio server inside the gateway replica.

Why not Serve's gRPC proxy (gRPCOptions): it adds a proxy hop and its own status mapping,
and it wants the ingress's methods to take proto messages. A grpcio server on the
replica's own event loop shares the Frontend with HTTP (same validation, same grammar
guard, same metrics), sets status codes directly, and sees client cancellation as task
cancellation, which closes the engine stream and aborts the request.

Besides moeserve.v1.GenerateService it serves the standard `grpc.health.v1.Health` (SERVING
while the engine answers its health check, polled every few seconds; what Kubernetes gRPC
probes and grpc_health_probe ask) and server reflection (grpcurl). An unset `model` means
the served one, as proto3 reads an unset field as its default.

With API keys configured (deployments/auth.py) Generate needs `authorization: Bearer KEY`
metadata: UNAUTHENTICATED without it, RESOURCE_EXHAUSTED past the key's concurrent calls;
the health services stay open.

Status codes: INVALID_ARGUMENT (bad input, message names the field), NOT_FOUND (model),
RESOURCE_EXHAUSTED (engine queue full), UNAVAILABLE (engine down), DEADLINE_EXCEEDED
(the call's deadline, passed on to the engine as the request timeout), INTERNAL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deployments.auth import ApiKeys
from deployments.frontend import Frontend, Prepared
from deployments.openai_api import APIError
from deployments.proto import generate_pb2 as pb
from deployments.proto import generate_pb2_grpc as pb_grpc
from moeserve.grammar.spec import GrammarSpec
from moeserve.protocol import ErrorCode, GenerateChunk
from moeserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ROUTE = "grpc:/moeserve.v1.GenerateService/Generate"
HEALTH_POLL_S = 2.0  # how often grpc.health.v1 re-reads the engine's health

_BY_ERROR_CODE = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}
_BY_HTTP_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                   413: grpc.StatusCode.RESOURCE_EXHAUSTED, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def status_for(e: APIError) -> grpc.StatusCode:
    """The gRPC status for an HTTP-shaped APIError."""
    if e.code:
        for code, status in _BY_ERROR_CODE.items():
            if code.value == e.code:
                return status
    if e.status == 503:
        return grpc.StatusCode.UNAVAILABLE
    return _BY_HTTP_STATUS.get(e.status, grpc.StatusCode.INTERNAL)


class GenerateServicer(pb_grpc.GenerateServiceServicer):
    def __init__(self, frontend: Frontend, auth: ApiKeys) -> None:
        self.frontend, self.auth = frontend, auth

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        """Stream a generation; errors end the call with a status code and a message."""
        status = grpc.StatusCode.OK
        key = None
        try:
            if self.auth.enabled:
                key = self.auth.identify(dict(context.invocation_metadata()).get("authorization"))
                if key is None:
                    status = grpc.StatusCode.UNAUTHENTICATED
                    await context.abort(status, "missing or invalid API key (metadata authorization: Bearer KEY)")
                if not self.auth.acquire(key):
                    key, status = None, grpc.StatusCode.RESOURCE_EXHAUSTED
                    await context.abort(status, f"this API key already holds {self.auth.max_streams_per_key} "
                                                "requests; retry when one ends")
            try:
                prep = await self._prepare(request, context.time_remaining())
            except APIError as e:
                status = status_for(e)
                await context.abort(status, e.message)
            except ValueError as e:  # SamplingParams / GrammarSpec / chat messages, naming the field
                status = grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(status, str(e))
            async for chunk in self.frontend.stream(prep):
                if chunk.error is not None:
                    status = _BY_ERROR_CODE[chunk.error.code]
                    await context.abort(status, chunk.error.message)
                yield _response(chunk)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            logger.exception("gRPC Generate failed")
            status = grpc.StatusCode.INTERNAL
            await context.abort(status, f"internal error: {type(e).__name__}: {e}")
        finally:
            if key is not None:
                self.auth.release(key)
            self.frontend.metrics.requests.labels(route=ROUTE, code=status.name).inc()

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:  # noqa: N802
        """SERVING when the engine answers its health check."""
        try:
            await self.frontend.engine.health()
        except Exception as e:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING, message=f"{type(e).__name__}: {e}")
        return pb.HealthResponse(status=pb.HealthResponse.SERVING, message="ok")

    async def _prepare(self, req: pb.GenerateRequest, time_remaining: float | None) -> Prepared:
        fe = self.frontend
        fe.check_model(req.model or fe.cfg.model_name)
        which = req.WhichOneof("input")
        if which == "prompt":
            prompt_ids = fe.encode_prompt(req.prompt)
        elif which == "prompt_token_ids":
            if not req.prompt_token_ids.ids:
                raise APIError(400, "prompt_token_ids is empty", param="prompt_token_ids")
            prompt_ids = fe.encode_prompt(list(req.prompt_token_ids.ids))
        elif which == "chat":
            messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
            prompt_ids = fe.encode_chat(messages)
        else:
            raise APIError(400, "one of prompt, prompt_token_ids or chat is required", param="input")
        max_tokens = req.max_tokens if req.HasField("max_tokens") else None
        prep = await fe.prepare(prompt_ids, lambda n: _params(req, n), max_tokens, _grammar(req), ROUTE,
                                request_id=req.request_id or None)
        if time_remaining is not None:  # the caller's deadline bounds the engine's work too
            timeout = min(time_remaining, prep.request.timeout_s or time_remaining)
            prep.request = dataclasses.replace(prep.request, timeout_s=max(timeout, 1e-3))
        return prep


def _params(req: pb.GenerateRequest, max_tokens: int) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": req.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if req.HasField(name):
            kwargs[name] = getattr(req, name)
    if req.stop:
        kwargs["stop"] = tuple(req.stop)
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(req.stop_token_ids)
    if req.HasField("logprobs"):
        kwargs["logprobs"] = req.logprobs
    if req.HasField("trace"):
        kwargs |= {"trace_experts": req.trace.experts, "trace_speculation": req.trace.speculation}
    return SamplingParams(**kwargs)


def _grammar(req: pb.GenerateRequest) -> GrammarSpec | None:
    which = req.WhichOneof("grammar")
    if which is None:
        return None
    if which == "json_schema":
        return GrammarSpec.json_schema(req.json_schema)
    if which == "json_object":
        return GrammarSpec.json_object() if req.json_object else None
    if which == "regex":
        return GrammarSpec.regex(req.regex)
    if which == "ebnf":
        return GrammarSpec.ebnf(req.ebnf)
    return GrammarSpec.choice(list(req.choice.choices))


def _response(chunk: GenerateChunk) -> pb.GenerateResponse:
    u = chunk.usage
    return pb.GenerateResponse(
        request_id=chunk.request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=chunk.finish_reason or "",
        usage=pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                       total_tokens=u.total_tokens),
        logprobs=[pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                                  top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top])
                  for e in chunk.logprobs or ()],
        trace=[pb.TokenTrace(token_id=e.token_id, source=e.source or "",
                             experts=[pb.LayerRouting(layer=layer, expert_ids=ids, weights=w)
                                      for layer, ids, w in e.experts or ()])
               for e in chunk.trace or ()],
    )


async def start_grpc_server(
    frontend: Frontend, host: str, port: int, max_message_bytes: int = 4 << 20, auth: ApiKeys | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start serving on host:port (0: any free port) on the running event loop; returns the
    grpc.aio.Server and the port it bound.

    Several gateway replicas on one node can bind the same port (grpcio sets SO_REUSEPORT).
    """
    options = [("grpc.max_receive_message_length", max_message_bytes), ("grpc.so_reuseport", 1)]
    server = grpc.aio.server(options=options)
    pb_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(frontend, auth or ApiKeys(from_env=False)), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = (pb.DESCRIPTOR.services_by_name["GenerateService"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(services, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"gRPC server could not bind {host}:{port}")
    await server.start()
    asyncio.get_running_loop().create_task(_watch_health(frontend, health_servicer, server, services[0]))
    logger.info("gRPC GenerateService listening on %s:%d", host, bound)
    return server, bound


async def _watch_health(frontend: Frontend, servicer: Any, server: grpc.aio.Server, service: str) -> None:
    """grpc.health.v1 status of the server ("") and of GenerateService, following the engine's
    health check, until the server terminates."""
    while True:
        try:
            await asyncio.wait_for(frontend.engine.health(), HEALTH_POLL_S)
            status = health_pb2.HealthCheckResponse.SERVING
        except Exception:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", service):
            await servicer.set(name, status)
        try:
            await asyncio.wait_for(server.wait_for_termination(), HEALTH_POLL_S)
            return
        except asyncio.TimeoutError:
            pass
