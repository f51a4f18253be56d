"""gRPC front end (moeserve.v1.GenerateService), a grpcio aio server inside the gateway replica.

Not Serve's gRPC proxy (one more hop): this server shares the Frontend with HTTP, sets status codes
directly (`GRPC_STATUS`), and sees client cancellation as task cancellation, which aborts the
request. It also serves `grpc.health.v1.Health` and server reflection. With API keys configured,
Generate needs `authorization: Bearer KEY` metadata; the health services stay open.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deployments.frontend import Frontend, ServeRequest
from deployments.http_edge import ApiKeys
from deployments.proto import generate_pb2 as pb
from deployments.proto import generate_pb2_grpc as pb_grpc
from deployments.tools import Tool, ToolCalling, tool_calling
from moeserve.config import GatewaySection
from moeserve.errors import ErrorCode, ServingError, as_serving_error
from moeserve.grammar.spec import GrammarSpec
from moeserve.protocol import GenerateChunk

logger = logging.getLogger(__name__)

ROUTE = "grpc:/moeserve.v1.GenerateService/Generate"
HEALTH_POLL_S = 2.0  # how often grpc.health.v1 re-reads the engine's health

# ErrorCode follows gRPC's names but for two more kinds of RESOURCE_EXHAUSTED
GRPC_STATUS = {code: grpc.StatusCode[code.name] for code in ErrorCode if code.name in grpc.StatusCode.__members__}
GRPC_STATUS |= {ErrorCode.RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
                ErrorCode.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED}


class GenerateServicer(pb_grpc.GenerateServiceServicer):
    def __init__(self, frontend: Frontend, auth: ApiKeys) -> None:
        self.frontend, self.auth = frontend, auth

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        """Stream a generation; errors end the call with a status code and a message."""
        status = grpc.StatusCode.OK
        key = None
        try:
            if self.auth.enabled:
                key = self.auth.admit(dict(context.invocation_metadata()).get("authorization"),
                                      "metadata authorization: Bearer KEY")
            req, calling = serve_request(request, self.frontend.cfg.model.name, context.time_remaining())
            (prep,) = self.frontend.prepare(req, ROUTE)
            tools = calling.stream() if calling is not None else None
            async for chunk in self.frontend.stream(prep):
                calls = []
                if tools is not None:  # text only outside calls; the calls whole, with the last response
                    text, calls, finish = tools.push(chunk.text, chunk.finish_reason)
                    chunk = replace(chunk, text=text, finish_reason=finish)
                yield _response(chunk, calls)
        except Exception as e:
            error = as_serving_error(e)
            if error.code is ErrorCode.INTERNAL:
                logger.exception("gRPC Generate failed")
            status = GRPC_STATUS[error.code]
            await context.abort(status, error.message)
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


def serve_request(req: pb.GenerateRequest, served_model: str,
                  time_remaining: float | None) -> tuple[ServeRequest, ToolCalling | None]:
    """The message as the serving layer's request (an unset model is the served one), and what its
    tools ask for (None without tools)."""
    which = req.WhichOneof("input")
    prompt, messages = None, None
    if which == "prompt":
        prompt = req.prompt
    elif which == "prompt_token_ids":
        if not req.prompt_token_ids.ids:
            raise ServingError(ErrorCode.INVALID_ARGUMENT, "prompt_token_ids is empty", param="prompt_token_ids")
        prompt = list(req.prompt_token_ids.ids)
    elif which == "chat":
        messages = [{"role": m.role, "content": m.content} | _tool_fields(m) for m in req.chat.messages]
    else:
        raise ServingError(ErrorCode.INVALID_ARGUMENT, "one of prompt, prompt_token_ids or chat is required",
                           param="input")
    sampling: dict[str, Any] = {"ignore_eos": req.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "seed", "logprobs"):
        if req.HasField(name):
            sampling[name] = getattr(req, name)
    if req.stop:
        sampling["stop"] = tuple(req.stop)
    if req.stop_token_ids:
        sampling["stop_token_ids"] = tuple(req.stop_token_ids)
    if req.HasField("trace"):
        sampling |= {"trace_experts": req.trace.experts, "trace_speculation": req.trace.speculation}
    if (req.tools or req.tool_choice) and messages is None:
        raise ServingError(ErrorCode.INVALID_ARGUMENT, "tools need a chat input", param="tools")
    choice = req.tool_choice or None
    if choice not in (None, "none", "auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True
    calling, grammar = tool_calling([_tool(t) for t in req.tools], choice, parallel, _grammar(req))
    return ServeRequest(req.model or served_model, prompt=prompt, messages=messages,
                        tools=calling.template_tools() if calling is not None else None,
                        call_prefix=calling.call_prefix() if calling is not None else "",
                        max_tokens=req.max_tokens if req.HasField("max_tokens") else None, sampling=sampling,
                        grammar=grammar, request_id=req.request_id or None, timeout_s=time_remaining), calling


def _tool(t: pb.FunctionTool) -> Tool:
    try:
        parameters = json.loads(t.parameters) if t.parameters else {"type": "object", "properties": {}}
    except ValueError as e:
        raise ServingError(ErrorCode.INVALID_ARGUMENT, f"tools: parameters of {t.name!r} are not JSON: {e}",
                           param="tools") from None
    function = {"name": t.name, "parameters": parameters} | ({"description": t.description} if t.description else {})
    return Tool.model_validate({"type": "function", "function": function})


def _tool_fields(m: pb.ChatMessage) -> dict[str, Any]:
    """An assistant's earlier calls and a tool message's call id, as the chat template takes them."""
    out: dict[str, Any] = {"tool_call_id": m.tool_call_id} if m.tool_call_id else {}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    return out


def _grammar(req: pb.GenerateRequest) -> GrammarSpec | None:
    which = req.WhichOneof("grammar")  # json_schema, regex and ebnf are named as GrammarSpec's constructors
    if which == "json_object":
        return GrammarSpec.json_object() if req.json_object else None
    if which == "choice":
        return GrammarSpec.choice(list(req.choice.choices))
    return None if which is None else getattr(GrammarSpec, which)(getattr(req, which))


def _response(chunk: GenerateChunk, calls: list[dict[str, Any]] = ()) -> pb.GenerateResponse:
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
        tool_calls=[pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                    for c in calls],
    )


async def start_grpc_server(frontend: Frontend, host: str, port: int, max_message_bytes: int = 4 << 20,
                            auth: ApiKeys | None = None) -> tuple[grpc.aio.Server, int]:
    """Serve on host:port (0: any free port; SO_REUSEPORT, so gateway replicas on one node share
    it) on the running event loop; returns the grpc.aio.Server and the port it bound."""
    options = [("grpc.max_receive_message_length", max_message_bytes), ("grpc.so_reuseport", 1)]
    server = grpc.aio.server(options=options)
    pb_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(frontend, auth or ApiKeys(GatewaySection(), from_env=False)), server)
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
