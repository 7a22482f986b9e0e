"""Triton's rate limiter (`--rate-limit execution_count`): an instance executes a batch only while it
holds the resources its instance group's `rate_limiter` names; waiting instances go by priority (a
lower value first), then in arrival order.

* Local resources belong to this worker (one pool per worker process, which is one device). Their
  count is `--rate-limit-resource NAME:COUNT[:DEVICE]` when given, else the most any instance here
  asks for (Triton's rule), so a resource an instance needs is never impossible.
* Global resources (`global: true`) are fleet-wide: a Redis semaphore shared by every worker. A holder
  is a lease (a member of a sorted set scored by expiry) renewed by this worker's renewer thread
  while it holds it; a worker that dies stops renewing, and its leases lapse within LEASE_S, so a
  dead worker cannot leak a resource. The count is the flag's, else the most any instance here asks
  for: give every worker the same `--rate-limit-resource` for a global resource.

Instances wait for resources on their own threads (workers/instance.py), before their batch counts as
running, so the watchdog never mistakes waiting for a hang. Global resources are taken first (in name
order), then local ones, and released together. Priority is strict among instances that fit (fleet's
choice; Triton weights priorities instead), and a waiter that does not fit never blocks one that does.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from fleet.errors import ConfigError
from fleet.model_spec import InstanceLimit, ResourceNeed

log = logging.getLogger(__name__)

LEASE_S = 10.0
POLL_MIN_S, POLL_MAX_S = 0.001, 0.02

# Takes `count` of a global resource if the leases that have not lapsed leave room. Times are Redis's
# (TIME), so workers' clocks never disagree about a lease.
# KEYS[1] = holders (zset: member -> lease expiry ms), KEYS[2] = counts (hash: member -> count).
# ARGV = member, count, capacity, lease ms.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, member in ipairs(lapsed) do
  redis.call('ZREM', KEYS[1], member)
  redis.call('HDEL', KEYS[2], member)
end
local held = 0
for _, n in ipairs(redis.call('HVALS', KEYS[2])) do held = held + tonumber(n) end
if held + tonumber(ARGV[2]) > tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[1])
return 1
"""
# Renews a lease this holder still has (XX: a lapsed one is not revived). ARGV = member, lease ms.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
"""


def parse_resource_flags(flags: Iterable[str], device: str) -> dict[str, int]:
    """`--rate-limit-resource NAME:COUNT[:DEVICE]` values that apply to this worker's device."""
    out: dict[str, int] = {}
    for flag in flags:
        parts = flag.split(":", 2)  # the device may be "0" (Triton: a GPU index) or "cuda:0"
        if len(parts) not in (2, 3) or not parts[0]:
            raise ConfigError(f"--rate-limit-resource {flag}: expected NAME:COUNT[:DEVICE]")
        try:
            count = int(parts[1])
        except ValueError:
            raise ConfigError(f"--rate-limit-resource {flag}: COUNT must be a number") from None
        if len(parts) == 3 and parts[2] not in (device, device.removeprefix("cuda:")):
            continue
        out[parts[0]] = count
    return out


@dataclass(frozen=True, slots=True)
class Held:
    """What one execution holds, to be released."""

    local: tuple[ResourceNeed, ...]
    global_members: tuple[tuple[str, str], ...]  # (resource name, lease member)


class RateLimiter:
    def __init__(self, flags: dict[str, int], client: redis.Redis | None, prefix: str, worker_id: str) -> None:
        self._flags = flags
        self._capacity: dict[str, int] = dict(flags)
        self._global_capacity: dict[str, int] = dict(flags)
        self._in_use: dict[str, int] = {}
        self._cond = threading.Condition()
        self._waiting: list[tuple[int, int, tuple[ResourceNeed, ...]]] = []  # (priority, arrival, local needs)
        self._arrivals = itertools.count()
        self._client = client
        self._prefix = prefix
        self._worker_id = worker_id
        self._leases: dict[str, str] = {}  # member -> resource name, renewed while held
        self._leases_lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        if client is not None:
            self._acquire_script = client.register_script(_ACQUIRE)
            self._renew_script = client.register_script(_RENEW)

    def register(self, limits: Sequence[InstanceLimit]) -> None:
        """An instance's needs raise the default count of each resource it names (Triton's rule)."""
        with self._cond:
            for limit in limits:
                for need in limit.resources:
                    table = self._global_capacity if need.is_global else self._capacity
                    if need.name not in self._flags:
                        table[need.name] = max(table.get(need.name, 0), need.count)
                    if need.count > table[need.name]:
                        raise ConfigError(f"rate limiter resource '{need.name}': an instance needs {need.count} "
                                          f"but --rate-limit-resource makes {table[need.name]} available")
                    if need.is_global and self._client is None:
                        raise ConfigError(f"global rate limiter resource '{need.name}' needs Redis")

    def _keys(self, name: str) -> list[str]:
        return [f"{self._prefix}:{{ratelimit}}:{name}:holders", f"{self._prefix}:{{ratelimit}}:{name}:counts"]

    # ------------------------------------------------------------------ acquire / release (instance threads)

    def acquire(self, limit: InstanceLimit) -> Held:
        """Block until every resource of `limit` is held. Global resources are taken in name order, so
        two instances needing the same ones never each hold what the other waits for."""
        taken: list[tuple[str, str]] = []
        try:
            for need in sorted((n for n in limit.resources if n.is_global), key=lambda n: n.name):
                taken.append(self._acquire_global(need))
        except BaseException:
            self._release_global(tuple(taken))
            raise
        members = tuple(taken)
        local = tuple(need for need in limit.resources if not need.is_global)
        if local:
            with self._cond:
                entry = (limit.priority, next(self._arrivals), local)
                self._waiting.append(entry)
                try:
                    self._cond.wait_for(lambda: self._stop.is_set() or self._first_that_fits() is entry)
                finally:
                    self._waiting.remove(entry)
                if self._stop.is_set():
                    self._release_global(members)
                    raise RuntimeError("the worker is stopping: rate limiter resources are no longer given out")
                for need in local:
                    self._in_use[need.name] = self._in_use.get(need.name, 0) + need.count
                self._cond.notify_all()  # the next waiter may fit too
        return Held(local, members)

    def release(self, held: Held) -> None:
        if held.local:
            with self._cond:
                for need in held.local:
                    self._in_use[need.name] -= need.count
                self._cond.notify_all()
        self._release_global(held.global_members)

    def _release_global(self, members: tuple[tuple[str, str], ...]) -> None:
        for name, member in members:
            with self._leases_lock:
                self._leases.pop(member, None)
            try:
                assert self._client is not None
                pipe = self._client.pipeline(transaction=True)
                keys = self._keys(name)
                pipe.zrem(keys[0], member)
                pipe.hdel(keys[1], member)
                pipe.execute()
            except redis.RedisError as exc:
                log.warning("cannot release global resource '%s' (its lease lapses in %g s): %s", name, LEASE_S, exc)

    def _fits(self, needs: tuple[ResourceNeed, ...]) -> bool:
        return all(self._in_use.get(n.name, 0) + n.count <= self._capacity.get(n.name, 0) for n in needs)

    def _first_that_fits(self) -> object:
        """The best-ranked waiter whose needs fit now (ranked by priority, then arrival)."""
        for entry in sorted(self._waiting, key=lambda e: (e[0], e[1])):
            if self._fits(entry[2]):
                return entry
        return None

    def _acquire_global(self, need: ResourceNeed) -> tuple[str, str]:
        member = f"{self._worker_id}:{uuid.uuid4().hex[:12]}"
        keys = self._keys(need.name)
        capacity = self._global_capacity.get(need.name, need.count)
        delay = POLL_MIN_S
        self._start_renewer()
        while not self._stop.is_set():
            try:
                if self._acquire_script(keys=keys, args=[member, need.count, capacity, int(LEASE_S * 1000)]):
                    with self._leases_lock:
                        self._leases[member] = need.name
                    return need.name, member
            except redis.RedisError as exc:
                log.warning("cannot take global resource '%s' yet: %s", need.name, exc)
                delay = POLL_MAX_S
            time.sleep(delay)
            delay = min(POLL_MAX_S, delay * 2)
        raise RuntimeError("the worker is stopping: rate limiter resources are no longer given out")

    # ------------------------------------------------------------------ leases

    def _start_renewer(self) -> None:
        with self._leases_lock:
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew_loop, name="rate-limit-leases", daemon=True)
                self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(LEASE_S / 4):
            with self._leases_lock:
                leases = dict(self._leases)
            for member, name in leases.items():
                try:
                    self._renew_script(keys=self._keys(name)[:1], args=[member, int(LEASE_S * 1000)])
                except redis.RedisError as exc:
                    log.warning("cannot renew the lease on global resource '%s': %s", name, exc)

    def close(self) -> None:
        """Stop giving out resources (waiting instances fail their batch) and renewing leases."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._client is not None:
            self._client.close()
