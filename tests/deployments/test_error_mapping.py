"""One error vocabulary, mapped once per transport: every ErrorCode has one HTTP status and one
gRPC status code, and a ServingError of each code reaches the client as that status with its
message, over HTTP (OpenAI's error body) and over gRPC."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from fastapi import FastAPI

from deployments.grpc_server import GRPC_STATUS, start_grpc_server
from deployments.http_edge import HTTP_STATUS, install_edge
from deployments.metrics import GatewayMetrics
from deployments.proto import generate_pb2 as pb
from deployments.proto import generate_pb2_grpc as pb_grpc
from moeserve import protocol
from moeserve.config import AppConfig
from moeserve.errors import ErrorCode, ServingError, as_serving_error


def test_every_code_maps_to_one_http_status_and_one_grpc_code():
    assert set(HTTP_STATUS) == set(GRPC_STATUS) == set(ErrorCode)
    assert all(400 <= status < 600 for status in HTTP_STATUS.values())
    assert all(code is not grpc.StatusCode.OK for code in GRPC_STATUS.values())
    assert HTTP_STATUS[ErrorCode.INVALID_ARGUMENT] == 400 and GRPC_STATUS[ErrorCode.INVALID_ARGUMENT].name == (
        "INVALID_ARGUMENT")
    # the engine's in-band codes are the same words: each converts to a serving code
    assert {c.value for c in protocol.ErrorCode} <= {c.value for c in ErrorCode}


def test_lower_layers_errors_become_serving_errors():
    bad = as_serving_error(ValueError("temperature must be a finite number, got nan"))
    assert (bad.code, bad.param, bad.reason) == (ErrorCode.INVALID_ARGUMENT, "temperature", "invalid_argument")
    bug = as_serving_error(KeyError("x"))
    assert bug.code is ErrorCode.INTERNAL and "KeyError" in bug.message
    own = ServingError(ErrorCode.NOT_FOUND, "no such model", reason="model_not_found")
    assert as_serving_error(own) is own


@pytest.mark.parametrize("code", list(ErrorCode))
def test_http_answers_each_code_with_its_status_and_message(code):
    app = FastAPI()
    install_edge(app, ["/fail"], 4096, GatewayMetrics())

    @app.post("/fail")
    async def fail() -> None:
        raise ServingError(code, f"failed with {code.value}", param="field")

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as h:
            return await h.post("/fail", json={})

    r = asyncio.run(main())
    assert r.status_code == HTTP_STATUS[code]
    assert r.json()["error"] | {"type": None} == {"message": f"failed with {code.value}", "type": None,
                                                  "param": "field", "code": code.value}


class FailingFrontend:
    """The serving layer as the gRPC server uses it, refusing every request with one code."""

    cfg = AppConfig.from_dict({"model": {"name": "tiny"}})

    def __init__(self, code: ErrorCode) -> None:
        self.code, self.metrics = code, GatewayMetrics()

    def prepare(self, req, route):
        raise ServingError(self.code, f"failed with {self.code.value}")


@pytest.mark.parametrize("code", list(ErrorCode))
def test_grpc_answers_each_code_with_its_status_and_message(code):
    async def main():
        server, port = await start_grpc_server(FailingFrontend(code), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    [r async for r in pb_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(prompt="x"),
                                                                                     timeout=10)]
                return e.value
        finally:
            await server.stop(grace=None)

    error = asyncio.run(main())
    assert error.code() == GRPC_STATUS[code] and error.details() == f"failed with {code.value}"
