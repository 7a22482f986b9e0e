"""The pure parts of recovery: reconnect backoff and the claim timeout derived from execution times."""

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
