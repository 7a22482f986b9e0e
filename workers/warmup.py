"""`model_warmup`: the config's sample requests, run on each instance before the model is advertised
ready (Triton runs them at load). A sample that fails fails the load, with the sample's name and error.

Each sample is one request of `batch_size` rows (its inputs duplicated per row; a model that does not
batch takes batch_size 1), run `count` times (0: once). Inputs are `zero_data`, `random_data` or
`input_data_file`: raw row-major bytes (BYTES: 4-byte length + bytes per element) from the model's
`warmup/` directory, as in Triton. Zero and random BYTES elements are empty strings.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from fleet import tensors
from fleet.config_proto import model_config_pb2 as pb
from fleet.datatypes import Datatype, from_config
from fleet.envelope import RequestEnvelope, WireTensor
from fleet.model_spec import ModelSpec
from workers.backends.base import Backend
from workers.execute import run_batch


class WarmupFailed(Exception):
    """A warmup sample could not be built or failed on the model: the load fails with this."""


def _element_bytes(datatype: Datatype, count: int, how: str, rng: np.random.Generator) -> bytes:
    if datatype.name == "BYTES":
        return b"\x00\x00\x00\x00" * count  # empty strings
    if how == "zero_data":
        return bytes(count * datatype.itemsize)
    kind = datatype.numpy.kind
    if kind == "b":
        array: np.ndarray = rng.integers(0, 2, count).astype(np.bool_)
    elif kind in "iu":
        info = np.iinfo(datatype.numpy)
        array = rng.integers(max(info.min, -100), min(info.max, 100), count, endpoint=True).astype(datatype.numpy)
    else:
        array = rng.random(count).astype(datatype.numpy)
    return tensors.to_bytes(array, datatype)


def _input(spec: ModelSpec, model_dir: Path, sample: Any, name: str, given: Any, rng: np.random.Generator
           ) -> WireTensor:
    if spec.input(name) is None:
        raise WarmupFailed(f"'{name}' is not an input of the model")
    datatype = from_config(pb.DataType.Name(given.data_type))
    dims = [int(d) for d in given.dims]
    if any(d < 0 for d in dims):
        raise WarmupFailed(f"input '{name}' has a variable dim in {dims}: warmup dims must be fixed")
    config_dims = spec.input(name).dims  # type: ignore[union-attr]  # checked above
    if len(dims) != len(config_dims) or any(c not in (-1, d) for c, d in zip(config_dims, dims, strict=True)):
        raise WarmupFailed(f"input '{name}': warmup dims {dims} do not fit the config's dims {list(config_dims)}")
    count = math.prod(dims)
    how = given.WhichOneof("input_data_type")
    if how == "input_data_file":
        file = given.input_data_file
        if not file or "/" in file or "\\" in file or file in (".", ".."):
            raise WarmupFailed(f"input '{name}': input_data_file '{file}' must name a file in the model's "
                               "warmup directory")
        try:
            data = (model_dir / "warmup" / file).read_bytes()
        except OSError as exc:
            raise WarmupFailed(f"input '{name}': cannot read warmup/{file}: {exc.strerror}") from None
        if datatype.itemsize and len(data) != count * datatype.itemsize:
            raise WarmupFailed(f"input '{name}': warmup/{file} has {len(data)} bytes, {dims} {datatype.name} "
                               f"takes {count * datatype.itemsize}")
    elif how in ("zero_data", "random_data"):
        data = _element_bytes(datatype, count, how, rng)
    else:
        raise WarmupFailed(f"input '{name}' sets none of zero_data, random_data, input_data_file")
    batch = max(1, sample.batch_size)
    if spec.max_batch_size > 0:
        return WireTensor(name, datatype.name, (batch, *dims), data * batch)
    return WireTensor(name, datatype.name, tuple(dims), data)


def warm_up(spec: ModelSpec, model_dir: Path, version: int, backend: Backend) -> None:
    """Run every warmup sample of the config on `backend`; raises WarmupFailed."""
    rng = np.random.default_rng(0)
    for sample in spec.proto.model_warmup:
        label = f"warmup sample '{sample.name}'"
        if sample.batch_size < 1 or (spec.max_batch_size > 0 and sample.batch_size > spec.max_batch_size) or \
                (spec.max_batch_size == 0 and sample.batch_size != 1):
            limit = spec.max_batch_size or 1
            raise WarmupFailed(f"{label}: batch_size {sample.batch_size} must be between 1 and {limit}")
        try:
            inputs = [_input(spec, model_dir, sample, name, given, rng)
                      for name, given in sorted(sample.inputs.items())]
        except WarmupFailed as exc:
            raise WarmupFailed(f"{label}: {exc}") from None
        for i in range(max(1, sample.count)):
            env = RequestEnvelope(id=f"warmup-{sample.name}-{i}", model=spec.name, version=version, inputs=inputs,
                                  reply_to="", enqueued_at_us=0)
            reply = run_batch(spec, backend, [env]).replies[0]
            if reply.error_code:
                raise WarmupFailed(f"{label} failed: {reply.error_message}")
