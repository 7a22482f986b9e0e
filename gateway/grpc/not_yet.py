"""The RPCs of GRPCInferenceService that fleet's gRPC service does not serve yet: each answers
UNIMPLEMENTED with the reason below.

THE place to wire them in: give gateway/grpc/service.py's InferenceService a method named as the RPC
(`async def LogSettings(self, request, context) -> LogSettingsResponse`, the request parsed, errors as
ServingError) and delete its line here; gateway/grpc/handlers.py serves every RPC the service has, and
tests/unit/test_grpc_codec.py checks that each RPC of the proto is either served or listed here.

Every RPC of the proto is served now; the list stays, empty, for the next one the proto adds.
"""

from __future__ import annotations

NOT_YET: dict[str, str] = {}
