"""The model worker's part in bulk-job tests, played by the test over the real streams: it reads a lane
(XRANGE), answers with OUT = 2 * IN (XADD to the request's reply stream, then XDEL of the request, in
that order, as a worker finishes), or injects the fault a test asks for by deleting entries for real.
A fake of our own seam (the model worker), never of Redis."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import redis

from fleet.envelope import ReplyEnvelope, RequestEnvelope, WireTensor, decode_request, encode_reply

ANSWER, HOLD, LOSE_REQUEST, LOSE_REPLY = "answer", "hold", "lose request", "lose reply"
GARBLE_REPLY = "garble reply"
FAIL = "fail"

# KEYS[1] = reply stream; ARGV[1] = the encoded reply. Written and deleted atomically: the reply is lost
# before its reader can see it, as when its stream is trimmed or lost in a restart without AOF.
_LOSE_REPLY = """
local id = redis.call('XADD', KEYS[1], '*', 'd0', ARGV[1])
redis.call('XDEL', KEYS[1], id)
return id
"""


def doubled(env: RequestEnvelope) -> ReplyEnvelope:
    """The reply of a one-input FP32 model computing OUT = 2 * IN."""
    (t,) = env.inputs
    out = (np.frombuffer(t.data, dtype="<f4") * 2).astype("<f4").tobytes()
    return ReplyEnvelope(id=env.id, model_version=env.version, outputs=[WireTensor("OUT", "FP32", t.shape, out)])


def answer_all(env: RequestEnvelope, sends: int) -> str:
    return ANSWER


class LaneWorker:
    """Reads one lane and handles each new request as `decide(env, times its request id was sent)` says:
    ANSWER, HOLD (leave it queued; `release` answers it later), LOSE_REQUEST (delete it from the lane
    unanswered), LOSE_REPLY (take it off the lane and answer it, but the reply is lost), GARBLE_REPLY
    (take it off the lane and answer it with an entry no envelope decoder reads) or FAIL (answer it with an
    error, as a model that failed)."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self.client = client
        self.stream = stream
        self.sent: Counter[str] = Counter()  # submissions seen per request id
        self.rows = 0  # rows of every submission seen
        self.seen: set[bytes] = set()
        self.held: dict[str, tuple[bytes, RequestEnvelope]] = {}
        # Replies get ids this far behind the host's clock, as from a Redis whose clock is behind (0: "*").
        self.clock_behind_ms = 0

    def poll(self, decide: Callable[[RequestEnvelope, int], str] = answer_all) -> None:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = self.client.xrange(self.stream)  # type: ignore[assignment]
        for entry_id, fields in entries:
            if entry_id in self.seen:
                continue
            self.seen.add(entry_id)
            env = decode_request(fields[b"d"])
            self.sent[env.id] += 1
            self.rows += env.batch_rows(True)
            action = decide(env, self.sent[env.id])
            if action == HOLD:
                self.held[env.id] = (entry_id, env)
            elif action == LOSE_REQUEST:
                self.client.xdel(self.stream, entry_id)
            elif action == LOSE_REPLY:
                self.client.eval(_LOSE_REPLY, 1, env.reply_to, encode_reply(doubled(env)))
                self.client.xdel(self.stream, entry_id)
            elif action == FAIL:
                self.answer(entry_id, env, ReplyEnvelope(id=env.id, model_version=env.version, error_code="INTERNAL",
                                                         error_message="the model failed"))
            elif action == GARBLE_REPLY:  # an out-of-band marker with a head longer than the entry
                self.client.xadd(env.reply_to, {b"d0": b"\xc1\xff\xff\x00\x00garbage"})
                self.client.xdel(self.stream, entry_id)
            else:
                self.answer(entry_id, env)

    def answer(self, entry_id: bytes, env: RequestEnvelope, reply: ReplyEnvelope | None = None) -> None:
        """As a worker finishes: the reply first, then the request leaves the lane (one ordered pipeline)."""
        pipe = self.client.pipeline(transaction=False)
        reply_id = f"{time.time_ns() // 1_000_000 - self.clock_behind_ms}-*" if self.clock_behind_ms else "*"
        pipe.xadd(env.reply_to, {b"d0": encode_reply(reply or doubled(env))}, id=reply_id)
        pipe.xdel(self.stream, entry_id)
        pipe.execute()

    def release(self, request_id: str) -> None:
        entry_id, env = self.held.pop(request_id)
        self.answer(entry_id, env)
