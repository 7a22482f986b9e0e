"""Triton's ModelConfig protobuf module (`model_config_pb2`), without the gRPC client around it.

The generated module lives in tritonclient's `grpc` package, whose `__init__` imports grpcio, the whole gRPC
client, ml_dtypes and rapidjson: ~20 MiB of resident memory in every process that only parses a config.pbtxt
(a worker, the bulk-job worker, and each Python-backend stub, one per model instance). The module itself needs
only protobuf, so it is executed from its file, under its own full name.

It is registered in `sys.modules` under that name, so a later `import tritonclient.grpc` (the gateway's gRPC
server) finds it there rather than executing it again: `from tritonclient.grpc import model_config_pb2` falls back
to `sys.modules` for a submodule its package has no attribute for. There is one module and one set of message
classes in the process, whichever is imported first.

    from fleet.config_proto import model_config_pb2 as pb
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

_NAME = "tritonclient.grpc.model_config_pb2"


def _load() -> ModuleType:
    loaded = sys.modules.get(_NAME)
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("tritonclient")  # the top package: its __init__ imports nothing
    if package is None or package.origin is None:
        raise ImportError("tritonclient is not installed (fleet needs tritonclient[grpc] for Triton's schemas)")
    spec = importlib.util.spec_from_file_location(_NAME, Path(package.origin).parent / "grpc" / "model_config_pb2.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no {_NAME} in {Path(package.origin).parent}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NAME]
        raise
    return module


if TYPE_CHECKING:
    # The type checker reads the real module (untyped here, so its messages are Any either way).
    from tritonclient.grpc import model_config_pb2 as model_config_pb2
else:
    model_config_pb2 = _load()
