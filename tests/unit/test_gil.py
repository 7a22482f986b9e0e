"""workers/gil.py: the worker's switch interval, online and while bulk batches run (an injected clock)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from workers import gil


def _reset() -> None:
    gil._short = False
    gil._bulk_seen_us = 0


@pytest.fixture(autouse=True)
def _interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    _reset()  # an earlier test of this process may have run a bulk batch in a worker loop
    yield
    sys.setswitchinterval(before)
    _reset()


def test_online_then_bulk_then_online_again_a_second_after_the_last_bulk_batch() -> None:
    gil.serving()
    assert sys.getswitchinterval() == pytest.approx(gil.ONLINE_INTERVAL_S)
    gil.batch_started(bulk=True, now_us=10_000_000)
    assert sys.getswitchinterval() == pytest.approx(gil.BULK_INTERVAL_S)
    gil.batch_started(bulk=False, now_us=10_000_000 + gil.IDLE_AFTER_US)  # a bulk batch a second ago: kept
    assert sys.getswitchinterval() == pytest.approx(gil.BULK_INTERVAL_S)
    gil.batch_started(bulk=False, now_us=10_000_001 + gil.IDLE_AFTER_US)
    assert sys.getswitchinterval() == pytest.approx(gil.ONLINE_INTERVAL_S)
