"""Triton's ModelConfig protobuf module (`model_config_pb2`), without the gRPC client around it.

The generated modules live in tritonclient's `grpc` package, whose `__init__` imports grpcio, the whole gRPC
client, ml_dtypes and rapidjson: 12-19 MiB of resident memory in every process that only parses a config.pbtxt
(a worker, the bulk-job worker, and each Python-backend stub, one per model instance). The modules themselves
need only protobuf, so `load_generated` executes one from its file. The gateway loads `service_pb2` so too
(gateway/grpc/service_proto.py): it serves gRPC with its own HTTP/2 code and needs only the messages.

Each is executed under a private name, not registered as `tritonclient.grpc.*` (or taken from the real package
when that is loaded already): code that imports tritonclient's package later in the same process (a client, a
user's Python-backend model) gets the package as usual, whatever it imports and however it spells it, and the
package's own modules then run again over the same descriptors. protobuf makes one class per message descriptor,
so both give the same message classes either way.

Load them at import time, from the main thread: while `service_pb2` runs, a stand-in of the package is in
`sys.modules` (`load_generated` says why).

    from fleet.config_proto import model_config_pb2 as pb
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

PACKAGE = "tritonclient.grpc"
_loaded: dict[str, ModuleType] = {}


def load_generated(leaf: str) -> ModuleType:
    """tritonclient.grpc's generated module `leaf` (e.g. "service_pb2"), without running the package's __init__."""
    module = _loaded.get(leaf) or sys.modules.get(f"{PACKAGE}.{leaf}")  # (the real package's, when it is loaded)
    if module is not None:
        _loaded[leaf] = module
        return module
    top = importlib.util.find_spec("tritonclient")  # (finding a top-level package runs nothing of it)
    if top is None or top.origin is None:
        raise ImportError("tritonclient is not installed (fleet needs tritonclient[grpc] for Triton's schemas)")
    path = Path(top.origin).parent / "grpc" / f"{leaf}.py"
    spec = importlib.util.spec_from_file_location(f"fleet.config_proto.{leaf}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ImportError(f"no {PACKAGE}.{leaf} at {path}")
    module = importlib.util.module_from_spec(spec)
    stand_in = None
    if _loaded and PACKAGE not in sys.modules:
        # A generated module imports those it depends on `from tritonclient.grpc` (service_pb2 imports
        # model_config_pb2, which imports none), which would run the package's __init__. A stand-in answers that
        # import with what is loaded here while the module runs, and is gone after: a later `import
        # tritonclient.grpc` runs the real one.
        stand_in = ModuleType(PACKAGE)
        stand_in.__dict__.update(_loaded)
        sys.modules[PACKAGE] = stand_in
    try:
        spec.loader.exec_module(module)
    finally:
        if stand_in is not None and sys.modules.get(PACKAGE) is stand_in:
            del sys.modules[PACKAGE]
    _loaded[leaf] = module
    return module


if TYPE_CHECKING:
    # The type checker reads the real module (untyped here, so its messages are Any either way).
    from tritonclient.grpc import model_config_pb2 as model_config_pb2
else:
    model_config_pb2 = load_generated("model_config_pb2")
