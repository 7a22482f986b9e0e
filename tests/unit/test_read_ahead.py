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


def test_packed_bulk_messages_are_read_ahead_as_batches_are() -> None:
    """A bulk job's packed requests (four batches each, run in parts: workers/request_parts.py) count as one
    batch each: three are held, not one alone that leaves nothing staged behind it."""
    holding = Holding(lanes=2, per_batch=4, capacity=4 * 3)
    holding.hold((1, b"1-0"), 16)  # computing
    assert holding.room(1) == 32 and holding.messages_to_read(1, holding.room(1)) == 2
    holding.hold((1, b"2-0"), 16)
    holding.hold((1, b"3-0"), 16)
    assert holding.room(1) == 0
    assert holding.room(0) == 4  # a higher lane: as when the bulk lane holds its bound in rows (12), no less
    holding.hold((0, b"9-0"), 4)
    assert holding.room(0) == 0 and holding.room(1) == -4
    holding.release([(0, b"9-0"), (1, b"2-0"), (1, b"3-0")])
    assert holding.room(0) == 4  # and no more: not scaled for online requests (12 + 4 - 12)
    holding.release([(1, b"1-0")])
    holding.hold((1, b"4-0"), 4)  # a job that does not pack: as before
    assert holding.room(1) == 8


def test_online_rows_count_until_their_replies_are_written() -> None:
    """What a packed bulk request gives way to between its parts (workers/dispatch.py `_online_held`)."""
    holding = Holding(lanes=3, per_batch=4, capacity=12)
    holding.hold((2, b"1-0"), 16)
    assert holding.online_rows() == 0
    holding.hold((0, b"2-0"), 1)
    holding.hold((1, b"3-0"), 2)
    assert holding.online_rows() == 3
    holding.answered([(0, b"2-0"), (1, b"3-0")])  # replies written, not yet acknowledged
    assert holding.online_rows() == 0
