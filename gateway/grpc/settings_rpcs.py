"""The LogSettings and TraceSetting RPCs over gateway/runtime_settings.py, which HTTP's /v2/logging and
/v2[/models/NAME]/trace/setting use too: message conversion only, the validation and the errors
(INVALID_ARGUMENT, UNIMPLEMENTED for a log or trace file) are the same as over HTTP. A request without
settings reads them (gRPC has no GET), as in Triton."""

from __future__ import annotations

from typing import Any

from fleet.trace_settings import response_to_grpc, update_from_grpc
from gateway.grpc.service_proto import service_pb2 as pb
from gateway.runtime_settings import RuntimeSettings


def _log_value(value: Any) -> Any:
    """One LogSettingsRequest.SettingValue as the JSON value HTTP takes (None: no value, no change)."""
    choice = value.WhichOneof("parameter_choice")
    return None if choice is None else getattr(value, choice)


async def log_settings(runtime: RuntimeSettings, request: Any) -> Any:
    update = {name: _log_value(value) for name, value in request.settings.items()}
    doc = await runtime.log_settings(update)
    response = pb.LogSettingsResponse()
    for name, value in doc.items():
        setting = response.settings[name]
        if isinstance(value, bool):
            setting.bool_param = value
        elif isinstance(value, int):
            setting.uint32_param = value
        else:
            setting.string_param = str(value)
    return response


async def trace_setting(runtime: RuntimeSettings, request: Any) -> Any:
    update = update_from_grpc({name: list(value.value) for name, value in request.settings.items()})
    doc = await runtime.trace_settings(request.model_name or None, update)
    response = pb.TraceSettingResponse()
    for name, values in response_to_grpc(doc).items():
        response.settings[name].value.extend(values)
    return response
