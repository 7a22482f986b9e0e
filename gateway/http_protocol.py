"""uvicorn's httptools protocol with coalesced writes and the gateway's limits at the connection level.

The connection's writes go through a CoalescingTransport (gateway/coalescing_transport.py): one send
per loop turn, not uvicorn's two per response.

uvicorn bounds neither the size of a request's head nor the time a client takes to send it or its body,
and reads a body whatever its announced length. Here, before anything reaches the app:
- Head size: the request line and headers are counted on the wire before the parser sees them; a head
  longer than `max_head_bytes` is 431, so a client holds at most that much of the gateway's memory. (A
  head pipelined behind another request within one read is the exception: the parser gives no offsets,
  so the limit applies to the shortest head that parses to what the parser kept, and to the bytes of
  the reads after the one it began in.)
- Read timeouts, Apache mod_reqtimeout's model: a head must arrive within `read_timeout_s`, extended by
  1 s per `min_rate_bps` bytes received, never past `header_timeout_max_s`; a body likewise, uncapped
  (a large upload at a sane rate passes). Past it, 408. A new connection's first head is timed from
  the accept; between requests uvicorn's keep-alive timeout applies (gateway/keep_alive.py); while the
  gateway itself is not reading (flow control, a pipelined request waiting its turn) the clock starts again.
- Body size: a Content-Length over the limit (`body_limit`; `max_upload_bytes` for job uploads) is
  413 from the header, before any body is read; a chunked body is counted as it arrives.
- Body bytes in flight: the bodies the process holds, each counted from its head (its Content-Length,
  or a chunked body's bytes so far) until its response is complete or its connection gone, are bounded
  by `max_in_flight_bytes`; a request that would pass it is 503 with Retry-After: 1, before its body is
  read. Job uploads are not counted: their route streams them to disk, so uvicorn's flow control keeps
  what one holds in memory to 64 KiB.
- Every error the protocol answers (these, and a request the parser rejects) is a JSON `{"error": ...}`
  body that says what was wrong, with `connection: close`; the connection then reads and drops what the
  client still sends for a moment (a lingering close), so closing does not reset the connection under
  the answer.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from fleet.settings import Settings
from gateway.coalescing_transport import CoalescingTransport
from gateway.http_limits import BodyBudget, EdgeLimits, Refused, error_answer
from gateway.keep_alive import IdleKeepAlive

UPLOADS = b"/v2/jobs/uploads"  # the one route whose bodies may be max_upload_bytes (streamed to disk)
# After an error answer, what the client still sends is read and dropped this long before closing:
# closing a socket with unread data makes the kernel send a reset, which can destroy the answer before
# the client reads it (nginx's lingering close does the same).
LINGER_S = 2.0
IDLE, HEAD, BODY = 0, 1, 2  # what a connection is reading: nothing timed, a request's head, its body
_UNTIMED = -1.0  # a phase's start before it is needed


# A request whose body counts in the budget, from its head until it is answered or dropped: [its cycle,
# the bytes it holds], RELEASED once they are given back. A list, not an object: one per request with a
# body, on the hot path.
Held = list[Any]
RELEASED = -1


def protocol_class(settings: Settings) -> type[EdgeHttpProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to this process's limits and its one
    body budget (uvicorn passes a protocol nothing of ours)."""

    class Configured(EdgeHttpProtocol):
        limits = EdgeLimits.from_settings(settings)
        budget = BodyBudget()

    return Configured


class EdgeHttpProtocol(IdleKeepAlive):
    limits: ClassVar[EdgeLimits]
    budget: ClassVar[BodyBudget]

    # Slots: uvicorn's own attributes nearly fill the instance dict's shared keys (30 in CPython 3.11);
    # past them every attribute access of the protocol, uvicorn's included, gets slower.
    __slots__ = ("_phase", "_phase_start", "_phase_bytes", "_timer", "_timer_at", "_head_bytes", "_heads", "_open",
                 "_begun", "_mid_read", "_body_limit", "_body_left", "_counted", "_chunked", "_held", "_unanswered",
                 "_closing", "_refusal")

    # Per request, on the hot path, this adds a few attribute updates in the parser callbacks, a pass
    # over the headers, and for a request with a body one Held; a request read in one piece (the
    # usual infer request) arms no timer.

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._phase = HEAD
        self._phase_start = self.loop.time()  # _UNTIMED until a read leaves the phase unfinished
        self._phase_bytes = 0  # received during this phase: each extends its timeout
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._head_bytes = 0  # of the head being read, counted on the wire
        self._heads = 0  # heads parsed on this connection
        self._open = False  # a message has begun and not completed
        self._begun = False  # a message was open or began during the current read
        self._mid_read = False  # the current head began inside a read, after another message
        self._body_limit = 0
        self._body_left: int | None = None  # a chunked body's bytes still allowed
        self._counted = False  # the chunked body being read counts against the budget
        self._chunked: Held | None = None
        self._held: deque[Held] = deque()  # requests whose bodies count in the budget, oldest first
        self._unanswered = 0  # requests running or waiting their turn (HTTP/1.1 answers in order)
        self._closing = False  # answered an error: nothing more is parsed
        self._refusal: bytes | None = None  # an error answer waiting for the responses before it
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
        # One timer per connection: re-armed when it fires early (see _on_timer), so the deadline can move
        # with every read at the cost of an addition.
        self._arm(self._deadline())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._release(everything=True)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # read only so that the error answer is not reset away; dropped
        self._unset_keepalive_if_required()
        self._begun = self._open
        n = len(data)
        if self._phase != BODY:  # a head begins or continues here: counted before the parser buffers it
            room = self.limits.max_head_bytes - self._head_bytes
            if n > room:
                self._past_head_room(data, room)
                return
            self._head_bytes += n
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # server.py serves no websockets: the request goes on as plain HTTP (as in uvicorn)
        except httptools.HttpParserError as exc:
            self._parse_failed(exc)
            return
        self._phase_bytes += n
        if self._phase != IDLE:
            self._time_phase()

    def _past_head_room(self, data: bytes, room: int) -> None:
        """`data` would take the head being read past its limit unless the head ends within `room`: the
        parser gets that much first and must have finished a head in it."""
        heads = self._heads
        if not self._feed(data[:room]):
            return
        if self._heads == heads:
            self._refuse(431, f"request line and headers exceed the limit of {self.limits.max_head_bytes} bytes")
            return
        if self._feed(data[room:]):
            self._phase_bytes += len(data)
            if self._phase != IDLE:
                self._time_phase()

    def _feed(self, data: bytes) -> bool:
        """Parses `data`; False if the request was refused (answered, closing)."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass
        except httptools.HttpParserError as exc:
            self._parse_failed(exc)
            return False
        return True

    def _parse_failed(self, exc: httptools.HttpParserError) -> None:
        cause = exc.__context__
        if isinstance(cause, Refused):
            self._refuse(cause.status, cause.message, cause.retry_after)
        elif isinstance(cause, httptools.HttpParserInvalidURLError | UnicodeDecodeError):
            self._refuse(400, "malformed HTTP request: the request target is not a valid URL")
        elif cause is not None:  # raised by uvicorn's own callbacks: say what, not how
            self._refuse(400, "malformed HTTP request")
        else:
            self._refuse(400, f"malformed HTTP request: {str(exc).rstrip('.').lower()}")

    def send_400_response(self, msg: str) -> None:  # uvicorn's plain-text 400, should anything still call it
        self._refuse(400, f"malformed HTTP request: {msg.rstrip('.').lower()}")

    # Parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._mid_read, self._begun, self._open = self._begun, True, True
        if self._phase == IDLE:  # a new connection's first head is already timed, from the accept
            self._phase, self._phase_start, self._phase_bytes = HEAD, _UNTIMED, 0

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, less its check of each header for `expect: 100-continue`, which on_headers_complete makes
        # in its one pass over them: a Python call fewer per header of every request. (llhttp keeps a value's
        # trailing whitespace, which RFC 9110 §5.5 leaves out of it.)
        self.headers.append((name.lower(), value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self._heads += 1
        self._head_bytes = 0
        if self._mid_read:
            # Pipelined behind another request in the same read: its bytes on the wire are not known (the
            # parser gives no offsets), so the shortest head that parses to what it kept is counted.
            size = (len(self.parser.get_method()) + len(self.url) + 14
                    + sum(len(name) + len(value) + 3 for name, value in self.headers))
            if size > self.limits.max_head_bytes:
                raise Refused(431, f"request line and headers exceed the limit of {self.limits.max_head_bytes}"
                                    " bytes")
        length, chunked, reserve = 0, False, 0
        for name, value in self.headers:
            if name == b"content-length":
                length = int(value)  # the parser has checked its digits, overflow and duplicates
            elif name == b"transfer-encoding":
                chunked = True  # the parser refuses any other transfer coding of a request
            elif name == b"expect" and value.lower() == b"100-continue":
                self.expect_100_continue = True  # (uvicorn's on_header would have set it)
        if length or chunked:
            limits, url = self.limits, self.url
            upload = (url.startswith(UPLOADS) and url[len(UPLOADS):len(UPLOADS) + 1] in (b"", b"?")
                      and self.parser.get_method() == b"POST")
            limit = limits.max_upload_bytes if upload else limits.body_limit
            if length > limit:
                raise Refused(413, f"the request body of {length} bytes exceeds the limit of {limit} bytes")
            if not upload:  # uploads are streamed to disk: uvicorn's flow control bounds what they hold
                reserve = length
                if reserve:
                    if self.budget.held + reserve > limits.max_in_flight_bytes:
                        raise Refused(503, self._over_budget(), retry_after=True)
                    self.budget.held += reserve
            if chunked:
                self._body_limit, self._body_left, self._counted = limit, limit, not upload
        self._phase, self._phase_start, self._phase_bytes = BODY, _UNTIMED, 0
        try:
            self._begin_cycle()  # with server.py's ws="none", always a new cycle
        except BaseException:
            # No cycle holds the reservation (uvicorn refused the target: a URL that is not ASCII): given
            # back before the parser error answers the request; and the request refused is still a head
            # without a cycle, so the refusal leaves the cycle before it (answered, or pipelined) alone.
            self.budget.held -= reserve
            self._phase = HEAD
            raise
        self._unanswered += 1
        if reserve or self._counted:
            held: Held = [self.cycle, reserve]
            self._held.append(held)
            self._chunked = held

    def _begin_cycle(self) -> None:
        """uvicorn's own: the request's cycle, its ASGI task started (or queued behind the one before)."""
        HttpToolsProtocol.on_headers_complete(self)

    def on_body(self, body: bytes) -> None:
        if self._body_left is not None:  # chunked: nothing announced, so counted as it arrives
            n = len(body)
            self._body_left -= n
            if self._body_left < 0:
                raise Refused(413, f"the request body exceeds the limit of {self._body_limit} bytes")
            held = self._chunked
            if held is not None and held[1] != RELEASED:
                held[1] += n
                self.budget.held += n
                if self.budget.held > self.limits.max_in_flight_bytes:
                    raise Refused(503, self._over_budget(), retry_after=True)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._phase, self._open, self._body_left, self._counted, self._chunked = IDLE, False, None, False, None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._unanswered -= 1
        held = self._held
        while held and held[0][0].response_complete:  # answered in order: the oldest first
            request = held.popleft()
            self.budget.held -= request[1]
            request[1] = RELEASED
        super().on_response_complete()
        if self._refusal is not None and not self._unanswered:
            refusal, self._refusal = self._refusal, None
            self._answer_and_close(refusal)

    # Limits

    def _over_budget(self) -> str:
        return (f"the gateway holds {self.budget.held} bytes of request bodies, its limit "
                f"(FLEET_MAX_IN_FLIGHT_BYTES) is {self.limits.max_in_flight_bytes}; retry shortly")

    def _release(self, everything: bool) -> None:
        """Returns to the budget the bytes of the requests answered or dropped (of all of them: the
        connection is gone)."""
        kept: deque[Held] = deque()
        for request in self._held:
            cycle: RequestResponseCycle = request[0]
            if everything or cycle.response_complete or cycle.disconnected:
                self.budget.held -= request[1]
                request[1] = RELEASED
            else:
                kept.append(request)
        self._held = kept

    def _time_phase(self) -> None:
        """A read left the phase unfinished: its deadline is due (moved by what the read brought)."""
        if self._phase_start == _UNTIMED:
            self._phase_start = self.loop.time()  # the phase began during this read, in this loop turn
        deadline = self._deadline()
        if self._timer is None or self._timer_at > deadline:
            self._arm(deadline)

    def _deadline(self) -> float:
        limits = self.limits
        extension = self._phase_bytes / limits.min_rate_bps if limits.min_rate_bps > 0 else 0.0
        deadline = self._phase_start + limits.read_timeout_s + extension
        if self._phase == HEAD:
            return min(deadline, self._phase_start + limits.header_timeout_max_s)
        return deadline

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self.loop.call_at(at, self._on_timer), at

    def _on_timer(self) -> None:
        self._timer = None
        if self._phase == IDLE or self._closing or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:
            # The gateway stopped reading (flow control, or a pipelined request waiting its turn): the
            # client is not the one late. Its phase starts again from now.
            self._phase_start, self._phase_bytes = now, 0
            self._arm(self._deadline())
            return
        deadline = self._deadline()
        if now < deadline:
            self._arm(deadline)
        elif self._phase == HEAD and not self._open:
            self.transport.close()  # a connection that never sent a byte: closed as an idle one is
        else:
            limits = self.limits
            what = (f"head (request line and headers) within {limits.read_timeout_s:g} s, extended by 1 s per "
                    f"{limits.min_rate_bps} bytes received up to {limits.header_timeout_max_s:g} s"
                    if self._phase == HEAD else
                    f"body within {limits.read_timeout_s:g} s, extended by 1 s per {limits.min_rate_bps} bytes"
                    " received")
            self._refuse(408, f"the client did not send the request {what}")

    # Answering an error

    def _refuse(self, status: int, message: str, retry_after: bool = False) -> None:
        """Answers the request being read `status` (after the responses to the requests before it, which
        HTTP/1.1 orders), then closes the connection. Nothing more is parsed."""
        if self._closing:
            return
        self._closing = True
        in_body, self._phase = self._phase == BODY, IDLE
        answer = error_answer(status, message, retry_after)
        cycle: RequestResponseCycle | None = self.cycle
        if in_body and cycle is not None:  # the request being read has a cycle: it must not answer as well
            for entry in [entry for entry in self.pipeline if entry[0] is cycle]:
                self.pipeline.remove(entry)  # queued behind another: never runs
            if cycle.response_started:
                answer = b""  # its app answered already (without waiting for the body): that answer stands
            if not cycle.response_complete:
                self._unanswered -= 1  # dropped: never completes
            cycle.disconnected = True  # its app, if running, sees a disconnect; its output is dropped
            cycle.message_event.set()
        self._release(everything=False)
        if self._unanswered:
            self._refusal = answer  # written by on_response_complete once the earlier responses are out
        else:
            self._answer_and_close(answer)

    def _answer_and_close(self, answer: bytes) -> None:
        if self.transport.is_closing():
            return
        if answer:
            self.transport.write(answer)
        self._unset_keepalive_if_required()  # the lingering close below ends it, not the keep-alive timeout
        self.flow.resume_reading()  # to read and drop what the client still sends
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
