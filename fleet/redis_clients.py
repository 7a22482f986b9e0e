"""How every fleet process builds its Redis clients from the one URL (redis://, rediss://, unix://;
AUTH, ACL user and TLS options all come from the URL)."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, AuthorizationError, NoPermissionError, RedisError

from fleet.backoff import Backoff

log = logging.getLogger(__name__)

# A server that is down refuses at once; one that is unreachable (a partition, a host gone) would
# otherwise hold a connect for the OS's TCP timeout, minutes, while callers wait.
CONNECT_TIMEOUT_S = 5.0


def async_client(url: str) -> aioredis.Redis:
    # RESP2 explicitly: redis-py 8 defaults to RESP3, whose reply shapes differ.
    return aioredis.Redis.from_url(url, protocol=2, decode_responses=False, health_check_interval=30,
                                   socket_connect_timeout=CONNECT_TIMEOUT_S)


# Errors that retrying cannot fix: a refused password or ACL, a certificate that does not verify. Every
# other connection error (refused, reset, timed out, the server loading its AOF) is an outage, waited out.
_FATAL_TEXT = ("WRONGPASS", "NOAUTH", "NOPERM", "invalid username-password", "CERTIFICATE_VERIFY_FAILED",
               "certificate verify failed", "wrong version number")


def unrecoverable(exc: BaseException) -> bool:
    """Whether a Redis error is a configuration problem (credentials, ACL, TLS) rather than an outage."""
    if isinstance(exc, (AuthenticationError, AuthorizationError, NoPermissionError)):
        return True
    return isinstance(exc, RedisError) and any(text in str(exc) for text in _FATAL_TEXT)


async def wait_for_redis(client: aioredis.Redis, who: str) -> None:
    """Until Redis answers PING, retrying an outage with capped backoff for as long as it lasts; an
    unrecoverable error (credentials, ACL, TLS) is raised at once, with the server's reason."""
    backoff = Backoff()
    while True:
        try:
            await client.ping()
            return
        except (RedisError, OSError) as exc:
            if unrecoverable(exc):
                raise
            delay = backoff.next_delay()
            log.warning("%s: Redis is not reachable (%s); retrying in %.2f s", who, exc, delay)
            await asyncio.sleep(delay)
