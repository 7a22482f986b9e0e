"""fleet/cancellation.py and its use by the supervisor: a cancellation that library code turns into an
error (redis-py does, while it connects or reads) still stops a task, and a stop never waits for ever."""

from __future__ import annotations

import asyncio
import logging

import pytest

from fleet.cancellation import cancel_and_wait, raise_if_cancelled
from fleet.supervision import Supervisor


class ConvertedCancellation(ConnectionError):
    """What redis-py raises in place of a CancelledError that lands inside it."""


async def swallowing_call() -> None:
    """A call that turns its cancellation into an error, as redis-py's connect and read paths can."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        raise ConvertedCancellation("Connection reset") from None


def test_a_retry_loop_that_checks_stops_on_the_first_cancellation() -> None:
    attempts = 0

    async def retry_loop() -> None:
        nonlocal attempts
        while True:
            attempts += 1
            try:
                await swallowing_call()
            except ConnectionError:
                raise_if_cancelled()

    async def main() -> None:
        task = asyncio.create_task(retry_loop())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        assert task.cancelled()

    asyncio.run(main())
    assert attempts == 1


def test_outside_a_cancellation_the_check_lets_the_error_be_handled() -> None:
    async def main() -> None:
        raise_if_cancelled()  # nothing pending: returns

    asyncio.run(main())


def test_cancel_and_wait_cancels_again_until_the_task_ends() -> None:
    cancellations = 0

    async def swallows_twice() -> None:
        nonlocal cancellations
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancellations += 1
                if cancellations == 3:
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # as wait_for's 3.11 race does

    async def main() -> None:
        task = asyncio.create_task(swallows_twice())
        await asyncio.sleep(0.01)
        await cancel_and_wait([task], "test", wait_s=2.0)
        assert task.cancelled()

    asyncio.run(main())
    assert cancellations == 3


def test_cancel_and_wait_gives_up_after_its_bound(caplog: pytest.LogCaptureFixture) -> None:
    released = False

    async def never_stops() -> None:
        while not released:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]

    async def main() -> None:
        task = asyncio.create_task(never_stops())
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with caplog.at_level(logging.WARNING, logger="fleet.cancellation"):
            await cancel_and_wait([task], "stubborn", wait_s=0.3)
        assert loop.time() - started < 1.0
        assert not task.done()
        nonlocal released
        released = True  # let asyncio.run's own cancellation end it
        task.cancel()

    asyncio.run(main())
    assert "stubborn: 1 task(s) did not stop" in caplog.text


def test_a_supervised_task_whose_cancellation_became_an_error_is_not_restarted() -> None:
    starts = 0

    async def reader() -> None:
        nonlocal starts
        starts += 1
        await swallowing_call()

    async def main() -> None:
        supervisor = Supervisor("test")
        task = supervisor.start("reader", reader)
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        assert task.cancelled(), "the supervisor restarted a task that was being stopped"
        assert supervisor.failures == []

    asyncio.run(main())
    assert starts == 1
