"""Capped exponential backoff with jitter, for every loop that retries Redis after a failure.

A fixed retry interval either hammers a restarting server (hundreds of processes reconnecting in step)
or waits too long after a blip; doubling from a small base up to a cap, with jitter, does neither.
Pure: the random source is injected, so tests see exact delays.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Backoff:
    base_s: float = 0.05
    cap_s: float = 2.0
    factor: float = 2.0
    # In [0, 1): the delay is scaled into [1/2, 1) of the nominal one, so peers drift apart.
    jitter: Callable[[], float] = field(default=random.random)
    attempt: int = 0

    def next_delay(self) -> float:
        nominal = min(self.cap_s, self.base_s * self.factor ** self.attempt)
        if nominal < self.cap_s:
            self.attempt += 1
        return nominal * (0.5 + 0.5 * self.jitter())

    def reset(self) -> None:
        self.attempt = 0
