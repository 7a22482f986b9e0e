"""Optional bearer-token auth in front of every route (ASGI middleware, outermost).

Keys come from settings (`FLEET_API_KEYS`, comma-separated) and/or a file (`FLEET_API_KEYS_FILE`, one
per line, `#` comments). Every route belongs to a scope: `/v2/health/*` is always open (probes),
`/v2/repository/*` is `control`, `/v2/jobs*` is `jobs`, everything else (inference, metadata, stats,
metrics) is `infer`. With keys, the scopes in `FLEET_AUTH_SCOPES` (default all three) need
`Authorization: Bearer <key>`; a wrong or missing key is a 401. Without keys, model control is off
(403) unless `FLEET_CONTROL_API` enables it, as Triton restricts its repository API.
Keys are compared in constant time against every configured key, so timing tells nothing.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.errors import InvalidInput, PermissionDenied, ServingError, Unauthenticated
from fleet.settings import Settings
from gateway.errors import status_for

SCOPES = frozenset({"infer", "control", "jobs"})
UNAUTHENTICATED = "missing or invalid API key (Authorization: Bearer <key>)"
CONTROL_DISABLED = ("model control is disabled: configure API keys (FLEET_API_KEYS) or enable it with "
                    "FLEET_CONTROL_API=1")


def load_keys(settings: Settings) -> list[bytes]:
    keys = [k.strip() for k in settings.api_keys.split(",") if k.strip()]
    if settings.api_keys_file is not None:
        try:
            lines = Path(settings.api_keys_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise InvalidInput(f"cannot read the API keys file {settings.api_keys_file}: {exc}") from exc
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return [k.encode() for k in keys]


def scope_of(path: str) -> str | None:
    """The auth scope of a request path; None = always open."""
    if path.startswith("/v2/health/"):
        return None
    if path.startswith("/v2/repository"):
        return "control"
    if path == "/v2/jobs" or path.startswith("/v2/jobs/"):
        return "jobs"
    return "infer"


class Access:
    """Who may call what: the key set and the protected scopes, shared by the HTTP gate and the gRPC
    service (gateway/grpc/handlers.py), so both protocols answer the same keys in the same scopes."""

    def __init__(self, settings: Settings) -> None:
        self.keys = load_keys(settings)
        scopes = {s.strip() for s in settings.auth_scopes.split(",") if s.strip()}
        unknown = scopes - SCOPES
        if unknown:
            raise InvalidInput(f"unknown auth scopes {sorted(unknown)}: use {sorted(SCOPES)}")
        self.protected = frozenset(scopes) if self.keys else frozenset()
        self.control_open = settings.control_api

    def allowed(self, header: bytes | None) -> bool:
        if header is None or not header[:7].lower() == b"bearer ":
            return False
        given = header[7:].strip()
        # Compare with every key (no early exit), each in constant time.
        return sum(hmac.compare_digest(given, key) for key in self.keys) > 0

    def guards(self, area: str | None) -> bool:
        """Whether a request in `area` (a scope; None = always open) is checked at all."""
        return area is not None and (area in self.protected or (area == "control" and not self.control_open))

    def check(self, area: str | None, header: bytes | None) -> None:
        """Raises Unauthenticated (no or a wrong key where one is needed) or PermissionDenied (model
        control without keys, unless enabled)."""
        if area is None:
            return
        if area in self.protected:
            if not self.allowed(header):
                raise Unauthenticated(UNAUTHENTICATED)
        elif area == "control" and not self.keys and not self.control_open:
            raise PermissionDenied(CONTROL_DISABLED)


class AuthGate:
    def __init__(self, app: ASGIApp, settings: Settings, access: Access | None = None) -> None:
        """`access`: the process's own, if it has one already (the HTTP protocol's infer path shares it)."""
        self.app = app
        self.access = access if access is not None else Access(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        area = scope_of(scope["path"])
        if self.access.guards(area):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                self.access.check(area, header)
            except ServingError as exc:
                extra = [(b"www-authenticate", b'Bearer realm="fleet"')] if isinstance(exc, Unauthenticated) else None
                await _deny(send, status_for(exc.code), exc.message, extra)
                return
        await self.app(scope, receive, send)


async def _deny(send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *(extra or [])]})
    await send({"type": "http.response.body", "body": body})
