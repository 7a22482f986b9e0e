"""The pure parts of recovery: reconnect backoff, the claim timeout derived from execution times, and the
watchdog's decisions on a fake clock."""

from __future__ import annotations

import pytest

from fleet.backoff import Backoff
from fleet.claims import DECAY, ClaimTimeout


def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    b = Backoff(base_s=0.05, cap_s=1.0, jitter=lambda: 0.999999)  # ~the nominal delay
    delays = [round(b.next_delay(), 3) for _ in range(8)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    b.reset()
    assert round(b.next_delay(), 3) == 0.05


def test_backoff_jitter_spreads_peers_between_half_and_all_of_the_delay() -> None:
    low, high = Backoff(jitter=lambda: 0.0), Backoff(jitter=lambda: 0.999999)
    for _ in range(10):
        lo, hi = low.next_delay(), high.next_delay()
        assert lo == pytest.approx(hi / 2, rel=1e-5)
    assert high.next_delay() <= high.cap_s


def test_claim_timeout_has_a_floor_and_follows_slow_models() -> None:
    t = ClaimTimeout(floor_ms=3000, factor=4.0)
    assert t.idle_ms == 3000  # nothing observed yet
    t.observe(5.0)
    assert t.idle_ms == 3000  # fast model: the floor (several keepalive rounds)
    t.observe(2000.0)
    assert t.idle_ms == 8000  # 4x the longest recent batch


def test_claim_timeout_forgets_one_slow_batch_gradually_and_has_a_ceiling() -> None:
    t = ClaimTimeout(floor_ms=1000, factor=4.0, ceiling_ms=60_000)
    t.observe(1000.0)
    for _ in range(100):
        t.observe(1.0)
    assert t.idle_ms == int(4 * 1000 * DECAY ** 100)
    t.observe(10 ** 6)
    assert t.idle_ms == 60_000


def test_a_configured_claim_timeout_wins() -> None:
    t = ClaimTimeout(floor_ms=3000, fixed_ms=500)
    t.observe(10_000.0)
    assert t.idle_ms == 500


class _Backend:
    takes_wire = False
    interruptible = False
    runs_inline = False
    alive = True

    def execute(self, items: list[object]) -> list[object]:
        return []

    def revive(self) -> bool:
        return True

    def kill(self) -> None:
        raise AssertionError("an uninterruptible backend is never killed")

    def close(self) -> None:
        pass


class _KillableBackend(_Backend):
    interruptible = True

    def __init__(self) -> None:
        self.kills = 0

    def kill(self) -> None:
        self.kills += 1


def _watch(backend: _Backend, hung: list[object]) -> tuple[int, object]:
    """Drive the watchdog on a fake monotonic clock: a batch running past the limit, then ending."""
    from concurrent.futures import ThreadPoolExecutor

    from workers.instance import Instance
    from workers.watchdog import Watchdog

    instance = Instance("m_0", backend, ThreadPoolExecutor(1))  # type: ignore[arg-type]
    changes = [0]

    def health_changed() -> None:
        changes[0] += 1

    dog = Watchdog("m", [instance], watchdog_s=0.2, on_hung=hung.append, on_health=health_changed)
    instance.running_since = 100.0
    dog.check(100.1)
    assert dog.hung == set() and dog.healthy  # within the limit
    dog.check(100.3)
    assert dog.hung == {instance} and not dog.healthy
    dog.check(100.35)  # still running, not yet another limit since the kill
    instance.running_since = None  # the batch ended (killed, or it finally returned)
    dog.check(100.4)
    assert dog.hung == set() and dog.healthy
    instance.executor.shutdown()
    return changes[0], instance


def test_the_watchdog_kills_a_hung_instance_it_can_and_readvertises_it_after() -> None:
    backend = _KillableBackend()
    hung: list[object] = []
    changes, _ = _watch(backend, hung)
    assert backend.kills == 1 and hung == []  # killed in place: the worker lives on
    assert changes == 2  # not advertised, then advertised again


def test_the_watchdog_hands_an_uninterruptible_instance_to_on_hung_once() -> None:
    hung: list[object] = []
    changes, instance = _watch(_Backend(), hung)
    assert hung == [instance]  # main.py's handler exits the worker for its supervisor
    assert changes == 2
