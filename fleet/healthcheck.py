"""`python -m fleet.healthcheck`: the image's HEALTHCHECK, one command for every role the image runs.

Not a `fleet` subcommand: the check runs every few seconds in every container, and `fleet`'s parser
imports every client command's modules (~1-2 s on a busy host, against a 10 s probe timeout); this
imports only the settings and the Redis client.

The role is what the container runs, read from PID 1's command line (the image's ENTRYPOINT is `fleet`,
so PID 1 is `fleet <role> ...`), so compose.yaml and Kubernetes need no per-role probe command:
- gateway (and `up`): its HTTP liveness endpoint answers 200 (Triton's /v2/health/live);
- worker: its heartbeat is in Redis and fresh (the key expires when the worker stops beating), found by
  this container's hostname, which the heartbeat records: a worker wedged or cut from Redis is unhealthy;
- jobs-worker: Redis answers (RQ's worker keeps no liveness of its own that outlives a wedged job).
Exit status 0 healthy, 1 not, with one line saying why (Docker keeps it in `docker inspect`).
"""

from __future__ import annotations

import argparse
import socket
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import redis

from fleet.keys import Keys
from fleet.settings import Settings

TIMEOUT_S = 3.0


def pid1_argv(proc: Path = Path("/proc/1/cmdline")) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in proc.read_bytes().split(b"\0") if a]
    except OSError:
        return []


def role_of(argv: Sequence[str]) -> tuple[str, dict[str, str]]:
    """`fleet gateway --http-port 8000 ...` (or `python -m fleet ...`) -> ("gateway", {"http-port": "8000"})."""
    args = list(argv)
    for i, a in enumerate(args):
        if a.endswith("fleet") or a == "fleet":
            args = args[i + 1:]
            break
    role = next((a for a in args if not a.startswith("-")), "")
    flags: dict[str, str] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            if eq:
                flags[name] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                flags[name] = args[i + 1]
    return role, flags


def check_http(port: int) -> str | None:
    url = f"http://127.0.0.1:{port}/v2/health/live"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:  # noqa: S310 (a fixed local URL)
            return None if reply.status == 200 else f"{url} answered {reply.status}"
    except OSError as exc:
        return f"{url}: {exc}"


def check_worker(client: redis.Redis, keys: Keys, host: str) -> str | None:
    try:
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in client.zrange(keys.workers(), 0, -1)]
        pipe = client.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hget(keys.worker(worker_id), "host")
        hosts = pipe.execute()
    except (redis.RedisError, OSError) as exc:
        return f"Redis: {exc}"
    if any(isinstance(h, bytes) and h.decode() == host for h in hosts):
        return None
    return f"no fresh heartbeat from a worker on host {host}"


def check(role: str, flags: dict[str, str], settings: Settings) -> str | None:
    if role in ("gateway", "up"):
        return check_http(int(flags.get("http-port", settings.http_port)))
    client = redis.Redis.from_url(settings.redis_url_or_default, socket_timeout=TIMEOUT_S,
                                  socket_connect_timeout=TIMEOUT_S)
    try:
        if role == "worker":
            return check_worker(client, Keys(flags.get("key-prefix", settings.key_prefix)), socket.gethostname())
        client.ping()
        return None
    except (redis.RedisError, OSError) as exc:
        return f"Redis: {exc}"
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleet.healthcheck",
                                description="exit 0 if this container's fleet process is healthy")
    p.add_argument("--role", help="gateway, worker or jobs-worker (default: read from PID 1's command line)")
    p.add_argument("--http-port", type=int, help="the gateway's HTTP port (default: PID 1's, or 8000)")
    args = p.parse_args(argv)
    role, flags = role_of(pid1_argv())
    if args.role:
        role = args.role
    if args.http_port is not None:
        flags["http-port"] = str(args.http_port)
    problem = check(role, flags, Settings())
    print(f"{role or 'fleet'}: {problem or 'healthy'}")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
