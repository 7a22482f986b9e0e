"""`fleet up`'s child command lines: one gateway by default, or --gateways N sharing the ports, each with
its own trace file; and the flags `fleet gateway` reads them with."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.cli import build_parser, settings_from_args
from fleet.launcher import _child_commands, _gateway_commands
from fleet.settings import Settings


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_gateway_by_default_without_reuse_port() -> None:
    commands = _child_commands(Settings(gateway_id="gw-a"), workers=1, shm_dir=Path("/tmp/x/shm"))
    assert [n for n in commands if "gateway" in n] == ["gateway"]
    assert not {"--reuse-port", "--trace-file", "--shared-memory-dir", "--gateway-id"} & set(commands["gateway"])


def test_n_gateways_share_the_ports_with_a_trace_file_each() -> None:
    settings = Settings(gateways=3, http_port=9100, metrics_port=9102, grpc_port=9101,
                        trace_file=Path("/tmp/x/trace.json"), gateway_id="gw-a")
    commands = _child_commands(settings, workers=1, shm_dir=Path("/tmp/x/shm-regions"))
    gateways = [argv for name, argv in commands.items() if name.startswith("gateway")]
    assert [n for n in commands if n.startswith("gateway")] == ["gateway-0", "gateway-1", "gateway-2"]
    for argv in gateways:
        assert "--reuse-port" in argv and _flag(argv, "--shared-memory-dir") == "/tmp/x/shm-regions"
        assert (_flag(argv, "--http-port"), _flag(argv, "--metrics-port"), _flag(argv, "--grpc-port")) == \
            ("9100", "9102", "9101")
    assert [_flag(argv, "--trace-file") for argv in gateways] == [
        "/tmp/x/trace-gateway-0.json", "/tmp/x/trace-gateway-1.json", "/tmp/x/trace-gateway-2.json"]
    # A set id becomes one each: one reply stream each (a shared one would be trimmed under the others).
    assert [_flag(argv, "--gateway-id") for argv in gateways] == ["gw-a-0", "gw-a-1", "gw-a-2"]
    unset = _child_commands(Settings(gateways=2, gateway_id=""), 1, Path("/tmp/x/shm"))
    assert "--gateway-id" not in unset["gateway-0"]
    # What each child makes of its command line.
    parsed = settings_from_args(build_parser().parse_args(gateways[1][3:]))
    assert parsed.reuse_port and parsed.trace_file == Path("/tmp/x/trace-gateway-1.json")
    assert parsed.shared_memory_dir == Path("/tmp/x/shm-regions") and parsed.gateway_id == "gw-a-1"
    assert parsed.http_port == 9100 and parsed.grpc_port == 9101


def test_fleet_up_takes_gateways() -> None:
    assert settings_from_args(build_parser().parse_args(["up", "--gateways", "4"])).gateways == 4
    assert settings_from_args(build_parser().parse_args(["up"])).gateways == 1


def test_fleet_gateway_takes_processes_and_its_children_are_one_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fleet gateway --processes N` (or FLEET_GATEWAYS=N) runs a group; each child is told `--processes 1`,
    which wins over the FLEET_GATEWAYS it inherits, so a child never runs a group of its own."""
    monkeypatch.setenv("FLEET_GATEWAYS", "3")
    assert settings_from_args(build_parser().parse_args(["gateway"])).gateways == 3
    settings = settings_from_args(build_parser().parse_args(["gateway", "--processes", "2", "--http-port", "9200"]))
    assert settings.gateways == 2
    for argv in [*_gateway_commands(settings, Path("/tmp/x/shm")).values(),
                 _gateway_commands(Settings(gateways=1), Path("/tmp/x/shm"))["gateway"]]:
        child = settings_from_args(build_parser().parse_args(argv[3:]))
        assert child.gateways == 1
    assert list(_gateway_commands(settings, Path("/tmp/x/shm"))) == ["gateway-0", "gateway-1"]
