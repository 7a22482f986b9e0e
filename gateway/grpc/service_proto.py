"""Triton's gRPC service messages (`service_pb2`: ModelInferRequest and the rest), loaded without tritonclient's
gRPC client, as fleet/config_proto.py loads ModelConfig: the gateway serves gRPC with its own HTTP/2 code
(server.py) and needs only the messages, not grpcio (each gateway process 96 -> 79 MiB with fleet/cli.py's part:
bench/RESULTS.md, stop 57).

    from gateway.grpc.service_proto import service_pb2 as pb
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleet.config_proto import load_generated  # (which loads model_config_pb2 first: service_pb2 imports it)

if TYPE_CHECKING:
    from tritonclient.grpc import service_pb2 as service_pb2
else:
    service_pb2 = load_generated("service_pb2")
