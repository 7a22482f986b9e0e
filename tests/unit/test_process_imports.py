"""What fleet's processes import, each case in a fresh interpreter (this one has imported everything already):
- Triton's generated modules without tritonclient.grpc's client (fleet/config_proto.py, gateway/grpc/service_proto.py),
  and the same message classes whichever of them and the real package is imported first;
- the gateway's gRPC status codes, grpcio's own numbers (gateway/grpc/status_codes.py);
- a server command's process imports none of the client commands' dependencies (fleet/cli.py, fleet/client_args.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import grpc
import pytest

from gateway.grpc.status_codes import StatusCode
from tests.support.processes import ROOT

CLIENT_ONLY = ("grpc", "tritonclient.grpc", "ml_dtypes", "rapidjson")


def _python(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_config_module_alone_brings_no_grpc_client() -> None:
    _python(f"""
        import sys
        from fleet.config_proto import model_config_pb2 as pb
        cfg = pb.ModelConfig(name="m", max_batch_size=8)
        assert pb.ModelConfig.FromString(cfg.SerializeToString()).max_batch_size == 8
        loaded = [m for m in {CLIENT_ONLY!r} if m in sys.modules]
        assert not loaded, loaded
    """)


def test_the_gateway_imports_no_grpc_client() -> None:
    _python(f"""
        import sys
        import gateway.server, gateway.grpc.server
        loaded = [m for m in {CLIENT_ONLY!r} if m in sys.modules]
        assert not loaded, loaded
    """)


@pytest.mark.parametrize("first", ["fleet.config_proto", "gateway.grpc.service_proto", "tritonclient.grpc"])
def test_the_same_messages_whichever_comes_first(first: str) -> None:
    # tritonclient's package as usual beside fleet's loading, however it is imported (a client, a user's model).
    _python(f"""
        import importlib
        importlib.import_module({first!r})
        import tritonclient.grpc.model_config_pb2 as dotted
        import tritonclient.grpc as client
        from fleet.config_proto import model_config_pb2 as pb
        from gateway.grpc.service_proto import service_pb2
        assert client.InferenceServerClient  # the real package, not the loader's stand-in
        assert dotted.ModelConfig is pb.ModelConfig and client.model_config_pb2 is dotted
        assert client.service_pb2.ModelInferRequest is service_pb2.ModelInferRequest
        # The gateway's responses embed the messages fleet's config parser builds.
        response = service_pb2.ModelConfigResponse(config=pb.ModelConfig(name="m"))
        assert type(response.config) is dotted.ModelConfig
        assert client.service_pb2.ModelConfigResponse.FromString(response.SerializeToString()).config.name == "m"
    """)


def test_status_codes_are_grpcs_own() -> None:
    assert {c.name: c.value[0] for c in grpc.StatusCode} == {c.name: c.value for c in StatusCode}


def test_server_commands_import_no_client_command_dependencies() -> None:
    _python("""
        import sys
        from fleet import cli
        cli.build_parser().parse_args(["up"])
        import fleet.launcher, workers.main, fleet.jobs.worker  # what up, worker and jobs-worker run
        import workers.backends.python_stub  # one process per Python-backend instance
        loaded = [m for m in ("rich", "httpx", "fleet.analyzer.run", "fleet.job_client", "fleet.status_cli", "grpc",
                              "tritonclient.grpc") if m in sys.modules]
        assert not loaded, loaded
    """)
