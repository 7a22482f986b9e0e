"""Every Redis key fleet uses (design.md, "Redis layout"), built from the configurable prefix.

A model's keys share the hash tag `{<model>}` so a Redis Cluster puts them on one shard.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "workers"  # the consumer group every worker joins on every model stream


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "fleet"

    def queue(self, model: str, lane: int = 0) -> str:
        return f"{self.prefix}:{{{model}}}:q:{lane}"

    def dead(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:dead"

    def stats(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:stats"

    def reply(self, gateway_id: str) -> str:
        return f"{self.prefix}:reply:{gateway_id}"

    def job_results(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:results"

    def models(self) -> str:
        return f"{self.prefix}:models"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def worker_pattern(self) -> str:
        return f"{self.prefix}:worker:*"

    def control(self) -> str:
        return f"{self.prefix}:control"
