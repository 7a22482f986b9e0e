"""Clock seam: epoch microseconds for times that cross processes (envelope enqueued_at/deadline)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_us(self) -> int: ...


class SystemClock:
    def now_us(self) -> int:
        return time.time_ns() // 1000
