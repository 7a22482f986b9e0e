"""Bearer-token auth through the real gateway app and worker (gateway/auth.py): scopes, constant-time
keys, open health probes, and model control off without keys unless enabled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import InvalidInput
from fleet.redis_server import LocalServer
from fleet.settings import Settings
from gateway.auth import AuthGate, scope_of
from tests.integration.test_pipeline import MODELS, fp32_request
from tests.support.system import InProcessSystem, in_process_system


def run(redis_server: LocalServer, key_prefix: str, body: Callable[[InProcessSystem], Awaitable[None]],
        **overrides: Any) -> None:
    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [MODELS], **overrides) as system:
            await body(system)

    asyncio.run(main())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_guard_inference_jobs_and_control_but_not_health(redis_server: LocalServer, key_prefix: str,
                                                               tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# operators\nfile-key\n\n")

    async def body(s: InProcessSystem) -> None:
        c = s.client
        infer = "/v2/models/doubler/infer"
        r = await c.post(infer, json=fp32_request([[1.0]]))
        assert r.status_code == 401 and "API key" in r.json()["error"]
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert (await c.post(infer, json=fp32_request([[1.0]]), headers=bearer("wrong"))).status_code == 401
        no_scheme = {"Authorization": "env-key"}
        assert (await c.post(infer, json=fp32_request([[1.0]]), headers=no_scheme)).status_code == 401
        for key in ("env-key", "second", "file-key"):
            r = await c.post(infer, json=fp32_request([[1.0]]), headers=bearer(key))
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2.0]
        assert (await c.get("/v2/health/ready")).status_code == 200  # probes need no key
        assert (await c.get("/v2/health/live")).status_code == 200
        assert (await c.get("/v2/models/doubler/config")).status_code == 401
        assert (await c.get("/v2/jobs")).status_code == 401
        assert (await c.get("/v2/jobs", headers=bearer("second"))).status_code == 200
        assert (await c.post("/v2/repository/index")).status_code == 401
        assert (await c.post("/v2/repository/index", headers=bearer("second"))).status_code == 200
        # The OpenAI-compatible routes are inference: the same keys (the openai client sends its api_key so).
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.post("/v1/chat/completions", json={"model": "doubler"})).status_code == 401
        r = await c.get("/v1/models", headers=bearer("file-key"))
        assert r.status_code == 200 and r.json() == {"object": "list", "data": []}  # doubler is not an LLM

    run(redis_server, key_prefix, body, api_keys="env-key, second", api_keys_file=keys_file)


def test_scopes_can_be_enforced_separately(redis_server: LocalServer, key_prefix: str) -> None:
    async def body(s: InProcessSystem) -> None:
        r = await s.client.post("/v2/models/doubler/infer", json=fp32_request([[3.0]]))
        assert r.status_code == 200  # inference left open
        assert (await s.client.post("/v2/repository/index")).status_code == 401
        override = {"parameters": {"config": "{\"max_batch_size\": 1}"}}
        assert (await s.client.post("/v2/repository/models/doubler/load", json=override)).status_code == 401
        assert (await s.client.get("/v2/jobs")).status_code == 200

    run(redis_server, key_prefix, body, api_keys="k", auth_scopes="control")


@pytest.mark.parametrize(("control_api", "status"), [(False, 403), (True, 200)])
def test_without_keys_model_control_is_off_unless_enabled(redis_server: LocalServer, key_prefix: str,
                                                          control_api: bool, status: int) -> None:
    async def body(s: InProcessSystem) -> None:
        r = await s.client.post("/v2/repository/index")
        assert r.status_code == status, r.text
        assert (await s.client.post("/v2/models/doubler/infer", json=fp32_request([[1.0]]))).status_code == 200

    run(redis_server, key_prefix, body, control_api=control_api)


def test_scope_table_and_bad_settings() -> None:
    assert scope_of("/v2/health/ready") is None
    assert scope_of("/v2/repository/models/x/load") == "control"
    assert scope_of("/v2/jobs/abc/results") == scope_of("/v2/jobs") == "jobs"
    assert scope_of("/v2/models/m/infer") == scope_of("/metrics") == scope_of("/v2") == "infer"
    with pytest.raises(InvalidInput, match="unknown auth scopes"):
        AuthGate(lambda *a: None, Settings(api_keys="k", auth_scopes="infer,admin"))  # type: ignore[arg-type]


def test_redis_auth_comes_from_the_url(tmp_path: Path) -> None:
    """A password-protected Redis: gateway, worker and the jobs API all authenticate from the URL alone."""
    from fleet.redis_server import start_server

    server = start_server(tmp_path / "redis", password="s3cret")
    url = f"redis://:s3cret@127.0.0.1:{server.port}/0"

    async def main() -> None:
        async with in_process_system(url, "authed", [MODELS], jobs_dir=tmp_path / "jobs") as s:
            r = await s.client.post("/v2/models/doubler/infer", json=fp32_request([[2.0]]))
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [4.0]
            assert (await s.client.get("/v2/jobs")).json() == {"jobs": []}

    try:
        asyncio.run(main())
        import redis

        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, password="wrong").ping()
    finally:
        server.stop()
