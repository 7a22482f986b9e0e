"""How often a worker folds its model's statistics log (fleet/stats.py fold_delay): pure, no clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fleet.stats import FOLD_CHUNK, FOLD_IDLE_S, FOLD_MIN_S, fold_delay


def test_a_full_fold_folds_on_at_once_and_an_empty_one_waits_the_idle_interval() -> None:
    assert fold_delay(FOLD_CHUNK, 0.5) == 0.0
    assert fold_delay(FOLD_CHUNK + 1, 0.0) == 0.0
    assert fold_delay(0, 0.3) == FOLD_IDLE_S
    assert fold_delay(5, 0.0) == FOLD_IDLE_S  # no time to measure a rate over


def test_the_delay_follows_the_rate_the_log_grew_at() -> None:
    # 1,100 batches a second (mlp under Poisson arrivals at 2,000 requests a second): half a chunk's worth.
    assert abs(fold_delay(110, 0.1) - FOLD_CHUNK / 2 / 1100) < 1e-12
    assert fold_delay(1, 10.0) == FOLD_IDLE_S  # a trickle: once a second at least
    assert fold_delay(FOLD_CHUNK - 1, 0.001) == FOLD_MIN_S  # fast, but not a full chunk: not a busy loop


@given(folded=st.integers(1, FOLD_CHUNK - 1), elapsed=st.floats(1e-6, 100.0))
def test_a_steady_rate_gives_folds_of_at_most_half_a_chunk_unless_the_delay_is_at_a_bound(
        folded: int, elapsed: float) -> None:
    delay = fold_delay(folded, elapsed)
    assert FOLD_MIN_S <= delay <= FOLD_IDLE_S
    if FOLD_MIN_S < delay < FOLD_IDLE_S:
        assert abs(folded / elapsed * delay - FOLD_CHUNK / 2) < 1e-6 * FOLD_CHUNK
    elif delay == FOLD_IDLE_S:
        assert folded / elapsed * delay <= FOLD_CHUNK / 2 * (1 + 1e-9)
