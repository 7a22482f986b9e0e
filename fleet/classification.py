"""Triton's classification extension: an output requested with `classification: K` comes back as the top K
classes of each batch entry instead of the tensor itself.

As Triton's front ends write it (server src/classification.cc and the HTTP/gRPC output writers): per batch
entry (the first dimension when the model batches), the K largest values in descending order, each as the
BYTES string "value:index" or, when the output names a `label_filename`, "value:index:label" (the label on
line `index` of that file). A float value is written as C++'s std::to_string writes it ("%f"), an integer as
its digits. The output becomes BYTES with shape [batch, min(K, elements per entry)] ([min(K, elements)]
without a batch dimension). Only numeric outputs can be classified (not BYTES, BOOL, FP16 or BF16). An entry
of more than MAX_ELEMENTS values is refused, as Triton releases after 2.51 refuse it: the sort runs on the
gateway's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fleet import tensors
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput

# Later Tritons refuse to classify an entry with more values ("classification output tensor too large").
MAX_ELEMENTS = 1_000_000
_FLOATS = {"FP32", "FP64"}
_INTEGERS = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}


def check_classifiable(datatype: str) -> None:
    """Raises InvalidInput, with Triton's words, for an output datatype classification cannot take."""
    if datatype not in _FLOATS and datatype not in _INTEGERS:
        raise InvalidInput(f"class result not available for output due to unsupported type '{datatype}'")


def classify(output: WireTensor, count: int, batched: bool, labels: Sequence[bytes] = ()) -> WireTensor:
    """`output` replaced by its top `count` classes per batch entry (`batched`: its first dimension is the
    batch), labelled from `labels` where it has a non-empty line for the class."""
    check_classifiable(output.datatype)
    values = tensors.from_bytes(output.data, tensors.lookup(output.datatype), output.shape)
    batch = int(output.shape[0]) if batched and output.shape else 0
    rows = values.reshape(max(1, batch), -1)
    per_entry = rows.shape[1]
    if per_entry > MAX_ELEMENTS:
        raise InvalidInput("classification output tensor too large")
    k = min(count, per_entry)
    # Descending by value, the lower index first among equal values (Triton's sort leaves ties in no set
    # order): a stable ascending sort of each reversed row, read backwards.
    top = (per_entry - 1) - np.argsort(rows[:, ::-1], axis=1, kind="stable")[:, ::-1][:, :k]
    picked = np.take_along_axis(rows, top, axis=1)
    floats = output.datatype in _FLOATS
    classes: list[bytes] = []
    for indices, row in zip(top.tolist(), picked.tolist(), strict=True):
        for index, value in zip(indices, row, strict=True):
            text = b"%f:%d" % (value, index) if floats else b"%d:%d" % (value, index)
            label = labels[index] if index < len(labels) else b""
            classes.append(text + b":" + label if label else text)
    shape = (batch, k) if batch else (k,)
    return WireTensor(output.name, "BYTES", shape, tensors.serialize_bytes(np.array(classes, dtype=object)))


def requested_classes(params: dict[str, object], name: str, datatype: str) -> int:
    """How many classes output `name` (config datatype `datatype`) asks for in its request parameters: the
    `classification` parameter (0 or absent: the tensor itself). Refused before anything is computed when
    the count is not a non-negative integer or the output cannot be classified."""
    count = params.get("classification", 0)
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 2**32 - 1:
        raise InvalidInput(f"output '{name}': parameter 'classification' must be a non-negative integer")
    if count:
        check_classifiable(datatype)
    return count


def read_labels(path: Path) -> tuple[bytes, ...]:
    """The class labels of a `label_filename`: its lines as Triton reads them (split at "\\n" only, as
    std::getline does, bytes as they are). Empty when the file cannot be read: classes are then answered as
    "value:index", as for an output without labels."""
    try:
        data = path.read_bytes()
    except OSError:
        return ()
    lines = data.split(b"\n")
    return tuple(lines[:-1] if lines and lines[-1] == b"" else lines)
