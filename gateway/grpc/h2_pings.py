"""gRPC's keepalive and ping policy for one HTTP/2 connection, on an injected clock (the channel args
tritonserver exposes as --grpc-keepalive-* and --grpc-http2-*).

- The server's own keepalive: a PING after `keepalive_time` without anything received, only while
  calls are open (or `keepalive_permit_without_calls`), at most `max_pings_without_data` in a row
  without data sent between (0: no limit); unanswered for `keepalive_timeout`, the connection is dead.
- The peer's pings: without calls (unless permitted) a client may ping every 2 hours; with them, every
  `min_recv_ping_interval_without_data` while the server sends nothing. Each earlier ping is a strike;
  past `max_ping_strikes` the connection ends with GOAWAY ENHANCE_YOUR_CALM "too_many_pings".
  Sending headers or data starts the count again.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.grpc.h2_frames import LocalSettings

IDLE_PING_INTERVAL_S = 7200.0  # gRPC's minimum interval for pings on a connection without calls


class PingPolicy:
    def __init__(self, settings: LocalSettings, now: Callable[[], float]) -> None:
        self._s = settings
        self._now = now
        self._last_ping_recv: float | None = None
        self._strikes = 0
        self._pings_without_data = 0
        self.outstanding_since: float | None = None  # our keepalive PING awaiting its ACK
        self.last_activity = now()

    def received(self) -> None:
        self.last_activity = self._now()

    def sent_data(self) -> None:
        self._strikes = 0
        self._pings_without_data = 0
        self._last_ping_recv = None

    def peer_ping_allowed(self, calls_open: bool) -> bool:
        """Judge a PING from the peer; False once it has used up its strikes."""
        now = self._now()
        s = self._s
        interval = s.min_recv_ping_interval_without_data_s
        if not calls_open and not s.keepalive_permit_without_calls:
            interval = max(interval, IDLE_PING_INTERVAL_S)
        if self._last_ping_recv is not None and now - self._last_ping_recv < interval:
            self._strikes += 1
            if s.max_ping_strikes and self._strikes > s.max_ping_strikes:
                return False
        self._last_ping_recv = now
        return True

    def keepalive_due(self, calls_open: bool) -> bool:
        s = self._s
        if self.outstanding_since is not None:
            return False
        if not calls_open and not s.keepalive_permit_without_calls:
            return False
        if s.max_pings_without_data and self._pings_without_data >= s.max_pings_without_data:
            return False
        return self._now() - self.last_activity >= s.keepalive_time_s

    def pinged(self) -> None:
        self.outstanding_since = self._now()
        self._pings_without_data += 1

    def acknowledged(self) -> None:
        self.outstanding_since = None

    def expired(self) -> bool:
        since = self.outstanding_since
        return since is not None and self._now() - since >= self._s.keepalive_timeout_s
