"""The gateway's gRPC flags, named and valued as tritonserver's (`--allow-grpc true`, times in ms), for
`fleet gateway` and `fleet up`; `fleet up` hands them on to its gateway with `argv`."""

from __future__ import annotations

import argparse
from typing import Any

from fleet.settings import Settings

# flag -> (Settings field, type); booleans take a value, as tritonserver's do (`--allow-grpc false`).
_FLAGS: dict[str, tuple[str, str]] = {
    "--allow-grpc": ("allow_grpc", "bool"),
    "--grpc-address": ("grpc_host", "str"),
    "--grpc-port": ("grpc_port", "int"),
    "--grpc-keepalive-time": ("grpc_keepalive_time_ms", "int"),
    "--grpc-keepalive-timeout": ("grpc_keepalive_timeout_ms", "int"),
    "--grpc-keepalive-permit-without-calls": ("grpc_keepalive_permit_without_calls", "bool"),
    "--grpc-http2-max-pings-without-data": ("grpc_http2_max_pings_without_data", "int"),
    "--grpc-http2-min-recv-ping-interval-without-data": ("grpc_http2_min_recv_ping_interval_without_data_ms", "int"),
    "--grpc-http2-max-ping-strikes": ("grpc_http2_max_ping_strikes", "int"),
    "--grpc-infer-response-compression-level": ("grpc_response_compression_level", "str"),
}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUE | _FALSE:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value in _TRUE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gRPC (tritonserver's flags)")
    for flag, (field, kind) in _FLAGS.items():
        default = Settings.model_fields[field].default
        converter: Any = {"bool": _bool, "int": int, "str": str}[kind]
        group.add_argument(flag, dest=field, type=converter, default=None, metavar=kind.upper(),
                           help=f"default {str(default).lower() if kind == 'bool' else default}")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The Settings fields the command line set explicitly."""
    return {field: getattr(args, field) for field, _ in _FLAGS.values() if getattr(args, field, None) is not None}


def argv(settings: Settings) -> list[str]:
    """`settings`' gRPC fields as flags of `fleet gateway`."""
    out: list[str] = []
    for flag, (field, kind) in _FLAGS.items():
        value = getattr(settings, field)
        out += [flag, str(value).lower() if kind == "bool" else str(value)]
    return out
