"""`fleet dead-letters MODEL [--replay]`: what a model's dead-letter stream holds, and putting it back.

A worker parks a message there when it cannot be answered: its envelope is unreadable, or it was
delivered `max_deliveries` times without completing (it kept killing workers). Each entry has the
original stream entry id, its version and lane, the reason and (since the payload is kept) the request itself, so
an operator can replay it once the cause is fixed; its caller was already told it failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from fleet.envelope import decode_request
from fleet.errors import InvalidInput
from fleet.keys import Keys


@dataclass(frozen=True, slots=True)
class DeadLetter:
    entry: str  # id in the dead-letter stream
    original: str  # id it had on its lane
    lane: int
    version: int  # the model version whose stream it came from
    reason: str
    request_id: str  # the envelope's id ("" when the payload is missing or unreadable)
    payload: bytes | None


def list_dead(client: redis.Redis, keys: Keys, model: str, count: int = 1000) -> list[DeadLetter]:
    raw: Any = client.xrange(keys.dead(model), count=count)
    out = []
    for entry_id, fields in raw:
        payload = fields.get(b"d")
        try:
            request_id = decode_request(payload).id if payload else ""
        except InvalidInput:
            request_id = ""
        out.append(DeadLetter(entry_id.decode(), fields.get(b"id", b"").decode(), int(fields.get(b"lane", 0)),
                              int(fields.get(b"version", 1)),
                              fields.get(b"reason", b"").decode(errors="replace"), request_id, payload))
    return out


def replay(client: redis.Redis, keys: Keys, model: str, letters: list[DeadLetter]) -> int:
    """Queue each letter's request again on its lane and remove it from the dead letters; returns how
    many went back (letters without a readable payload stay). Letters are written at least once (a worker
    that parked a message and lost its ack before stopping parks it again when it is claimed), so the
    letters of one message (the same request id, version, lane and original entry id: a sequence model's
    lane 0 is one stream per worker, whose ids may coincide) are queued once, and all of them removed
    with it."""
    # (request id, version, lane, original id) -> the payload, and the letters that hold it
    messages: dict[tuple[str, int, int, str], tuple[bytes, list[str]]] = {}
    for letter in letters:
        if letter.request_id and letter.payload is not None:
            # No original id (nothing to tell copies apart by): a letter of its own.
            key = (letter.request_id, letter.version, letter.lane, letter.original or letter.entry)
            messages.setdefault(key, (letter.payload, []))[1].append(letter.entry)
    for (_, version, lane, _), (payload, entries) in messages.items():
        pipe = client.pipeline(transaction=True)
        pipe.xadd(keys.queue(model, lane, version=version), {b"d": payload})
        pipe.xdel(keys.dead(model), *entries)
        pipe.execute()
    return len(messages)


def run(model: str, redis_url: str, key_prefix: str, do_replay: bool) -> int:
    client = redis.Redis.from_url(redis_url, protocol=2)
    keys = Keys(key_prefix)
    letters = list_dead(client, keys, model)
    for letter in letters:
        print(f"{letter.entry}  lane {letter.lane}  request {letter.request_id or '-'}  {letter.reason}")
    print(f"{len(letters)} dead letter(s) for model '{model}'")
    if do_replay:
        print(f"replayed {replay(client, keys, model, letters)} (copies of one message count once)")
    return 0
