"""The shared-memory RPCs of GRPCInferenceService (SystemSharedMemory*, CudaSharedMemory*) over the
gateway's registry (gateway/shared_memory.py), which HTTP's routes use too: decoding and encoding only.
Errors are the registry's ServingErrors (INVALID_ARGUMENT, NOT_FOUND), as Triton's gRPC front end
answers them. An empty `name` means every region, as over HTTP."""

from __future__ import annotations

from typing import Any

from gateway.grpc.service_proto import service_pb2 as pb
from gateway.shared_memory import SharedMemoryRegistry


def system_status(registry: SharedMemoryRegistry, request: Any) -> Any:
    response = pb.SystemSharedMemoryStatusResponse()
    for region in registry.status(request.name):
        status = response.regions[str(region["name"])]
        status.name, status.key = str(region["name"]), str(region["key"])
        status.offset, status.byte_size = int(region["offset"]), int(region["byte_size"])
    return response


def system_register(registry: SharedMemoryRegistry, request: Any) -> Any:
    registry.register(request.name, request.key, request.offset, request.byte_size)
    return pb.SystemSharedMemoryRegisterResponse()


def system_unregister(registry: SharedMemoryRegistry, request: Any) -> Any:
    registry.unregister(request.name)
    return pb.SystemSharedMemoryUnregisterResponse()


def cuda_status(registry: SharedMemoryRegistry, request: Any) -> Any:
    registry.cuda_status(request.name)  # lists nothing, or raises NotFound for a name
    return pb.CudaSharedMemoryStatusResponse()


def cuda_register(registry: SharedMemoryRegistry, request: Any) -> Any:
    registry.cuda_register(request.name)
    return pb.CudaSharedMemoryRegisterResponse()  # not reached: registering is refused


def cuda_unregister(registry: SharedMemoryRegistry, request: Any) -> Any:
    registry.cuda_unregister(request.name)
    return pb.CudaSharedMemoryUnregisterResponse()
