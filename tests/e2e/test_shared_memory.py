"""System shared memory against the running system, with Triton's own clients and its shared-memory
utilities, as a client on the gateway's host uses them: Triton's simple_http_shm_client.py and
simple_http_shm_string_client.py flows (register, infer, status, unregister), bad regions, the CUDA
answers, the same over gRPC (simple_grpc_shm_client.py), and perf_analyzer with --shared-memory system
over both protocols."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as http
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import (
    InferenceServerException,
    serialize_byte_tensor,
    serialized_byte_size,
    triton_to_np_dtype,
)

from tests.e2e.conftest import RunningSystem

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
PERF_ANALYZER = ROOT / ".tools/perf_analyzer/perf_analyzer"


class Regions:
    """Shared-memory objects and registrations of one test, under names no other test uses (the system,
    and /dev/shm, are shared), destroyed and unregistered at its end."""

    def __init__(self, client: http.InferenceServerClient | grpcclient.InferenceServerClient) -> None:
        self.client = client
        self.tag = uuid.uuid4().hex[:10]
        self.handles: list[Any] = []
        self.names: list[str] = []

    def create(self, name: str, byte_size: int) -> tuple[str, str, Any]:
        """(region name, key, handle) of a new object of `byte_size` bytes, not yet registered."""
        region, key = f"{name}_{self.tag}", f"/{name}_{self.tag}"
        handle = shm.create_shared_memory_region(region, key, byte_size, create_only=True)
        self.handles.append(handle)
        return region, key, handle

    def register(self, name: str, byte_size: int) -> tuple[str, Any]:
        region, key, handle = self.create(name, byte_size)
        self.client.register_system_shared_memory(region, key, byte_size)
        self.names.append(region)
        return region, handle

    def close(self) -> None:
        try:
            for region in self.names:
                self.client.unregister_system_shared_memory(region)
        finally:
            for handle in self.handles:
                shm.destroy_shared_memory_region(handle)


@pytest.fixture
def client(system: RunningSystem) -> http.InferenceServerClient:
    return http.InferenceServerClient(system.url, network_timeout=60)


@pytest.fixture
def regions(client: http.InferenceServerClient) -> Iterator[Regions]:
    made = Regions(client)
    yield made
    made.close()


def _status_of(client: http.InferenceServerClient, region: str) -> dict[str, Any]:
    status: list[dict[str, Any]] = client.get_system_shared_memory_status(region)
    assert len(status) == 1
    return status[0]


def test_simple_http_shm_client_flow(client: http.InferenceServerClient, regions: Regions) -> None:
    """Triton's simple_http_shm_client.py on `simple`: both inputs in one region (the second at an
    offset), each output in a region of its own, results read back from shared memory."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    size = a.nbytes
    out0, out0_handle = regions.register("output0_data", size)
    out1, out1_handle = regions.register("output1_data", size)
    ins, ins_key, ins_handle = regions.create("input_data", 2 * size)
    shm.set_shared_memory_region(ins_handle, [a])
    shm.set_shared_memory_region(ins_handle, [b], offset=size)
    client.register_system_shared_memory(ins, ins_key, 2 * size)
    regions.names.append(ins)
    assert _status_of(client, ins) == {"name": ins, "key": ins_key, "offset": 0, "byte_size": 2 * size}
    listed = {r["name"] for r in client.get_system_shared_memory_status()}
    assert {ins, out0, out1} <= listed

    inputs = [http.InferInput("INPUT0", [1, 16], "INT32"), http.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(ins, size)
    inputs[1].set_shared_memory(ins, size, offset=size)
    outputs = [http.InferRequestedOutput("OUTPUT0", binary_data=True),
               http.InferRequestedOutput("OUTPUT1", binary_data=True)]
    outputs[0].set_shared_memory(out0, size)
    outputs[1].set_shared_memory(out1, size)
    for _ in range(3):  # the regions stay registered and are reused, as clients do
        result = client.infer("simple", inputs, outputs=outputs)
        for name, handle, want in (("OUTPUT0", out0_handle, a + b), ("OUTPUT1", out1_handle, a - b)):
            meta = result.get_output(name)
            assert set(meta) == {"name", "datatype", "shape"}  # as Triton answers: the data is in the region
            got = shm.get_contents_as_numpy(handle, triton_to_np_dtype(meta["datatype"]), meta["shape"])
            np.testing.assert_array_equal(got, want)
        a += 1
        shm.set_shared_memory_region(ins_handle, [a])
    client.unregister_system_shared_memory(out1)
    assert out1 not in {r["name"] for r in client.get_system_shared_memory_status()}


def test_shm_mixed_with_binary_and_json_tensors(client: http.InferenceServerClient, regions: Regions) -> None:
    a = np.full((1, 16), 7, dtype=np.int32)
    b = np.arange(16, dtype=np.int32).reshape(1, 16)
    ins, handle = regions.register("mixed_in", a.nbytes)
    out, out_handle = regions.register("mixed_out", 4096)  # larger than the output: Triton's "at least"
    shm.set_shared_memory_region(handle, [a])
    inputs = [http.InferInput("INPUT0", [1, 16], "INT32"), http.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(ins, a.nbytes)
    inputs[1].set_data_from_numpy(b, binary_data=True)
    outputs = [http.InferRequestedOutput("OUTPUT0"), http.InferRequestedOutput("OUTPUT1", binary_data=True)]
    outputs[0].set_shared_memory(out, 4096)
    result = client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [1, 16]), a + b)


def test_simple_http_shm_string_client_flow(client: http.InferenceServerClient, regions: Regions) -> None:
    """Triton's simple_http_shm_string_client.py on `simple_string`: BYTES tensors in shared memory, in
    Triton's length-prefixed layout both ways."""
    a = np.array([[str(i) for i in range(16)]], dtype=np.object_)
    b = np.array([["1"] * 16], dtype=np.object_)
    raw_a, raw_b = serialize_byte_tensor(a), serialize_byte_tensor(b)
    size_a, size_b = serialized_byte_size(raw_a), serialized_byte_size(raw_b)
    in0, h0 = regions.register("string_in0", size_a)
    in1, h1 = regions.register("string_in1", size_b)
    shm.set_shared_memory_region(h0, [raw_a])
    shm.set_shared_memory_region(h1, [raw_b])
    out0, o0 = regions.register("string_out0", 1024)
    out1, o1 = regions.register("string_out1", 1024)
    inputs = [http.InferInput("INPUT0", [1, 16], "BYTES"), http.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_shared_memory(in0, size_a)
    inputs[1].set_shared_memory(in1, size_b)
    outputs = [http.InferRequestedOutput("OUTPUT0"), http.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(out0, 1024)
    outputs[1].set_shared_memory(out1, 1024)
    result = client.infer("simple_string", inputs, outputs=outputs)
    sums = shm.get_contents_as_numpy(o0, np.object_, result.get_output("OUTPUT0")["shape"])
    diffs = shm.get_contents_as_numpy(o1, np.object_, result.get_output("OUTPUT1")["shape"])
    assert [int(x) for x in sums.reshape(-1)] == [i + 1 for i in range(16)]
    assert [int(x) for x in diffs.reshape(-1)] == [i - 1 for i in range(16)]


def _fails(call: Any, status: str, text: str) -> None:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == status and text in info.value.message(), (info.value.status(), info.value)


def test_bad_registrations_are_clear_400s(client: http.InferenceServerClient, regions: Regions) -> None:
    region, key, _ = regions.create("bad_reg", 64)
    _fails(lambda: client.register_system_shared_memory(region, "/tmp/x", 64), "400", "not a POSIX shared memory name")
    _fails(lambda: client.register_system_shared_memory(region, "/..", 64), "400", "not a POSIX shared memory name")
    _fails(lambda: client.register_system_shared_memory(region, f"/none_{regions.tag}", 64), "400",
           "Unable to open shared memory region")
    _fails(lambda: client.register_system_shared_memory(region, key, 64, offset=8), "400",
           f"failed to register shared memory region '{region}': invalid args")
    client.register_system_shared_memory(region, key, 64)
    regions.names.append(region)
    _fails(lambda: client.register_system_shared_memory(region, key, 32), "400",
           f"shared memory region '{region}' already in manager")
    _fails(lambda: client.get_system_shared_memory_status(f"none_{regions.tag}"), "404",
           f"Unable to find system shared memory region: 'none_{regions.tag}'")
    client.unregister_system_shared_memory(f"none_{regions.tag}")  # Triton: no error


def _simple_inputs(region: str, byte_size: int, offset: int = 0) -> list[http.InferInput]:
    inputs = [http.InferInput("INPUT0", [1, 16], "INT32"), http.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(region, byte_size, offset)
    inputs[1].set_data_from_numpy(np.zeros((1, 16), dtype=np.int32))
    return inputs


def test_bad_shared_memory_tensors_are_clear_400s(client: http.InferenceServerClient, regions: Regions) -> None:
    region, _ = regions.register("bad_tensor", 64)
    _fails(lambda: client.infer("simple", _simple_inputs(f"none_{regions.tag}", 64)), "400",
           f"Unable to find shared memory region: 'none_{regions.tag}'")
    _fails(lambda: client.infer("simple", _simple_inputs(region, 64, offset=8)), "400",
           f"Invalid offset + byte size for shared memory region: '{region}'")
    _fails(lambda: client.infer("simple", _simple_inputs(region, 60)), "400",
           "unexpected total byte size 60 for input 'INPUT0', expecting 64")
    small = http.InferRequestedOutput("OUTPUT0")
    small.set_shared_memory(region, 32)
    _fails(lambda: client.infer("simple", _simple_inputs(region, 64), outputs=[small]), "400",
           "should be at least 64 bytes to hold the results")


def _post(system: RunningSystem, path: str, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://{system.url}{path}", data=json.dumps(doc).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return int(r.status), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_wire_level_rules(system: RunningSystem, regions: Regions) -> None:
    """What tritonclient never sends: an output both binary and in shared memory, a register request
    without its fields."""
    region, _ = regions.register("wire", 128)
    doc = {"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
                      for n in ("INPUT0", "INPUT1")],
           "outputs": [{"name": "OUTPUT0", "parameters": {"shared_memory_region": region,
                                                          "shared_memory_byte_size": 64, "binary_data": True}}]}
    assert _post(system, "/v2/models/simple/infer", doc) == (
        400, {"error": "Output can't set both 'shared_memory_region' and 'binary_data'"})
    assert _post(system, "/v2/systemsharedmemory/region/x/register", {"byte_size": 8}) == (
        400, {"error": "Shared memory register request has no 'key' field"})
    assert _post(system, "/v2/systemsharedmemory/region/x/register", {"key": "/x"}) == (
        400, {"error": "Shared memory register request has no 'byte_size' field"})
    status, _ = _post(system, "/v2/systemsharedmemory/status", {})
    assert status == 405  # status is GET only, as in Triton


def test_cuda_shared_memory_answers(client: http.InferenceServerClient) -> None:
    assert client.get_cuda_shared_memory_status() == []
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("never_registered")
    _fails(lambda: client.register_cuda_shared_memory("gpu", "AAAA", 0, 64), "400",
           "CUDA shared memory is not supported by this gateway")
    _fails(lambda: client.get_cuda_shared_memory_status("gpu"), "404", "Unable to find cuda shared memory region")


def test_server_advertises_system_shared_memory_only(client: http.InferenceServerClient) -> None:
    extensions = client.get_server_metadata()["extensions"]
    assert "system_shared_memory" in extensions and "cuda_shared_memory" not in extensions


# --- gRPC: the same registry (one per gateway process) behind Triton's RPCs ----------------------------------


@pytest.fixture
def grpc_client(system: RunningSystem) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(system.grpc_url)


@pytest.fixture
def grpc_regions(grpc_client: grpcclient.InferenceServerClient) -> Iterator[Regions]:
    made = Regions(grpc_client)
    yield made
    made.close()


def test_simple_grpc_shm_client_flow(grpc_client: grpcclient.InferenceServerClient, grpc_regions: Regions,
                                     client: http.InferenceServerClient) -> None:
    """Triton's simple_grpc_shm_client.py on `simple`; a region registered over gRPC is the process's, so
    HTTP sees it too."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 2, dtype=np.int32)
    size = a.nbytes
    ins, ins_handle = grpc_regions.register("grpc_input", 2 * size)
    out, out_handle = grpc_regions.register("grpc_output", 2 * size)
    shm.set_shared_memory_region(ins_handle, [a, b])
    status = grpc_client.get_system_shared_memory_status(ins)
    assert status.regions[ins].byte_size == 2 * size and status.regions[ins].key == f"/{ins}"
    assert _status_of(client, ins)["byte_size"] == 2 * size
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(ins, size)
    inputs[1].set_shared_memory(ins, size, offset=size)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(out, size)
    outputs[1].set_shared_memory(out, size, offset=size)
    result = grpc_client.infer("simple", inputs, outputs=outputs)
    meta = result.get_output("OUTPUT1")
    assert meta is not None and list(meta.shape) == [1, 16] and meta.datatype == "INT32"
    got = shm.get_contents_as_numpy(out_handle, np.int32, [2, 16])
    np.testing.assert_array_equal(got, np.concatenate([a + b, a - b]))
    grpc_client.unregister_system_shared_memory(out)
    assert out not in grpc_client.get_system_shared_memory_status().regions


def _grpc_fails(call: Any, text: str) -> None:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and text in info.value.message(), info.value


def test_grpc_bad_regions_are_invalid_argument(grpc_client: grpcclient.InferenceServerClient,
                                               grpc_regions: Regions) -> None:
    region, key, _ = grpc_regions.create("grpc_bad", 64)
    _grpc_fails(lambda: grpc_client.register_system_shared_memory(region, "/a/b", 64),
                "not a POSIX shared memory name")
    _grpc_fails(lambda: grpc_client.register_system_shared_memory(region, key, 64, offset=1), "invalid args")
    grpc_client.register_system_shared_memory(region, key, 64)
    grpc_regions.names.append(region)
    _grpc_fails(lambda: grpc_client.register_system_shared_memory(region, key, 64), "already in manager")

    def inputs(region: str, byte_size: int, offset: int = 0) -> list[grpcclient.InferInput]:
        made = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        made[0].set_shared_memory(region, byte_size, offset)
        made[1].set_data_from_numpy(np.zeros((1, 16), dtype=np.int32))
        return made

    _grpc_fails(lambda: grpc_client.infer("simple", inputs(f"none_{grpc_regions.tag}", 64)),
                "Unable to find shared memory region: 'none_")
    _grpc_fails(lambda: grpc_client.infer("simple", inputs(region, 48)),
                "unexpected total byte size 48 for input 'INPUT0'")
    _grpc_fails(lambda: grpc_client.infer("simple", inputs(region, 64, offset=32)), "Invalid offset + byte size")
    small = grpcclient.InferRequestedOutput("OUTPUT0")
    small.set_shared_memory(region, 16)
    _grpc_fails(lambda: grpc_client.infer("simple", inputs(region, 64), outputs=[small]),
                "should be at least 64 bytes")


def test_grpc_cuda_shared_memory_answers(grpc_client: grpcclient.InferenceServerClient) -> None:
    assert len(grpc_client.get_cuda_shared_memory_status().regions) == 0
    grpc_client.unregister_cuda_shared_memory()
    grpc_client.unregister_cuda_shared_memory("never_registered")
    _grpc_fails(lambda: grpc_client.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 64),
                "CUDA shared memory is not supported by this gateway")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_with_system_shared_memory(system: RunningSystem, protocol: str) -> None:
    exe = str(PERF_ANALYZER) if PERF_ANALYZER.exists() else shutil.which("perf_analyzer")
    assert exe, "perf_analyzer is not installed: run `make perf-analyzer` (make test does)"
    url = system.url if protocol == "http" else system.grpc_url
    cmd = [exe, "-m", "simple", "-i", protocol, "-u", url, "--shared-memory", "system",
           "--concurrency-range", "1:4:3", "--measurement-interval", "1000", "--stability-percentage", "100"]
    before = _system_status(system)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Request concurrency: 4" in proc.stdout
    assert _system_status(system) == before  # it unregistered what it registered, as it does on exit


def _system_status(system: RunningSystem) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://{system.url}/v2/systemsharedmemory/status", timeout=10) as r:
        status: list[dict[str, Any]] = json.loads(r.read())
    return status
