"""fleet/raw_binary.py: the JSON header a raw binary body (Inference-Header-Content-Length: 0) stands for,
parsed then as any request (fleet/kserve.py)."""

from __future__ import annotations

import numpy as np
import pytest

from fleet import tensors
from fleet.datatypes import BY_NAME
from fleet.errors import InvalidInput
from fleet.kserve import parse_infer
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec


def spec(inputs: str, max_batch_size: int = 8) -> ModelSpec:
    return parse_config(f'backend: "python"\nmax_batch_size: {max_batch_size}\ninput [ {inputs} ]\n'
                        'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n',
                        source="test", model_name="m")


@pytest.mark.parametrize("inputs,batch,body,shape", [
    ('{ name: "X", data_type: TYPE_FP32, dims: [ -1 ] }', 8, np.zeros(5, np.float32).tobytes(), (1, 5)),
    ('{ name: "X", data_type: TYPE_INT16, dims: [ 2, -1 ] }', 0, np.zeros(6, np.int16).tobytes(), (2, 3)),
    ('{ name: "X", data_type: TYPE_FP32, dims: [ 4 ] }', 8, np.zeros(4, np.float32).tobytes(), (1, 4)),
    ('{ name: "X", data_type: TYPE_STRING, dims: [ -1 ] }', 8,
     tensors.to_bytes(np.array([b"hello"], dtype=object), BY_NAME["BYTES"]), (1, 1)),
])
def test_a_raw_body_is_the_one_input_batch_one(inputs: str, batch: int, body: bytes, shape: tuple[int, ...]) -> None:
    request = parse_infer(body, "0", spec(inputs, batch))
    (x,) = request.inputs
    assert x.name == "X" and x.shape == shape and bytes(x.data) == body
    assert request.binary_default and request.outputs is None


@pytest.mark.parametrize("inputs,body,needle", [
    ('{ name: "X", data_type: TYPE_FP32, dims: [ -1, -1 ] }', b"\0" * 16, "cannot be told from the byte size"),
    ('{ name: "X", data_type: TYPE_STRING, dims: [ 2 ] }', b"\0" * 8, "must be of one element"),
    ('{ name: "X", data_type: TYPE_FP32, dims: [ -1 ] }, { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] }',
     b"\0" * 8, "for models of one input; it has 2"),
    ('{ name: "X", data_type: TYPE_FP32, dims: [ 4 ] }', b"\0" * 8, "unexpected total byte size 8"),
])
def test_a_raw_body_whose_shape_cannot_be_told_is_refused(inputs: str, body: bytes, needle: str) -> None:
    with pytest.raises(InvalidInput, match=needle):
        parse_infer(body, "0", spec(inputs))
