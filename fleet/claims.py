"""How long a pending message may sit idle before another worker takes it over (XAUTOCLAIM).

A live worker refreshes the messages it holds every `keepalive_s` (XCLAIM JUSTID to itself, which
resets their idle time without counting a delivery), so only a dead or frozen worker's messages ever
grow idle. The claim timeout must still outlast anything that can delay a refresh, and the longest of
those is a batch execution hogging the interpreter: so it follows the model's observed execution time.
Pure: fed execution times, it answers the timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

# A recorded longest execution decays by this factor per observed batch, so one slow warm-up batch does
# not set the timeout forever while a model that is always slow keeps a long one.
DECAY = 0.99


@dataclass
class ClaimTimeout:
    floor_ms: int = 3000  # never shorter: several keepalive rounds
    ceiling_ms: int = 600_000
    factor: float = 4.0  # this many times the longest recent execution
    fixed_ms: int = 0  # > 0: configured by the operator, observation ignored
    _longest_ms: float = 0.0

    def observe(self, execution_ms: float) -> None:
        self._longest_ms = max(execution_ms, self._longest_ms * DECAY)

    @property
    def idle_ms(self) -> int:
        if self.fixed_ms > 0:
            return self.fixed_ms
        return int(min(self.ceiling_ms, max(self.floor_ms, self.factor * self._longest_ms)))
