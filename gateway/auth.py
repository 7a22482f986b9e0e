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

from fleet.errors import InvalidInput
from fleet.settings import Settings

SCOPES = frozenset({"infer", "control", "jobs"})


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


class AuthGate:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        area = scope_of(scope["path"])
        if area is not None:
            if area in self.protected:
                header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
                if not self.allowed(header):
                    await _deny(send, 401, "missing or invalid API key (Authorization: Bearer <key>)",
                                [(b"www-authenticate", b'Bearer realm="fleet"')])
                    return
            elif area == "control" and not self.keys and not self.control_open:
                await _deny(send, 403, "model control is disabled: configure API keys (FLEET_API_KEYS) "
                                       "or enable it with FLEET_CONTROL_API=1")
                return
        await self.app(scope, receive, send)


async def _deny(send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *(extra or [])]})
    await send({"type": "http.response.body", "body": body})
