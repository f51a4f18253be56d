"""API keys for the gateway: who may call, and how many streams each caller may hold at once.

Keys come from the config (`gateway.api_keys`, `moeserve serve --api-key KEY`) and from the
environment variable MOESERVE_API_KEY (comma-separated; how the Kubernetes Secret reaches
the pods). No key configured: the gateway is open. HTTP callers send `Authorization: Bearer
KEY`, gRPC callers the same in the `authorization` metadata. Every configured key is
compared in constant time (hmac.compare_digest), and all of them every time, so timing says
nothing about which one nearly matched.

A key may hold at most `max_streams_per_key` requests at once (0: no limit); past it the call
is refused (RATE_LIMITED: 429 + Retry-After / RESOURCE_EXHAUSTED), before it costs the engine anything.
"""

from __future__ import annotations

import hmac
import os
from collections import Counter

from moeserve.config import GatewaySection
from moeserve.errors import ErrorCode, ServingError

ENV_VAR = "MOESERVE_API_KEY"


class ApiKeys:
    def __init__(self, cfg: GatewaySection, from_env: bool = True) -> None:
        """cfg.api_keys (and $MOESERVE_API_KEY's when `from_env`), each holding at most
        cfg.max_streams_per_key requests at once (0: no limit). No key configured: open."""
        env = os.environ.get(ENV_VAR, "") if from_env else ""
        self.keys = tuple(k.strip() for k in (*cfg.api_keys, *env.split(",")) if k.strip())
        self.max_streams_per_key = cfg.max_streams_per_key
        self._streams: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, authorization: str | None) -> str | None:
        """The key an `Authorization: Bearer KEY` value carries, if it is one of ours."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip().encode()
        found = None
        for key in self.keys:  # no early exit: every key is compared every time
            if hmac.compare_digest(token, key.encode()) and scheme.lower() == "bearer":
                found = key
        return found

    def admit(self, authorization: str | None, how: str) -> str:
        """The caller's key, holding one of its slots (give it back with `release`); ServingError
        UNAUTHENTICATED without a valid key (`how`: where to send one), RATE_LIMITED past its limit."""
        key = self.identify(authorization)
        if key is None:
            raise ServingError(ErrorCode.UNAUTHENTICATED, f"missing or invalid API key ({how})",
                               reason="invalid_api_key")
        if not self.acquire(key):
            raise ServingError(ErrorCode.RATE_LIMITED, f"this API key already holds {self.max_streams_per_key} "
                               "requests; retry when one ends", reason="rate_limit_exceeded")
        return key

    def acquire(self, key: str) -> bool:
        """Take one of `key`'s stream slots; False when it holds its limit already."""
        if self.max_streams_per_key and self._streams[key] >= self.max_streams_per_key:
            return False
        self._streams[key] += 1
        return True

    def release(self, key: str) -> None:
        self._streams[key] -= 1
        if self._streams[key] <= 0:
            del self._streams[key]
