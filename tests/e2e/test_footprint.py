"""What each of `fleet up`'s processes has loaded, read from /proc/PID/maps of the running system: grpcio's core in
none (they use Triton's generated messages alone, fleet/config_proto.py, and the gateway serves gRPC with its own
HTTP/2 code), and no numpy in `fleet up` itself (the client commands' modules are imported only to run them,
fleet/cli.py). Each Python-backend stub is one process per model instance: what one loads is paid per instance."""

from __future__ import annotations

import os
from pathlib import Path

import grpc  # noqa: F401  (loaded here, so the check below can see that it finds grpcio where it is loaded)

from bench.procs import descendants
from tests.e2e.conftest import RunningSystem

GRPC_CORE = "cygrpc"  # grpcio's extension module: with tritonclient.grpc, 12-19 MiB a process
NUMPY_CORE = "_multiarray_umath"


def _mapped(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_no_process_loads_grpcio_and_fleet_up_loads_no_numpy(system: RunningSystem) -> None:
    tree = {pid: b" ".join(argv).decode(errors="replace") for pid, argv in descendants(system.process.pid)}
    roles = {"gateway": "fleet gateway", "worker": "fleet worker", "jobs worker": "fleet jobs-worker",
             "stub": "workers.backends.python_stub"}
    found = {role: [pid for pid, argv in tree.items() if needle in argv] for role, needle in roles.items()}
    assert all(found.values()), f"a role is missing from fleet up's tree: {found}"

    maps = {pid: _mapped(pid) for pid in [p for pids in found.values() for p in pids]}
    assert GRPC_CORE in _mapped(os.getpid())
    loaded = {f"{role} {pid}": tree[pid] for role, pids in found.items() for pid in pids if GRPC_CORE in maps[pid]}
    assert not loaded, f"grpcio loaded: {loaded}"

    up = _mapped(system.process.pid)
    assert GRPC_CORE not in up and NUMPY_CORE not in up
    assert all(NUMPY_CORE in maps[pid] for pid in maps)  # the check sees a library where it is loaded
