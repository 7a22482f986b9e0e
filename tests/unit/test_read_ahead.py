"""A worker reads three batches a model instance ahead: the one executing, the one staged behind it, and the
next, read while the first computes (bench/RESULTS.md, stop 65: with two, a GPU-like model's instance found no
batch staged after half its short batches, and served 0.80x the rows a second)."""

from __future__ import annotations

from batching.holding import Holding
from fleet.settings import Settings
from workers.loop_config import LoopConfig


def test_the_worker_reads_as_far_ahead_as_the_settings_say() -> None:
    assert Settings().read_ahead_batches == LoopConfig().read_ahead_batches == 3


def test_the_next_batch_is_read_while_one_computes_and_one_is_staged() -> None:
    holding = Holding(lanes=2, per_batch=4, capacity=4 * LoopConfig().read_ahead_batches)
    holding.hold((1, b"1-0"), 4)  # computing
    holding.hold((1, b"2-0"), 4)  # staged behind it
    assert holding.room(1) == 4  # the next batch: read now, not once the first is answered
