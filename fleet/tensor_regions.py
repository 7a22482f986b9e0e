"""Tensors in system shared memory (Triton's shared-memory extension), for every protocol.

An input or output whose `parameters` name a `shared_memory_region` takes its bytes from, or writes
them into, a region its client registered with the gateway (`gateway/shared_memory.py` maps the
regions). What HTTP's JSON decoder (fleet.kserve) and gRPC's protobuf decoder share lives here: reading
the three parameters with Triton's rules, checking an input's bytes against its shape and datatype, and
the seam (`Regions`, `RegionSlice`) through which they read and write regions without knowing how
regions are mapped. Without regions (bulk jobs: a job runs far from its client's host) a shared-memory
tensor is refused.

Parameters, as Triton reads them (docs/protocol/extension_shared_memory.md): `shared_memory_region`
(string, the registered name), `shared_memory_byte_size` (required with it), `shared_memory_offset`
(default 0). Decoders pass a tensor's parameters as plain Python values (gRPC: each InferParameter's set
field: string_param -> str, int64_param/uint64_param -> int).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from fleet import tensors
from fleet.datatypes import Datatype
from fleet.errors import InvalidInput, Unsupported

REGION, OFFSET, BYTE_SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"
_NO_REGIONS = ("shared memory tensors are served by the gateway's infer endpoints only: the region lives on "
               "the client's host")


@dataclass(frozen=True, slots=True)
class RegionRef:
    """Where a tensor's bytes are: `byte_size` bytes at `offset` into registered region `region`."""

    region: str
    offset: int
    byte_size: int


class RegionSlice(Protocol):
    """A checked place in a mapped region, held for one request: it keeps the mapping alive until the
    request is answered, even if its region is unregistered meanwhile (Triton waits likewise)."""

    @property
    def ref(self) -> RegionRef: ...

    def read(self) -> bytes:
        """The slice's bytes, copied once out of the region; InvalidInput if the object shrank."""
        ...

    def write(self, output: str, data: bytes | memoryview) -> None:
        """Put output `output`'s bytes at the start of the slice; InvalidInput if they do not fit."""
        ...


class Regions(Protocol):
    def slice(self, ref: RegionRef) -> RegionSlice:
        """The registered region's place `ref`; InvalidInput if unregistered or out of its bounds."""
        ...


def _uint(params: Mapping[str, object], key: str, what: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"{what}: Unable to parse '{key}': it must be a non-negative integer")
    return value


def region_ref(params: Mapping[str, object], what: str) -> RegionRef | None:
    """The shared-memory place `params` name, or None when they name no region. `what` names the tensor
    in errors ("input 'X'"). Raises InvalidInput for a region that is not a string or an offset/byte size
    that is not a non-negative integer, and when the byte size is missing (Triton's docs: region and byte
    size go together)."""
    if REGION not in params:
        return None
    region = params[REGION]
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{what}: Unable to parse '{REGION}': it must be a non-empty string")
    byte_size = _uint(params, BYTE_SIZE, what)
    if byte_size is None:
        raise InvalidInput(f"{what}: '{BYTE_SIZE}' is required with '{REGION}'")
    return RegionRef(region, _uint(params, OFFSET, what) or 0, byte_size)


def check_input_bytes(name: str, datatype: Datatype, shape: Sequence[int], data: bytes | memoryview) -> None:
    """InvalidInput unless `data` is exactly what `shape` of `datatype` takes: count x itemsize bytes, or
    for BYTES that many length-prefixed elements and nothing after them."""
    count = tensors.element_count(shape)
    if datatype.name == "BYTES":
        try:
            tensors.deserialize_bytes(data, count)  # checks the framing; the worker decodes again
        except InvalidInput as exc:
            raise InvalidInput(f"input '{name}': {exc.message}") from None
    elif len(data) != count * datatype.itemsize:
        raise InvalidInput(f"unexpected total byte size {len(data)} for input '{name}', expecting "
                           f"{count * datatype.itemsize}")


def input_from_region(regions: Regions | None, name: str, datatype: Datatype, shape: Sequence[int],
                      params: Mapping[str, object]) -> bytes | None:
    """Input `name`'s bytes when its `params` name a region (else None): read once from the region and
    checked against `shape` and `datatype`. Raises InvalidInput (bad parameters, unknown region, out of
    its bounds, a byte size the shape contradicts) or Unsupported when `regions` is None."""
    ref = region_ref(params, f"input '{name}'")
    if ref is None:
        return None
    if regions is None:
        raise Unsupported(f"input '{name}': {_NO_REGIONS}")
    data = regions.slice(ref).read()
    check_input_bytes(name, datatype, shape, data)
    return data


def output_to_region(regions: Regions | None, name: str, params: Mapping[str, object]) -> RegionSlice | None:
    """Where output `name` goes when its `params` name a region (else None), checked against the region
    now, before anything is computed (Triton checks at the request, too). Raises as input_from_region."""
    ref = region_ref(params, f"output '{name}'")
    if ref is None:
        return None
    if "classification" in params:
        raise InvalidInput("Output can't set both 'shared_memory_region' and 'classification'")
    if params.get("binary_data") is True:
        raise InvalidInput("Output can't set both 'shared_memory_region' and 'binary_data'")
    if regions is None:
        raise Unsupported(f"output '{name}': {_NO_REGIONS}")
    return regions.slice(ref)
