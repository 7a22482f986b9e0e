"""The instance watchdog and honest readiness, with a real Redis, the gateway app and a real worker: a
Python model whose execute() hangs is killed after `watchdog_s`, the model is not advertised meanwhile,
the request that hangs it every time ends as a poison message, and the model serves again after; an
instance whose restart fails is not advertised until the worker manages to start it again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis

from fleet.keys import Keys
from fleet.redis_server import LocalServer
from tests.support.system import in_process_system

HANGING_MODEL = '''
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if x[0][0] < 0:
                time.sleep(3600)  # hangs: only the watchdog gets this instance back
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return out
'''


def _repository(root: Path) -> Path:
    repo = root / "hang-repo"
    (repo / "hang" / "1").mkdir(parents=True)
    (repo / "hang" / "1" / "model.py").write_text(HANGING_MODEL)
    (repo / "hang" / "config.pbtxt").write_text("""
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
""")
    return repo


def _body(value: float) -> dict[str, object]:
    return {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}


def test_a_hung_instance_is_killed_unadvertised_and_its_request_dead_lettered(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [_repository(tmp_path)], watchdog_s=1.0,
                                     max_deliveries=2) as system:
            client = system.client
            assert (await client.get("/v2/models/hang/ready")).status_code == 200
            started = time.monotonic()
            hung = asyncio.create_task(client.post("/v2/models/hang/infer", json=_body(-1.0)))

            async def ready() -> int:
                await system.state.refresh_readiness()
                return (await client.get("/v2/models/hang/ready")).status_code

            while await ready() == 200:  # the watchdog fires after 1 s
                assert time.monotonic() - started < 15, "the hung model stayed advertised"
                await asyncio.sleep(0.1)
            assert (await client.get("/v2/health/ready")).status_code == 400  # nothing serves 'hang'
            r = await asyncio.wait_for(hung, 20)
            took = time.monotonic() - started
            assert r.status_code == 500
            assert "crashed the model instance 2 times" in r.json()["error"], r.json()
            assert "SIGKILL" in r.json()["error"]
            assert 2.0 <= took < 20, took  # killed once per attempt, each after the 1 s limit
            while await ready() != 200:
                assert time.monotonic() - started < 40, "the model was never advertised again"
                await asyncio.sleep(0.1)
            ok = await client.post("/v2/models/hang/infer", json=_body(3.0))
            assert ok.status_code == 200 and ok.json()["outputs"][0]["data"] == [3.0]
            dead = redis.Redis.from_url(redis_server.url).xlen(Keys(key_prefix).dead("hang"))
            assert dead == 1

    asyncio.run(main())


FRAGILE_MODEL = '''
import json
import os
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        marker = json.loads(args["model_config"])["parameters"]["BROKEN_IF"]["string_value"]
        if os.path.exists(marker):
            raise RuntimeError("cannot initialize: " + marker + " exists")

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        if x[0][0] < 0:
            os._exit(3)  # the instance dies
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)])]
'''


def test_an_instance_that_cannot_restart_is_not_advertised_until_it_can(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> None:
    marker = tmp_path / "broken"
    repo = tmp_path / "fragile-repo"
    (repo / "fragile" / "1").mkdir(parents=True)
    (repo / "fragile" / "1" / "model.py").write_text(FRAGILE_MODEL)
    (repo / "fragile" / "config.pbtxt").write_text(f"""
backend: "python"
max_batch_size: 0
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 1, 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 1, 1 ] }} ]
parameters {{ key: "BROKEN_IF" value: {{ string_value: "{marker}" }} }}
""")
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [-1.0]}]}

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo], watchdog_s=2.0,
                                     max_deliveries=1) as system:
            client = system.client

            async def ready() -> int:
                await system.state.refresh_readiness()
                return (await client.get("/v2/models/fragile/ready")).status_code

            marker.write_text("")  # from now on initialize() fails
            r = await client.post("/v2/models/fragile/infer", json=body)
            assert r.status_code == 500 and "crashed the model instance" in r.json()["error"]
            started = time.monotonic()
            while await ready() == 200:
                assert time.monotonic() - started < 15, "a model nothing can serve stayed advertised"
                await asyncio.sleep(0.1)
            marker.unlink()  # initialize() works again: the worker revives the instance by itself
            while await ready() != 200:
                assert time.monotonic() - started < 30, "never advertised again"
                await asyncio.sleep(0.1)
            body["inputs"][0]["data"] = [2.0]
            ok = await client.post("/v2/models/fragile/infer", json=body)
            assert ok.status_code == 200 and ok.json()["outputs"][0]["data"] == [2.0]

    asyncio.run(main())
