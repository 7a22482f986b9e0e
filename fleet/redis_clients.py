"""How every fleet process builds its Redis clients from the one URL (redis://, rediss://, unix://;
AUTH, ACL user and TLS options all come from the URL)."""

from __future__ import annotations

import redis.asyncio as aioredis

# A server that is down refuses at once; one that is unreachable (a partition, a host gone) would
# otherwise hold a connect for the OS's TCP timeout, minutes, while callers wait.
CONNECT_TIMEOUT_S = 5.0


def async_client(url: str) -> aioredis.Redis:
    # RESP2 explicitly: redis-py 8 defaults to RESP3, whose reply shapes differ.
    return aioredis.Redis.from_url(url, protocol=2, decode_responses=False, health_check_interval=30,
                                   socket_connect_timeout=CONNECT_TIMEOUT_S)
