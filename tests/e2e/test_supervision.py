"""`fleet up` as a supervisor: a worker killed with SIGKILL is restarted, readiness reports the truth
meanwhile (nothing serves the models), and the restarted worker serves them again."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

from tests.e2e.conftest import RunningSystem


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_a_killed_worker_is_restarted_and_readiness_follows(system: RunningSystem) -> None:
    base = f"http://{system.url}"
    (old,) = system.children("worker")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 20
    # Its heartbeat expires (5 s): with no other worker, the server is not ready.
    while _status(f"{base}/v2/health/ready") == 200:
        assert time.monotonic() < deadline, "still ready with its only worker dead"
        time.sleep(0.2)
    deadline = time.monotonic() + 180
    while _status(f"{base}/v2/health/ready") != 200:
        assert time.monotonic() < deadline, f"not ready again:\n{system.log.read_text()[-3000:]}"
        time.sleep(0.2)
    (new,) = system.children("worker")
    assert new != old
    assert "worker-0 exited with -9; restarting it" in system.log.read_text()
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
                                  {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [2] * 16}]})
    req = urllib.request.Request(f"{base}/v2/models/simple/infer", data=body.encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        doc = json.loads(r.read())
    assert {o["name"]: o["data"] for o in doc["outputs"]} == {"OUTPUT0": [3] * 16, "OUTPUT1": [-1] * 16}
