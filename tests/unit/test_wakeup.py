"""workers/wakeup.py: the driver's wake-up keeps a set() made after its clear(), so one made while the
driver carries out a plan is never lost (the driver clears before it looks at its schedulers)."""

from __future__ import annotations

import asyncio
import time

from workers.wakeup import Wakeup


def test_a_set_after_clear_ends_the_next_wait_at_once() -> None:
    async def main() -> None:
        wake = Wakeup("t")
        try:
            wake.clear()
            wake.set()  # while the driver carried out its plan
            started = time.monotonic()
            await asyncio.wait_for(wake.wait(None), 5)
            await asyncio.wait_for(wake.wait(0.5), 5)  # still set: a timed wait ends at once too
            assert time.monotonic() - started < 0.4
        finally:
            wake.close()

    asyncio.run(main())


def test_clear_forgets_earlier_sets_and_a_wait_ends_at_a_set_or_its_timeout() -> None:
    async def main() -> None:
        wake = Wakeup("t")
        try:
            wake.set()
            wake.clear()
            started = time.monotonic()
            await wake.wait(0.05)  # nothing set since the clear: the timeout ends it
            assert time.monotonic() - started >= 0.04
            waiting = asyncio.ensure_future(wake.wait(None))
            await asyncio.sleep(0.01)
            assert not waiting.done()
            wake.set()
            await asyncio.wait_for(waiting, 5)
        finally:
            wake.close()

    asyncio.run(main())


def test_a_wait_already_due_returns_at_once() -> None:
    """The driver waits until its next timer from after carrying out its plans: one already past is a
    zero or negative timeout, which must not block."""
    async def main() -> None:
        wake = Wakeup("t")
        try:
            wake.clear()
            await asyncio.wait_for(wake.wait(0.0), 1)
            await asyncio.wait_for(wake.wait(-0.001), 1)
        finally:
            wake.close()

    asyncio.run(main())
