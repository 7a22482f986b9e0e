"""The gateway's shared-memory registry (gateway/shared_memory.py) and the tensors that name a region
(fleet/tensor_regions.py through fleet.kserve), on real POSIX shared-memory objects made with Triton's
client library, as a client on the gateway's host makes them. No server: the end-to-end flow is in
tests/e2e/test_shared_memory.py."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm

from fleet.envelope import WireTensor
from fleet.errors import InvalidInput, NotFound, TooLarge, Unsupported
from fleet.kserve import parse_infer, render_infer
from fleet.model_config import parse_config
from fleet.tensor_regions import RegionRef
from gateway import shared_memory
from gateway.shared_memory import SharedMemoryRegistry

SIMPLE = parse_config(
    'name: "s"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
    'input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
    'output [ { name: "C" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "D" data_type: TYPE_INT32 dims: [ 16 ] } ]',
    source="s", model_name="s",
)


class Objects:
    """POSIX shared-memory objects of one test, each under a key no other test (or engineer) uses."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def make(self, byte_size: int) -> tuple[str, Any]:
        key = f"/fleet_unit_{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key[1:], key, byte_size, create_only=True)
        self.handles.append(handle)
        return key, handle


@pytest.fixture
def objects() -> Iterator[Objects]:
    made = Objects()
    yield made
    for handle in made.handles:
        shm.destroy_shared_memory_region(handle)


def test_register_status_unregister_with_tritons_semantics(objects: Objects) -> None:
    key, _ = objects.make(256)
    reg = SharedMemoryRegistry()
    reg.register("in", key, 0, 128)
    reg.register("out", key, 128, 128)  # distinct names over one object: allowed, as in Triton
    assert reg.status() == [{"name": "in", "key": key, "offset": 0, "byte_size": 128},
                            {"name": "out", "key": key, "offset": 128, "byte_size": 128}]
    assert reg.status("out") == [{"name": "out", "key": key, "offset": 128, "byte_size": 128}]
    with pytest.raises(InvalidInput, match="shared memory region 'in' already in manager"):
        reg.register("in", key, 0, 8)
    with pytest.raises(NotFound, match="Unable to find system shared memory region: 'nope'"):
        reg.status("nope")
    reg.unregister("nope")  # an unknown name is no error
    reg.unregister("in")
    assert [r["name"] for r in reg.status()] == ["out"]
    reg.unregister()
    assert reg.status() == []


@pytest.mark.parametrize("key", ["/a/b", "a/b", "/../etc/passwd", "/..", "..", ".", "/", "", "/x\0y"])
def test_keys_that_are_no_shm_name_are_refused(key: str) -> None:
    with pytest.raises(InvalidInput, match="is not a POSIX shared memory name"):
        SharedMemoryRegistry().register("r", key, 0, 8)


def test_missing_objects_symlinks_and_bounds_are_refused(objects: Objects, tmp_path: Path) -> None:
    reg = SharedMemoryRegistry()
    with pytest.raises(InvalidInput, match="Unable to open shared memory region: '/fleet_unit_none'"):
        reg.register("r", "/fleet_unit_none", 0, 8)
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 64)
    link = Path("/dev/shm") / f"fleet_unit_link_{uuid.uuid4().hex[:8]}"
    link.symlink_to(target)
    try:
        with pytest.raises(InvalidInput, match="Unable to open shared memory region"):
            reg.register("r", f"/{link.name}", 0, 8)  # a symlink must not lead the gateway to another file
    finally:
        link.unlink()
    key, _ = objects.make(64)
    with pytest.raises(InvalidInput, match=r"failed to register shared memory region 'r': invalid args \(offset 60 "
                                           r"\+ byte_size 8 is past the end"):
        reg.register("r", key, 60, 8)
    with pytest.raises(InvalidInput, match="byte_size must be at least 1"):
        reg.register("r", key, 0, 0)
    assert reg.status() == []


def test_slices_read_and_write_within_the_region(objects: Objects) -> None:
    key, handle = objects.make(9000)
    data = np.arange(2048, dtype=np.int32)
    shm.set_shared_memory_region(handle, [data])
    reg = SharedMemoryRegistry()
    reg.register("r", key, 4100, 4096)  # an offset that is no multiple of a page
    assert reg.slice(RegionRef("r", 4, 8)).read() == data[1026:1028].tobytes()
    reg.slice(RegionRef("r", 8, 8)).write("OUT", np.array([7, 9], dtype=np.int32).tobytes())
    assert list(shm.get_contents_as_numpy(handle, np.int32, [2], offset=4108)) == [7, 9]
    with pytest.raises(InvalidInput, match=r"Invalid offset for shared memory region: 'r'"):
        reg.slice(RegionRef("r", 4096, 0))
    with pytest.raises(InvalidInput, match=r"Invalid offset \+ byte size for shared memory region: 'r'"):
        reg.slice(RegionRef("r", 4000, 97))
    with pytest.raises(InvalidInput, match="Unable to find shared memory region: 'q'.*each gateway process"):
        reg.slice(RegionRef("q", 0, 4))
    with pytest.raises(InvalidInput, match=r"output 'OUT' \(8 bytes\) should be at least 12 bytes"):
        reg.slice(RegionRef("r", 0, 8)).write("OUT", b"\0" * 12)


def test_a_region_unregistered_in_flight_stays_mapped_for_its_request(objects: Objects) -> None:
    key, handle = objects.make(64)
    shm.set_shared_memory_region(handle, [np.full(16, 5, dtype=np.int32)])
    reg = SharedMemoryRegistry()
    reg.register("r", key, 0, 64)
    held = reg.slice(RegionRef("r", 0, 64))
    reg.unregister()
    assert held.read() == np.full(16, 5, dtype=np.int32).tobytes()  # Triton too waits for in-flight requests


def test_an_object_shrunk_after_registering_is_an_error_not_a_crash(objects: Objects) -> None:
    key, _ = objects.make(8192)
    reg = SharedMemoryRegistry()
    reg.register("r", key, 4096, 4096)
    os.truncate(f"/dev/shm{key}", 4100)  # touching the pages past the end now would be SIGBUS
    with pytest.raises(InvalidInput, match="shrank to 4100 bytes"):
        reg.slice(RegionRef("r", 0, 64)).read()
    with pytest.raises(InvalidInput, match="shrank"):
        reg.slice(RegionRef("r", 8, 8)).write("OUT", b"\0" * 8)


def test_an_input_read_is_bounded_like_a_body(objects: Objects) -> None:
    key, _ = objects.make(256)
    reg = SharedMemoryRegistry(max_read_bytes=64)
    reg.register("r", key, 0, 256)
    assert len(reg.slice(RegionRef("r", 0, 64)).read()) == 64
    with pytest.raises(TooLarge, match="65 bytes of shared memory region 'r' exceed the limit of 64 bytes"):
        reg.slice(RegionRef("r", 0, 65)).read()
    reg.slice(RegionRef("r", 0, 256)).write("OUT", b"\0" * 256)  # outputs are bounded by the region only


def test_the_number_of_regions_is_bounded(objects: Objects, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_memory, "MAX_REGIONS", 2)
    key, _ = objects.make(64)
    reg = SharedMemoryRegistry()
    reg.register("a", key, 0, 8)
    reg.register("b", key, 0, 8)
    with pytest.raises(InvalidInput, match="holds 2 regions already"):
        reg.register("c", key, 0, 8)


def test_cuda_answers_as_with_nothing_registered(objects: Objects) -> None:
    reg = SharedMemoryRegistry()
    assert reg.cuda_status() == []
    reg.cuda_unregister()
    reg.cuda_unregister("nope")
    with pytest.raises(InvalidInput, match="CUDA shared memory is not supported by this gateway"):
        reg.cuda_register("g")
    with pytest.raises(NotFound, match="Unable to find cuda shared memory region: 'g'"):
        reg.cuda_status("g")
    key, _ = objects.make(64)
    reg.register("sys", key, 0, 64)
    with pytest.raises(NotFound, match="registered as system shared memory, not CUDA"):
        reg.cuda_status("sys")


def _infer(inputs: list[dict[str, Any]], outputs: list[dict[str, Any]] | None = None) -> bytes:
    doc: dict[str, Any] = {"inputs": inputs}
    if outputs is not None:
        doc["outputs"] = outputs
    return json.dumps(doc).encode()


def _in_region(name: str, region: str, byte_size: int, offset: int = 0) -> dict[str, Any]:
    params: dict[str, Any] = {"shared_memory_region": region, "shared_memory_byte_size": byte_size}
    if offset:
        params["shared_memory_offset"] = offset
    return {"name": name, "datatype": "INT32", "shape": [1, 16], "parameters": params}


def test_an_http_request_reads_inputs_from_and_writes_outputs_to_regions(objects: Objects) -> None:
    key, handle = objects.make(256)
    a, b = np.arange(16, dtype=np.int32), np.full(16, 3, dtype=np.int32)
    shm.set_shared_memory_region(handle, [a, b])
    reg = SharedMemoryRegistry()
    reg.register("ins", key, 0, 128)
    reg.register("outs", key, 128, 128)
    body = _infer([_in_region("A", "ins", 64), _in_region("B", "ins", 64, offset=64)],
                  [{"name": "C", "parameters": {"shared_memory_region": "outs", "shared_memory_byte_size": 64,
                                                "binary_data": False}},
                   {"name": "D", "parameters": {"binary_data": True}}])
    req = parse_infer(body, None, SIMPLE, reg)
    assert [bytes(t.data) for t in req.inputs] == [a.tobytes(), b.tobytes()]
    c, d = (a + b).tobytes(), (a - b).tobytes()
    rendered, hlen = render_infer("s", 1, req, [WireTensor("C", "INT32", (1, 16), c),
                                               WireTensor("D", "INT32", (1, 16), d)], {})
    assert hlen is not None and rendered[hlen:] == d  # only the binary output travels in the body
    doc = json.loads(rendered[:hlen])
    assert doc["outputs"][0] == {"name": "C", "datatype": "INT32", "shape": [1, 16]}  # as Triton: no data
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128), [a + b])


@pytest.mark.parametrize("inputs,outputs,exc,match", [
    ([_in_region("A", "ins", 60), _in_region("B", "ins", 64)], None, InvalidInput,
     "unexpected total byte size 60 for input 'A', expecting 64"),
    ([_in_region("A", "gone", 64), _in_region("B", "ins", 64)], None, InvalidInput,
     "Unable to find shared memory region: 'gone'"),
    ([_in_region("A", "ins", 64, offset=100), _in_region("B", "ins", 64)], None, InvalidInput,
     r"Invalid offset \+ byte size for shared memory region: 'ins'"),
    ([{**_in_region("A", "ins", 64), "data": [1] * 16}, _in_region("B", "ins", 64)], None, InvalidInput,
     "exactly one of 'data', 'binary_data_size'"),
    ([{**_in_region("A", "ins", 64), "parameters": {"shared_memory_region": "ins"}}, _in_region("B", "ins", 64)],
     None, InvalidInput, "'shared_memory_byte_size' is required"),
    ([{**_in_region("A", "ins", 64), "parameters": {"shared_memory_region": 5, "shared_memory_byte_size": 64}},
      _in_region("B", "ins", 64)], None, InvalidInput, "Unable to parse 'shared_memory_region'"),
    ([_in_region("A", "ins", 64), _in_region("B", "ins", 64)],
     [{"name": "C", "parameters": {"shared_memory_region": "ins", "shared_memory_byte_size": 64,
                                   "binary_data": True}}], InvalidInput,
     "Output can't set both 'shared_memory_region' and 'binary_data'"),
    ([_in_region("A", "ins", 64), _in_region("B", "ins", 64)],
     [{"name": "C", "parameters": {"shared_memory_region": "ins", "shared_memory_byte_size": 64,
                                   "shared_memory_offset": -1}}], InvalidInput,
     "Unable to parse 'shared_memory_offset'"),
    ([_in_region("A", "ins", 64), _in_region("B", "ins", 64)],
     [{"name": "C", "parameters": {"shared_memory_region": "nope", "shared_memory_byte_size": 64}}], InvalidInput,
     "Unable to find shared memory region: 'nope'"),
])
def test_bad_shared_memory_tensors_are_clear_400s(objects: Objects, inputs: list[dict[str, Any]],
                                                  outputs: list[dict[str, Any]] | None, exc: type[Exception],
                                                  match: str) -> None:
    key, _ = objects.make(128)
    reg = SharedMemoryRegistry()
    reg.register("ins", key, 0, 128)
    with pytest.raises(exc, match=match):
        parse_infer(_infer(inputs, outputs), None, SIMPLE, reg)


def test_an_output_region_too_small_is_refused_when_writing(objects: Objects) -> None:
    key, _ = objects.make(256)
    reg = SharedMemoryRegistry()
    reg.register("r", key, 0, 256)
    body = _infer([{"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16} for n in "AB"],
                  [{"name": "C", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 32}}])
    req = parse_infer(body, None, SIMPLE, reg)
    with pytest.raises(InvalidInput, match=r"output 'C' \(32 bytes\) should be at least 64 bytes"):
        render_infer("s", 1, req, [WireTensor("C", "INT32", (1, 16), b"\0" * 64)], {})


def test_without_regions_shared_memory_is_unsupported() -> None:
    body = _infer([{"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16} for n in "AB"],
                  [{"name": "C", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 64}}])
    with pytest.raises(Unsupported, match="shared memory"):
        parse_infer(body, None, SIMPLE)  # a bulk job's line: the client's region is on another host


# --- registrations shared by the gateway processes of one host (--shared-memory-dir) ---
# Two registries on one directory stand for two gateway processes on the same ports.


def test_a_region_registered_with_one_process_is_served_by_another(objects: Objects, tmp_path: Path) -> None:
    key, handle = objects.make(64)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    a, b = SharedMemoryRegistry(shared_dir=tmp_path), SharedMemoryRegistry(shared_dir=tmp_path)
    a.register("in", key, 0, 64)
    assert b.status() == a.status() == [{"name": "in", "key": key, "offset": 0, "byte_size": 64}]
    assert np.frombuffer(b.slice(RegionRef("in", 8, 8)).read(), np.int32).tolist() == [2, 3]
    with pytest.raises(InvalidInput, match="shared memory region 'in' already in manager"):
        b.register("in", key, 0, 8)  # across processes too
    b.slice(RegionRef("in", 0, 64)).write("OUT", np.full(16, 7, np.int32).tobytes())
    assert np.frombuffer(a.slice(RegionRef("in", 0, 8)).read(), np.int32).tolist() == [7, 7]


def test_an_unregistration_or_a_new_registration_reaches_every_process(objects: Objects, tmp_path: Path) -> None:
    key, handle = objects.make(64)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    a, b = SharedMemoryRegistry(shared_dir=tmp_path), SharedMemoryRegistry(shared_dir=tmp_path)
    a.register("r", key, 0, 64)
    assert b.slice(RegionRef("r", 0, 4)).read() == np.int32(0).tobytes()  # b maps it
    a.unregister("r")
    with pytest.raises(InvalidInput, match="Unable to find shared memory region: 'r'"):
        b.slice(RegionRef("r", 0, 4))
    with pytest.raises(NotFound):
        b.status("r")
    a.register("r", key, 32, 32)  # the same name, another window: b maps the new one
    assert np.frombuffer(b.slice(RegionRef("r", 0, 4)).read(), np.int32).tolist() == [8]
    b.register("s", key, 0, 8)
    assert [r["name"] for r in a.status()] == ["r", "s"]
    b.unregister()  # all, from either process
    assert a.status() == [] and b.status() == []
    with pytest.raises(InvalidInput, match="Unable to find shared memory region: 's'"):
        a.slice(RegionRef("s", 0, 4))
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_the_region_cap_counts_every_process(objects: Objects, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_memory, "MAX_REGIONS", 2)
    key, _ = objects.make(64)
    a, b = SharedMemoryRegistry(shared_dir=tmp_path), SharedMemoryRegistry(shared_dir=tmp_path)
    a.register("1", key, 0, 8)
    b.register("2", key, 0, 8)
    with pytest.raises(InvalidInput, match="regions already"):
        a.register("3", key, 0, 8)
    with pytest.raises(NotFound, match="registered as system shared memory"):
        b.cuda_status("1")


def test_a_quick_re_registration_is_seen_though_the_inode_comes_back(objects: Objects, tmp_path: Path) -> None:
    key, handle = objects.make(64)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    a, b = SharedMemoryRegistry(shared_dir=tmp_path), SharedMemoryRegistry(shared_dir=tmp_path)
    for offset in (0, 4, 8, 12, 16, 20):  # no lookup by b between a's unregister and register
        a.unregister("r")
        a.register("r", key, offset, 16)
        assert np.frombuffer(b.slice(RegionRef("r", 0, 4)).read(), np.int32).tolist() == [offset // 4]


def test_a_sweep_unmaps_what_another_process_unregistered(objects: Objects, tmp_path: Path) -> None:
    key, _ = objects.make(64)
    a, b = SharedMemoryRegistry(shared_dir=tmp_path), SharedMemoryRegistry(shared_dir=tmp_path)
    a.register("r", key, 0, 64)
    held = b.slice(RegionRef("r", 0, 4))  # b maps it; an in-flight request holds a slice
    a.unregister("r")
    b.sweep()
    assert b._regions == {} and b._mapped == {}
    assert held.read() == bytes(4)  # the slice keeps its mapping until the request is answered


def test_what_is_not_a_registration_counts_as_none(objects: Objects, tmp_path: Path) -> None:
    key, _ = objects.make(64)
    reg = SharedMemoryRegistry(shared_dir=tmp_path)
    reg.register("good", key, 0, 8)
    (tmp_path / ("0" * 64 + ".json")).write_text("[1, 2")  # does not decode
    (tmp_path / ("1" * 64 + ".json")).write_text('{"name": 1, "key": "/x", "offset": 0, "byte_size": 8}')
    os.mkfifo(tmp_path / ("2" * 64 + ".json"))  # would block a plain open()
    (tmp_path / ("3" * 64 + ".json")).symlink_to(tmp_path / ("0" * 64 + ".json"))
    assert [r["name"] for r in reg.status()] == ["good"]
    with pytest.raises(InvalidInput, match="Unable to find shared memory region: 'bad'"):
        reg.slice(RegionRef("bad", 0, 4))


def test_a_registration_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    with pytest.raises(ValueError, match="no one else may write"):
        SharedMemoryRegistry(shared_dir=open_dir)
    SharedMemoryRegistry(shared_dir=tmp_path / "made")  # made 0700
    assert (tmp_path / "made").stat().st_mode & 0o777 == 0o700


def test_a_registration_is_stamped_with_the_nanosecond_it_was_made(objects: Objects, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Its identity is (inode, that stamp): a freed inode number can come back at once, the stamp does not."""
    from gateway import shm_registrations

    key, _ = objects.make(64)
    files = shm_registrations.RegistrationFiles(tmp_path)
    monkeypatch.setattr(shm_registrations.time, "time_ns", lambda: 1_765_000_000_123_456_789)
    identity = files.publish(shm_registrations.Registration("r", key, 0, 8))
    assert identity is not None and identity[1] == 1_765_000_000_123_456_789 == files.identity("r")[1]


def test_a_registration_file_with_impossible_values_counts_as_none(tmp_path: Path) -> None:
    from gateway import shm_registrations

    files = shm_registrations.RegistrationFiles(tmp_path)
    for n, (offset, size) in enumerate([(-1, 8), (0, 0), (0, -8)]):
        (tmp_path / f"{n:064d}.json").write_text(json.dumps({"name": f"r{n}", "key": "/k", "offset": offset,
                                                             "byte_size": size}))
    assert files.all() == []
