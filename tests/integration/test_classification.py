"""The classification extension end to end: a real worker computes the output, the gateway answers its top
classes, labelled from the model's `label_filename`, over gRPC (Triton's own client) and over HTTP (binary and
JSON), and refuses what Triton refuses before anything is computed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from fleet import tensors
from fleet.redis_server import LocalServer
from tests.support.grpc_system import GrpcSystem

ROOT = Path(__file__).resolve().parents[2]
LABELS = ["zero", "one", "two", "three", "", "five"]


@pytest.fixture(scope="module")
def live(redis_server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcSystem]:
    repo = tmp_path_factory.mktemp("classification-repo")
    shutil.copytree(ROOT / "tests" / "models" / "doubler", repo / "labelled")
    config = (repo / "labelled" / "config.pbtxt").read_text()
    (repo / "labelled" / "config.pbtxt").write_text(
        config.replace('dims: [ -1 ] } ]\ndynamic', 'dims: [ -1 ], label_filename: "labels.txt" } ]\ndynamic'))
    assert "label_filename" in (repo / "labelled" / "config.pbtxt").read_text()
    (repo / "labelled" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    shutil.copytree(ROOT / "model_repository" / "simple_identity", repo / "simple_identity")
    with GrpcSystem(redis_server.url, [repo]) as system:
        yield system


@pytest.fixture
def client(live: GrpcSystem) -> Iterator[tg.InferenceServerClient]:
    with tg.InferenceServerClient(live.target) as c:
        yield c


VALUES = np.array([[3.0, -1.0, 7.5, 0.25, 9.0, 2.0, 9.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0]], np.float32)
# OUT = 2 * IN; the top 3 of each row, labelled where labels.txt has a non-empty line for the index.
EXPECTED = [[b"18.000000:4", b"18.000000:6", b"15.000000:2:two"],
            [b"12.000000:5:five", b"10.000000:4", b"8.000000:3:three"]]


def test_grpc_answers_the_top_classes_of_each_entry_with_their_labels(client: tg.InferenceServerClient) -> None:
    given = tg.InferInput("IN", list(VALUES.shape), "FP32")
    given.set_data_from_numpy(VALUES)
    result = client.infer("labelled", [given], outputs=[tg.InferRequestedOutput("OUT", class_count=3)])
    out = result.get_output("OUT")
    assert (out.datatype, list(out.shape)) == ("BYTES", [2, 3])
    assert result.as_numpy("OUT").tolist() == EXPECTED


@pytest.mark.parametrize("binary", [True, False])
def test_http_answers_the_same_classes(live: GrpcSystem, binary: bool) -> None:
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": list(VALUES.shape),
                        "data": VALUES.flatten().tolist()}],
            "outputs": [{"name": "OUT", "parameters": {"classification": 3, "binary_data": binary}}]}
    response = live.post("/v2/models/labelled/infer", json=body)
    assert response.status_code == 200, response.text
    if binary:
        length = int(response.headers["inference-header-content-length"])
        header, tail = response.content[:length], response.content[length:]
        out = json.loads(header)["outputs"][0]
        values = tensors.deserialize_bytes(tail, 6).reshape(2, 3).tolist()
    else:
        out = response.json()["outputs"][0]
        values = np.array([s.encode() for s in out["data"]], dtype=object).reshape(2, 3).tolist()
    assert (out["datatype"], out["shape"]) == ("BYTES", [2, 3])
    assert values == EXPECTED


def test_an_output_asked_without_classes_is_the_tensor_itself(client: tg.InferenceServerClient) -> None:
    given = tg.InferInput("IN", list(VALUES.shape), "FP32")
    given.set_data_from_numpy(VALUES)
    result = client.infer("labelled", [given], outputs=[tg.InferRequestedOutput("OUT")])
    assert np.array_equal(result.as_numpy("OUT"), VALUES * 2)


def test_a_bytes_output_is_refused_before_it_is_computed(live: GrpcSystem, client: tg.InferenceServerClient) -> None:
    before = live.queued()
    given = tg.InferInput("INPUT0", [1, 1], "BYTES")
    given.set_data_from_numpy(np.array([[b"x"]], dtype=object))
    with pytest.raises(InferenceServerException, match="class result not available for output due to "
                                                       "unsupported type 'BYTES'") as failed:
        client.infer("simple_identity", [given], outputs=[tg.InferRequestedOutput("OUTPUT0", class_count=1)])
    assert failed.value.status() == "StatusCode.INVALID_ARGUMENT"
    response = live.post("/v2/models/simple_identity/infer", json={
        "inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "data": ["x"]}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 1}}]})
    assert response.status_code == 400 and "unsupported type 'BYTES'" in response.json()["error"]
    assert live.queued() == before  # refused at the gateway: nothing was enqueued
