"""The HTTP edge's limits (from Settings) and the one way it answers an error: a JSON `{"error": ...}`
response that closes the connection. Used by gateway/http_protocol.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus

from fleet.settings import Settings


@dataclass(frozen=True)
class EdgeLimits:
    max_head_bytes: int
    body_limit: int  # one body (not an upload); a body the budget could never hold is too large, not "retry"
    max_upload_bytes: int
    max_in_flight_bytes: int
    read_timeout_s: float
    header_timeout_max_s: float
    min_rate_bps: int

    @classmethod
    def from_settings(cls, settings: Settings) -> EdgeLimits:
        return cls(settings.max_header_bytes, min(settings.max_input_bytes, settings.max_in_flight_bytes),
                   settings.max_upload_bytes, settings.max_in_flight_bytes, settings.read_timeout_s,
                   settings.header_timeout_max_s, settings.read_min_rate_bps)


class BodyBudget:
    """The request-body bytes one process holds (gateway/http_protocol.py says what counts)."""

    def __init__(self) -> None:
        self.held = 0


class Refused(Exception):
    """Raised in a parser callback: the parser stops, the request is answered `status`, the connection
    closed."""

    def __init__(self, status: int, message: str, retry_after: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


def error_answer(status: int, message: str, retry_after: bool = False) -> bytes:
    """A whole HTTP/1.1 response: `{"error": message}` as JSON, closing the connection."""
    body = json.dumps({"error": message}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n"
            b"%s\r\n%s" % (status, HTTPStatus(status).phrase.encode(), len(body),
                           b"retry-after: 1\r\n" if retry_after else b"", body))
