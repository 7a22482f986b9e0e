"""A Python-backend stub dies with its worker: a worker process killed with SIGKILL (no cleanup runs)
leaves no stub behind, even one busy in execute() (an idle stub would also see its pipe close)."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from bench.procs import children, running
from fleet.envelope import RequestEnvelope, WireTensor, encode_request
from fleet.keys import Keys
from fleet.model_config import parse_config
from fleet.redis_server import LocalServer
from workers.backends.base import InferenceItem, LoadContext
from workers.backends.python_backend import PythonBackend

ROOT = Path(__file__).resolve().parents[2]
BUSY_MODEL = """
import time
from pathlib import Path

class TritonPythonModel:
    def initialize(self, args):
        self.marker = Path(args["model_repository"]) / "executing"

    def execute(self, requests):
        self.marker.write_text("")
        time.sleep(120)
"""
CONFIG = """
backend: "python"
max_batch_size: 1
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""


def wait_for(what: str, check: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_a_killed_worker_leaves_no_stub(redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> None:
    model_dir = tmp_path / "repo" / "busy"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(BUSY_MODEL)
    (model_dir / "config.pbtxt").write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FLEET_REDIS_URL")}
    env |= {"FLEET_KEY_PREFIX": key_prefix, "FLEET_WATCHDOG_S": "600"}
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "fleet", "worker", "--device", "cpu", "--redis-url",
                                   redis_server.url, "--model-repository", str(model_dir.parent)],
                                  cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    stubs: list[int] = []
    try:
        def stub_started() -> bool:
            stubs[:] = [pid for pid, argv in children(worker.pid) if b"workers.backends.python_stub" in argv]
            assert worker.poll() is None, log.read_text()
            return bool(stubs)

        wait_for("the worker started no stub", stub_started, 60)
        request = RequestEnvelope(id="r1", model="busy", version=1, reply_to=Keys(key_prefix).reply("test"),
                                  enqueued_at_us=0, inputs=[WireTensor("IN", "FP32", (1, 1), b"\0\0\0\0")])
        client = redis.Redis.from_url(redis_server.url)
        try:
            client.xadd(Keys(key_prefix).queue("busy", version=1), {b"d": encode_request(request)})
        finally:
            client.close()
        wait_for("the stub never ran execute()", (model_dir / "executing").exists, 30)

        worker.kill()
        worker.wait(10)
        t0 = time.monotonic()
        wait_for(f"stub {stubs} outlived its SIGKILLed worker", lambda: not any(map(running, stubs)), 5)
        print(f"stub gone {time.monotonic() - t0:.3f} s after the worker was killed")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        for pid in stubs:  # only on failure: the stub this test's worker started
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_stub_outlives_the_thread_that_loaded_it() -> None:
    """The parent-death signal follows the forking *thread*: a stub loaded on a thread that then ends
    (asyncio.to_thread's, an instance's) must keep serving, and so must one restarted after a kill."""
    model_dir = ROOT / "tests" / "models" / "doubler"
    spec = parse_config((model_dir / "config.pbtxt").read_text(), source=str(model_dir), model_name="doubler")
    ctx = LoadContext(spec=spec, model_dir=model_dir, version=1, instance_name="doubler_0", device="cpu")
    loaded: list[PythonBackend] = []
    before = {pid for pid, _ in children(os.getpid())}
    loader = threading.Thread(target=lambda: loaded.append(PythonBackend(ctx)))
    loader.start()
    loader.join()
    (backend,) = loaded
    item = InferenceItem(inputs={}, wire=[WireTensor("IN", "FP32", (1, 1), struct.pack("<f", 2.0))])
    try:
        (stub,) = [pid for pid, argv in children(os.getpid())
                   if pid not in before and b"workers.backends.python_stub" in argv]
        time.sleep(0.5)  # a parent-death signal from the loader thread's exit would have landed by now
        assert running(stub), "the stub died with the thread that loaded it"
        assert backend.alive and backend.interruptible
        (result,) = backend.execute([item])
        assert result.error is None and result.wire_outputs is not None
        backend.kill()  # the watchdog's way out: the next call fails as a crash and restarts the stub
        backend.execute([item])
        assert backend.alive
        (result,) = backend.execute([item])
        assert result.error is None and result.wire_outputs is not None
        assert struct.unpack("<f", result.wire_outputs["OUT"].data) == (4.0,)
    finally:
        backend.close()
