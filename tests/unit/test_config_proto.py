"""fleet/config_proto.py: Triton's ModelConfig module without tritonclient.grpc's client, and one module whichever of
the two is imported first; fleet/cli.py: a server command's process imports no client command's dependencies.
Each case runs in a fresh interpreter (this one has imported everything already)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.processes import ROOT


def _python(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_module_alone_brings_no_grpc_client() -> None:
    _python("""
        import sys
        from fleet.config_proto import model_config_pb2 as pb
        cfg = pb.ModelConfig(name="m", max_batch_size=8)
        assert pb.ModelConfig.FromString(cfg.SerializeToString()).max_batch_size == 8
        loaded = [m for m in ("grpc", "tritonclient.grpc", "ml_dtypes", "rapidjson") if m in sys.modules]
        assert not loaded, loaded
    """)


@pytest.mark.parametrize("first", ["fleet.config_proto", "tritonclient.grpc"])
def test_one_module_and_one_set_of_messages_whichever_comes_first(first: str) -> None:
    _python(f"""
        import importlib
        importlib.import_module({first!r})
        import tritonclient.grpc as client
        from tritonclient.grpc import service_pb2
        from fleet.config_proto import model_config_pb2 as pb
        assert client.model_config_pb2 is pb
        # The gateway's responses embed the messages fleet's config parser builds.
        response = service_pb2.ModelConfigResponse(config=pb.ModelConfig(name="m"))
        assert type(response.config) is pb.ModelConfig
        assert service_pb2.ModelConfigResponse.FromString(response.SerializeToString()).config.name == "m"
    """)


def test_server_commands_import_no_client_command_dependencies() -> None:
    _python("""
        import sys
        from fleet import cli
        cli.build_parser().parse_args(["up"])
        import fleet.launcher, workers.main, fleet.jobs.worker  # what up, worker and jobs-worker run
        loaded = [m for m in ("rich", "httpx", "fleet.analyzer.run", "fleet.job_client", "fleet.status_cli", "grpc")
                  if m in sys.modules]
        assert not loaded, loaded
    """)
