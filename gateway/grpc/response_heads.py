"""ModelInferResponses serialized from a head kept per model, version and outputs: the twin of
gateway/grpc/request_heads.py on the way out.

A response carries every output's bytes in `raw_output_contents`, field 6, the message's last; protobuf's
implementations write a message's fields in the order of their numbers (the installed one, upb, does; any
parser takes them in any order). So the response serialized is its head serialized (model name, version,
the outputs' names, datatypes and shapes), then each output's bytes as one field-6 entry: its tag, its
length, the bytes. The head is what protobuf serializes for the response without its raw contents, kept for
the next reply of the same model, version and outputs. In process, for `mlp`'s reply (one 1 KiB output):
3.4-3.6 µs built and serialized by protobuf, 1.4-1.5 from a known head (bench/RESULTS.md, stop 63).

Only for what a head and the bytes are all of: no response parameters, no output written into a shared
memory region, no request id (an id is never seen twice: it would only fill the store), and every output's
bytes contiguous. Anything else is built by codec.py's encode_infer and serialized by protobuf, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fleet.envelope import WireTensor
from fleet.known_requests import LeastRecentlyUsed
from fleet.kserve import ParsedInfer
from gateway.grpc.service_proto import service_pb2 as pb

# Heads kept at most: one a model, version and output shapes, the batch dim included (one a batch size its
# clients send, and a shape a model with variable output dims answers with). The least recently used goes first.
CAPACITY = 1024
_RAW_TAG = b"\x32"  # field 6 (raw_output_contents), wire type 2 (length-delimited)


def varint(n: int) -> bytes:
    """`n` (>= 0) as a protobuf varint: 7 bits a byte, low bits first, the high bit set on all but the last."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class ResponseHeads:
    """`serialize` returns a reply's ModelInferResponse serialized, as protobuf would serialize the one
    encode_infer builds, from a known head when it can. One per gateway process (its event loop's)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._heads: LeastRecentlyUsed[tuple[Any, ...], bytes] = LeastRecentlyUsed(capacity)

    def __len__(self) -> int:
        return len(self._heads)

    def serialize(self, model: str, version: int, req: ParsedInfer, outputs: Sequence[WireTensor],
                  parameters: Mapping[str, Any]) -> bytes | None:
        """The response's bytes; None where a head does not make it (parameters, an output into a region, a
        request id): the caller builds the message (codec.py's encode_infer)."""
        if parameters or req.shm_outputs or req.client_id:
            return None
        pieces: list[bytes | memoryview] = []
        for t in outputs:
            data = t.data
            if type(data) is bytes:
                pieces += (_RAW_TAG, varint(len(data)), data)
            else:
                view = memoryview(data)
                if not view.c_contiguous:  # (join takes contiguous buffers only; protobuf copies any)
                    return None
                pieces += (_RAW_TAG, varint(view.nbytes), view)
        key = (model, version, *[(t.name, t.datatype, t.shape) for t in outputs])
        head = self._heads.get(key)
        if head is None:
            head = self._head(model, version, outputs)
            self._heads.put(key, head)
        return b"".join([head, *pieces])

    @staticmethod
    def _head(model: str, version: int, outputs: Sequence[WireTensor]) -> bytes:
        response = pb.ModelInferResponse(model_name=model, model_version=str(version), outputs=[
            pb.ModelInferResponse.InferOutputTensor(name=t.name, datatype=t.datatype, shape=t.shape)
            for t in outputs])
        head: bytes = response.SerializeToString()
        return head
