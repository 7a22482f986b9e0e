"""workers/instance.py's staged batch against its real thread: replaced while the thread computes, refused
once the thread has taken it; and which backends let the scheduler stage partial batches."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from batching.plan import Batch
from fleet.model_config import parse_config
from tests.support.model_repo import TRITON_EXAMPLES
from workers.backends import load_backend
from workers.backends.base import LoadContext
from workers.execute import BatchOutcome
from workers.instance import Callbacks, Instance, Job
from workers.loop_config import DEFAULT_LOOP_CONFIG, policy_for, scheduler_config

from .test_sleep_backend import sleep_spec


def test_a_staged_job_is_replaced_until_the_thread_takes_it() -> None:
    release_first = threading.Event()
    ran: list[str] = []

    def job(name: str, wait: threading.Event | None = None) -> Job:
        def run() -> BatchOutcome:
            if wait is not None:
                assert wait.wait(5)
            ran.append(name)
            return None  # type: ignore[return-value]  # the outcome is the driver's business, not tested here
        return Job(1, Batch(len(ran), ()), run)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        idle = asyncio.Event()
        callbacks = Callbacks(done=lambda *_: None, idle=lambda _: idle.set(), refused=lambda _: None,
                              custody_fresh=lambda: True)
        with ThreadPoolExecutor(1) as executor:
            instance = Instance("m_0", load_backend(LoadContext(spec=sleep_spec("0", "0"), model_dir=Path("."),
                                                                version=1, instance_name="m_0", device="cpu")),
                                executor)
            instance.start(job("first", release_first), loop, callbacks)
            small, grown, late = job("small"), job("grown"), job("late")
            assert instance.stage(small)
            assert instance.restage(small, grown)  # "first" is handed over (or computing): busy either way
            assert not instance.restage(small, late)  # "small" is no longer the staged one
            release_first.set()
            await asyncio.wait_for(idle.wait(), 5)
            assert not instance.restage(grown, late)  # the thread took "grown"
        assert ran == ["first", "grown"]

    asyncio.run(scenario())


def test_only_instances_that_leave_the_host_cpu_alone_stage_partial_batches() -> None:
    spec = sleep_spec()
    sleep = load_backend(LoadContext(spec=spec, model_dir=Path("."), version=1, instance_name="s_0", device="cpu"))
    assert sleep.host_bound is False  # time.sleep, as a GPU seen from the host
    simple = TRITON_EXAMPLES / "simple"  # Triton's example ONNX model, on this CPU worker
    onnx = load_backend(LoadContext(spec=parse_config((simple / "config.pbtxt").read_text(), source="simple",
                                                      model_name="simple"),
                                    model_dir=simple, version=1, instance_name="simple_0", device="cpu"))
    assert onnx.host_bound is True
    policy = policy_for(spec)
    assert scheduler_config(spec, policy, 1, DEFAULT_LOOP_CONFIG, host_bound=False).stage_partial
    assert not scheduler_config(spec, policy, 1, DEFAULT_LOOP_CONFIG).stage_partial
