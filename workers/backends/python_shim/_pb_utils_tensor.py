"""The `Tensor` of the `triton_python_backend_utils` shim: a named numpy array, with DLPack both ways.
Re-exported by triton_python_backend_utils; models never import this module directly."""

from __future__ import annotations

from typing import Any

import numpy as np
from _pb_utils_types import _FROM_NAME, _TO_NAME, TritonModelException, numpy_to_triton_type


class Tensor:
    """A named numpy array. BYTES tensors are object arrays of bytes.

    `triton_dtype` (fleet extension, as in older Triton releases) pins the datatype when numpy
    cannot express it, e.g. 14 (BF16) over a float32 array.
    """

    def __init__(self, name: str, numpy_array: Any, triton_dtype: int | None = None) -> None:
        array = np.asarray(numpy_array)
        if array.dtype.kind in ("S", "U"):
            array = _to_object_bytes(array)
        code = numpy_to_triton_type(array.dtype) if triton_dtype is None else int(triton_dtype)
        if code is None or code not in _TO_NAME:
            raise TritonModelException(
                f"Tensor '{name}': numpy dtype {array.dtype} is not supported by the Python backend"
            )
        self._name = name
        self._array = array
        self._triton_dtype = code

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return self._triton_dtype

    def _datatype(self) -> str:
        return str(_TO_NAME[self._triton_dtype])

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule over the data (copied first if read-only or non-contiguous)."""
        return _exportable(self)._array.__dlpack__()

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return _exportable(self)._array.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU, device 0

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A Tensor from a DLPack capsule or any object with __dlpack__ (GPU data is copied to CPU)."""
        if hasattr(capsule, "__dlpack__"):
            try:
                return Tensor(name, np.from_dlpack(capsule))
            except (BufferError, TypeError, RuntimeError, ValueError):
                pass  # non-CPU device or a dtype numpy lacks (bf16): let torch convert it
        import torch  # lazy: the shim must stay importable without paying for torch
        import torch.utils.dlpack

        t = torch.utils.dlpack.from_dlpack(capsule).detach().cpu()
        if t.dtype == torch.bfloat16:
            return Tensor(name, t.float().numpy(), triton_dtype=_FROM_NAME["BF16"])
        return Tensor(name, t.numpy())

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, {self._datatype()}, shape={self.shape()})"


def _to_object_bytes(array: np.ndarray) -> np.ndarray:
    out = np.empty(array.shape, dtype=np.object_)
    flat = out.reshape(-1)
    for i, item in enumerate(array.reshape(-1).tolist()):
        flat[i] = item.encode() if isinstance(item, str) else bytes(item)
    return out


def _exportable(tensor: Tensor) -> Tensor:
    array = tensor._array
    if array.dtype == np.object_:
        raise TritonModelException(f"Tensor '{tensor._name}': BYTES tensors cannot be shared via DLPack")
    if not array.flags.writeable or not array.flags.c_contiguous:
        return Tensor(tensor._name, np.array(array, copy=True, order="C"), tensor._triton_dtype)
    return tensor
