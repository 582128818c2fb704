"""API keys (`api_key`): every route but the probes and `/metrics` asks for `Authorization: Bearer <key>`,
as ASGI middleware in front of the rank's API, its API processes and `afd up`'s front door. Keys are compared
as SHA-256 digests with `hmac.compare_digest`, against every configured key, so neither a key's length nor how
much of it matched shows in the time taken. A refusal is a 401 in OpenAI's error format."""

from __future__ import annotations

import hashlib
import hmac
import os

from afd.config import AFDConfig
from afd.server.api.protocol import error_response

OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})  # probes and scrapes: never a key
REFUSAL = "missing or invalid API key: send `Authorization: Bearer <key>`"


class ApiKeys:
    """The keys a request may carry (none: every request passes)."""

    def __init__(self, keys: tuple[str, ...] | list[str] = ()):
        self._digests = tuple(_digest(key) for key in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries one of the keys (always true with none)."""
        if not self._digests:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        offered = _digest(token.strip())
        matched = False
        for digest in self._digests:  # every key compared: the time does not say which one matched
            matched |= hmac.compare_digest(digest, offered)
        return matched and scheme.lower() == "bearer"


def bearer(keys: tuple[str, ...]) -> dict[str, str]:
    """The header our own calls to the API send: the first key of `keys`, or none."""
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def env_bearer() -> dict[str, str]:
    """The header for a client of an API started with this environment's `AFD_API_KEY` (benches), or none."""
    return bearer(AFDConfig(api_key=os.environ.get("AFD_API_KEY", "")).api_keys)


def guarded(path: str) -> bool:
    """Whether a request to `path` must carry a key: all but the probes and `/metrics`."""
    return path not in OPEN_PATHS


class RequireApiKey:
    """ASGI middleware: a request to a guarded path without one of `keys` gets 401 and never reaches `app`."""

    def __init__(self, app, keys: ApiKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys and guarded(scope["path"]) and scope["method"] != "OPTIONS":
            authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not self.keys.allows(authorization):
                response = error_response(401, REFUSAL)
                response.headers["WWW-Authenticate"] = "Bearer"
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
