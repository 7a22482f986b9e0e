"""The stub's end of its pipe (workers/backends/stub_channel.py), over real pipes: the stub's main loop reads
the worker's calls itself and hands on the BLS replies that come meanwhile; a BLS call made while it does
not read starts a reader thread; a pipe the worker closes answers every BLS call, pending or later."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from workers.backends.frames import LENGTH, pack, read_frame, write_frame
from workers.backends.python_stub import PIPE_READ_BUFFER
from workers.backends.stub_channel import StubChannel


@pytest.fixture
def ends() -> Iterator[tuple[StubChannel, Any, Any]]:
    """(the stub's channel, the worker's writing end, the worker's reading end)"""
    to_stub_r, to_stub_w = os.pipe()
    from_stub_r, from_stub_w = os.pipe()
    # Buffered as main() opens it.
    channel = StubChannel(os.fdopen(to_stub_r, "rb", buffering=PIPE_READ_BUFFER), os.fdopen(from_stub_w, "wb"))
    worker_out, worker_in = os.fdopen(to_stub_w, "wb"), os.fdopen(from_stub_r, "rb", buffering=0)
    yield channel, worker_out, worker_in
    worker_out.close()  # a reader thread, if one runs, sees the pipe close and ends
    if channel._reader is not None:  # noqa: SLF001
        channel._reader.join(5)  # noqa: SLF001
    for f in (worker_in, channel._in, channel._out):  # noqa: SLF001
        f.close()


def _readers() -> int:
    return sum(t.name == "stub-reader" for t in threading.enumerate())


def test_the_main_loop_reads_and_hands_a_model_threads_bls_reply_on(ends: tuple[StubChannel, Any, Any]) -> None:
    channel, worker_out, worker_in = ends
    readers = _readers()
    write_frame(worker_out, {"op": "execute", "requests": []})
    assert channel.next_op() == {"op": "execute", "requests": []}
    # A thread of the model's calls between calls, while the main loop waits for the worker's next call.
    replies: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    op: list[dict[str, Any] | None] = []
    main = threading.Thread(target=lambda: op.append(channel.next_op()))
    main.start()
    while not channel._main_reading:  # noqa: SLF001 - the moment this test is about
        threading.Event().wait(0.001)
    n = channel.call({"op": "bls", "req": {}}, replies.put)
    assert read_frame(worker_in)["n"] == n
    write_frame(worker_out, {"op": "bls_reply", "n": n, "final": True, "o": []})
    assert replies.get(timeout=5) == {"op": "bls_reply", "n": n, "final": True, "o": []}  # handed on by main
    write_frame(worker_out, {"op": "finalize"})
    main.join(5)
    assert op == [{"op": "finalize"}] and _readers() == readers  # no reader thread was needed


def test_frames_the_main_loop_read_ahead_reach_the_reader_it_starts(ends: tuple[StubChannel, Any, Any]) -> None:
    channel, worker_out, worker_in = ends
    execute, finalize = pack({"op": "execute", "requests": []}), pack({"op": "finalize"})
    worker_out.write(LENGTH.pack(len(execute)) + execute + LENGTH.pack(len(finalize)) + finalize)  # one write
    worker_out.flush()
    assert channel.next_op() == {"op": "execute", "requests": []}  # its buffered read took the finalize too
    replies: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    n = channel.call({"op": "bls", "req": {}}, replies.put)  # as execute() would: a reader starts
    assert read_frame(worker_in)["n"] == n
    write_frame(worker_out, {"op": "bls_reply", "n": n, "final": True})
    assert replies.get(timeout=5)["n"] == n
    assert channel.next_op() == {"op": "finalize"}  # the reader had it from the shared buffer first


def test_a_bls_call_while_the_main_loop_does_not_read_starts_a_reader(ends: tuple[StubChannel, Any, Any]) -> None:
    channel, worker_out, worker_in = ends
    readers = _readers()
    replies: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    n = channel.call({"op": "bls", "req": {}}, replies.put)  # as execute() would: the main loop is busy
    assert _readers() == readers + 1
    assert read_frame(worker_in)["n"] == n
    write_frame(worker_out, {"op": "bls_reply", "n": n, "final": True})
    assert replies.get(timeout=5)["n"] == n
    write_frame(worker_out, {"op": "execute", "requests": []})
    assert channel.next_op() == {"op": "execute", "requests": []}  # through the reader from now on


def test_a_pipe_closed_under_the_main_loops_read_answers_every_bls_call(ends: tuple[StubChannel, Any, Any]) -> None:
    channel, worker_out, worker_in = ends
    pending: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    op: list[dict[str, Any] | None] = []
    main = threading.Thread(target=lambda: op.append(channel.next_op()))
    main.start()
    while not channel._main_reading:  # noqa: SLF001
        threading.Event().wait(0.001)
    channel.call({"op": "bls", "req": {}}, pending.put)  # a model thread's, answered by the main loop's reads
    worker_out.close()  # the worker goes (closing it again at teardown does nothing)
    main.join(5)
    assert op == [None]
    assert pending.get(timeout=5)["e"][0] == "UNAVAILABLE"
    later: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    channel.call({"op": "bls", "req": {}}, later.put)
    assert later.get(timeout=5)["e"][0] == "UNAVAILABLE"  # and so is any call made after
