"""Triton's ModelConfig protobuf module (`model_config_pb2`), without the gRPC client around it.

The generated modules live in tritonclient's `grpc` package, whose `__init__` imports grpcio, the whole gRPC
client, ml_dtypes and rapidjson: ~20 MiB of resident memory in every process that only parses a config.pbtxt
(a worker, the bulk-job worker, and each Python-backend stub, one per model instance). The modules themselves
need only protobuf, so `load_generated` executes one from its file, under its own full name. The gateway's gRPC
server loads `service_pb2` so too (gateway/grpc/service_proto.py): it speaks gRPC with its own HTTP/2 code.

Each is registered in `sys.modules` under that name, so a later `import tritonclient.grpc` (a client in the same
process) finds it there rather than executing it again: the package's `from tritonclient.grpc import
model_config_pb2, service_pb2` falls back to `sys.modules` for a submodule it has no attribute for. There is one
module and one set of message classes in the process, whichever is imported first.

    from fleet.config_proto import model_config_pb2 as pb
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

PACKAGE = "tritonclient.grpc"


def load_generated(leaf: str) -> ModuleType:
    """tritonclient.grpc's generated module `leaf` (e.g. "service_pb2"), without running the package's __init__."""
    name = f"{PACKAGE}.{leaf}"
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    top = importlib.util.find_spec("tritonclient")  # the top package: its __init__ imports nothing
    if top is None or top.origin is None:
        raise ImportError("tritonclient is not installed (fleet needs tritonclient[grpc] for Triton's schemas)")
    directory = Path(top.origin).parent / "grpc"
    spec = importlib.util.spec_from_file_location(name, directory / f"{leaf}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no {name} in {directory}")
    module = importlib.util.module_from_spec(spec)
    stand_in = None
    if PACKAGE not in sys.modules:
        # A generated module imports the ones it depends on `from tritonclient.grpc` (service_pb2 imports
        # model_config_pb2), which would run the package's __init__. A stand-in package answers those imports
        # while the module runs, with what is loaded already, and is gone after: a later `import
        # tritonclient.grpc` runs the real __init__, which finds these modules in sys.modules.
        stand_in = ModuleType(PACKAGE)
        stand_in.__path__ = [str(directory)]
        for other, loaded_module in list(sys.modules.items()):
            if other.startswith(f"{PACKAGE}."):
                setattr(stand_in, other.rpartition(".")[2], loaded_module)
        sys.modules[PACKAGE] = stand_in
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if stand_in is not None and sys.modules.get(PACKAGE) is stand_in:
            del sys.modules[PACKAGE]
    return module


if TYPE_CHECKING:
    # The type checker reads the real module (untyped here, so its messages are Any either way).
    from tritonclient.grpc import model_config_pb2 as model_config_pb2
else:
    model_config_pb2 = load_generated("model_config_pb2")
