"""The inference path, protocol-free: admission, resolve the model version, validate, enqueue, await the reply.

Each protocol decodes its request into a ParsedInfer (HTTP: fleet.kserve.parse_infer, through
gateway/header_cache.py; gRPC: gateway/grpc/codec.py); from there `run` is the one path for both: queue-policy
admission, the envelope, the broker, the reply's outputs or its error. Tensor bytes go from the decoded
request into the envelope as they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from batching.sequences import no_correlation_id
from fleet import log_context
from fleet.admission import Admission, admit
from fleet.broker import Broker
from fleet.classification import classify, read_labels
from fleet.clock import Clock, SystemClock
from fleet.envelope import ReplyEnvelope, RequestEnvelope, request_payload
from fleet.errors import (
    InferenceFailed,
    InvalidInput,
    Overloaded,
    Unsupported,
    from_code,
)
from fleet.keys import Keys
from fleet.kserve import ParsedInfer, render_infer
from fleet.llm_stats import has_generation, render_generation
from fleet.model_spec import ModelSpec
from fleet.parts import Parts
from fleet.stats import fold_args, render_model_stats
from fleet.tensor_regions import Regions
from fleet.trace_points import QUEUE_START, REQUEST_END, REQUEST_START
from gateway.catalog import Catalog
from gateway.ensembles import Ensembles
from gateway.header_cache import HeaderCache
from gateway.response_cache import ResponseCache, cache_key
from gateway.sequences import Route, SequenceRouter
from gateway.tracer import Trace


@dataclass(slots=True)
class InferResult:
    body: bytes | Parts  # Parts: a long binary body as its pieces (fleet/kserve.py's render_infer)
    header_length: int | None


class DataPlane:
    def __init__(self, catalog: Catalog, broker: Broker, clock: Clock | None = None,
                 regions: Regions | None = None, max_in_flight: int = 4096, cache: ResponseCache | None = None,
                 ensembles: Ensembles | None = None, sequences: SequenceRouter | None = None) -> None:
        self.catalog = catalog
        self.sequences = sequences  # sequence models' routing (gateway/sequences.py)
        self.ensembles = ensembles
        self.cache = cache if cache is not None and cache.enabled else None  # gateway/response_cache.py
        self.broker = broker
        self.clock = clock or SystemClock()
        self.regions = regions  # shared-memory regions tensors may name (gateway/shared_memory.py)
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # inference requests of this process, HTTP and gRPC, admitted and not answered
        # (model, config generation, output) -> its class labels, read once from the model's directory.
        self._labels: dict[tuple[str, str, str], tuple[bytes, ...]] = {}
        self._headers = HeaderCache()  # binary requests' JSON headers, parsed once (gateway/header_cache.py)

    def admit(self) -> None:
        """Take one of the process's `max_in_flight` places (every protocol takes from the same count);
        Overloaded when none is free. The caller calls `release` once it has answered."""
        if self.in_flight >= self.max_in_flight:
            # Answer at once instead of queueing without bound, so memory and the latency of what was
            # admitted stay bounded under any overload.
            raise Overloaded(f"the gateway is at its limit of {self.max_in_flight} requests in flight; "
                             f"retry shortly")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    async def infer(self, model: str, version: str | None, body: bytes, header_length: str | None,
                    trace: Trace | None = None) -> InferResult:
        """An HTTP infer body: parsed, run, rendered. `trace`: this request is traced (gateway/tracer.py);
        its envelope then carries a timestamp map the worker fills in."""
        if trace is not None:
            trace.stamp(REQUEST_START)
        view, v = self.catalog.resolve(model, version)
        spec = view.entry.spec
        req = self._headers.parse(body, header_length, spec, self.regions)
        reply = await self.run(model, v, spec, req, trace, gen=view.gen)
        body_out, hlen = render_infer(model, v, req, reply.outputs or [], reply.parameters)
        if trace is not None:
            trace.stamp(REQUEST_END)
        return InferResult(body_out, hlen)

    async def run(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer, trace: Trace | None = None,
                  caller_timeout_s: float | None = None, gen: str = "") -> ReplyEnvelope:
        """A decoded request of version `v` of `model`, for every protocol: answered from the response
        cache when the model enables it and the fleet has one, else queued (`queued`). `gen`: the
        generation of the config it was validated with (a reload must not answer from the old one).
        Outputs requested as classes are answered as their top classes (fleet/classification.py)."""
        if self.cache is None or not spec.response_cache or req.sequence is not None:
            if spec.ensemble:
                reply = await self._compute(model, v, spec, req, trace, caller_timeout_s)
            else:  # `_compute`'s usual way, without its coroutine (per request)
                reply = await self.queued(model, v, spec, req, trace, caller_timeout_s)
        else:
            reply = await self._cached(self.cache, model, v, spec, req, trace, caller_timeout_s, gen)
        return self._classified(model, spec, req, reply)

    def _classified(self, model: str, spec: ModelSpec, req: ParsedInfer, reply: ReplyEnvelope) -> ReplyEnvelope:
        """`reply` with the outputs `req` asked classes of replaced by them: a new reply (the one computed may
        be the response cache's, which keeps the tensors themselves)."""
        if not req.classification or not reply.outputs:
            return reply
        batched = spec.max_batch_size > 0
        return replace(reply, outputs=[
            classify(o, req.classification[o.name], batched, self._labels_of(model, spec, o.name))
            if o.name in req.classification else o for o in reply.outputs])

    def _labels_of(self, model: str, spec: ModelSpec, output: str) -> tuple[bytes, ...]:
        """The labels of `output` of `model` at the config `spec` (read once per config generation)."""
        ts = spec.output(output)
        view = self.catalog.views.get(model)
        # A model whose files came over model control has no directory here (Path()): classes without labels;
        # nor while a reload swaps the config the request was validated with.
        if ts is None or not ts.label_filename or view is None or view.entry.spec is not spec \
                or view.entry.path == Path():
            return ()
        key = (model, view.gen, output)
        labels = self._labels.get(key)
        if labels is None:
            # The model's earlier generations' labels go: a reload reads its file anew.
            self._labels = {k: got for k, got in self._labels.items() if k[0] != model or k[1] == view.gen}
            labels = self._labels[key] = read_labels(view.entry.path / ts.label_filename)
        return labels

    async def _cached(self, cache: ResponseCache, model: str, v: int, spec: ModelSpec, req: ParsedInfer,
                      trace: Trace | None, caller_timeout_s: float | None, gen: str) -> ReplyEnvelope:
        """From the response cache, else computed and inserted (as the worker wrote it)."""
        started = time.perf_counter_ns()
        key = cache_key(model, v, req, gen)
        hit = await cache.lookup(key)
        lookup_ns = time.perf_counter_ns() - started
        if hit is not None:
            rows = req.inputs[0].shape[0] if spec.max_batch_size > 0 and req.inputs and req.inputs[0].shape else 1
            cache.count_hit(model, v, rows, time.perf_counter_ns() - started, lookup_ns)
            return hit
        reply = await self._compute(model, v, spec, req, trace, caller_timeout_s)
        cache.insert_later(key, reply, model, v, lookup_ns)
        return reply

    async def _compute(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer, trace: Trace | None,
                       caller_timeout_s: float | None) -> ReplyEnvelope:
        """An ensemble's graph (gateway/ensembles.py), or one request queued for the model's workers."""
        if spec.ensemble and self.ensembles is not None:
            return await self.ensembles.run(model, v, spec, req, self._step, caller_timeout_s)
        return await self.queued(model, v, spec, req, trace, caller_timeout_s)

    async def _step(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer, caller_timeout_s: float | None,
                    gen: str) -> ReplyEnvelope:
        return await self.run(model, v, spec, req, None, caller_timeout_s, gen=gen)

    async def queued(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer, trace: Trace | None = None,
                     caller_timeout_s: float | None = None) -> ReplyEnvelope:
        """Lane, deadline and queue bound from the model's queue policy, the envelope, the broker.
        Returns the (successful) reply; raises the reply's error, QueueFull, RequestTimeout,
        BrokerUnavailable or DeadlineExceeded. Cancelled (the caller went away), the request is deleted
        from its stream or dropped by its worker. `caller_timeout_s`: the caller stops waiting after this
        long (a gRPC deadline), so a worker drops the request if it is still queued then instead of
        computing it for nobody. A decoupled model must answer with exactly one response here."""
        if spec.decoupled:
            return await self._single(model, v, spec, req, caller_timeout_s)
        sub = self._submission(model, v, spec, req, trace, caller_timeout_s)
        route = None if req.sequence is None else await self._sequence_route(sub, spec)
        try:
            reply = await self._submit(sub, route=route)
        except asyncio.CancelledError:
            # The caller went away: nobody will read a reply, so none should be computed.
            self.broker.cancel(sub.env.id)
            raise
        finally:
            self.broker.forget(sub.env.id)
            if route is not None:  # not before its XADD is back, if still on its way (cancelled)
                self.broker.after_enqueue(sub.env.id, route.release)
        if trace is not None:
            trace.reply(reply)
        if not reply.ok:
            raise from_code(reply.error_code, reply.error_message)
        return reply

    async def responses(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer,
                        caller_timeout_s: float | None = None) -> AsyncGenerator[ReplyEnvelope, None]:
        """A decoupled model's replies, each as its worker writes it; the last is final (and `empty` when
        the model sent the final flag alone). A response that is an error is yielded like the others;
        what fails the request before any response (admission, Redis) is raised. Closed early (the
        caller went away), the request is cancelled: dropped if queued, `is_cancelled()` in the model.
        Outputs requested as classes come as their top classes."""
        async with aclosing(self._responses(model, v, spec, req, caller_timeout_s)) as responses:
            async for reply in responses:
                yield self._classified(model, spec, req, reply) if reply.ok else reply

    async def _responses(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer,
                         caller_timeout_s: float | None) -> AsyncGenerator[ReplyEnvelope, None]:
        """`responses` as the workers wrote them (`run` classifies what `_single` makes of them once, after
        the response cache has kept them as they are)."""
        sub = self._submission(model, v, spec, req, None, caller_timeout_s)
        route = None if req.sequence is None else await self._sequence_route(sub, spec)
        finished = False
        try:  # (from the submit on: a route taken is released whatever fails)
            first = self._submit(sub, streamed=True, route=route)
            later = self.broker.later(sub.env.id)
            reply = await first
            while True:
                finished = reply.final
                yield reply
                if finished:
                    return
                reply = await later.get()
        finally:
            if not finished:
                self.broker.cancel(sub.env.id)
            self.broker.forget(sub.env.id)
            if route is not None:  # not before its XADD is back, if still on its way (cancelled)
                self.broker.after_enqueue(sub.env.id, route.release)

    async def replies(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer, gen: str = ""
                      ) -> AsyncGenerator[ReplyEnvelope, None]:
        """Every reply to a request, for the protocols that stream: a decoupled model's each as it comes
        (`responses`), any other model's one (`run`). Closed early, the request is cancelled."""
        if not spec.decoupled:
            yield await self.run(model, v, spec, req, gen=gen)
            return
        async with aclosing(self.responses(model, v, spec, req)) as responses:
            async for reply in responses:
                yield reply

    async def _single(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer,
                      caller_timeout_s: float | None) -> ReplyEnvelope:
        """A decoupled model through a one-reply protocol (infer): its one response, else an error."""
        got: list[ReplyEnvelope] = []
        async with aclosing(self._responses(model, v, spec, req, caller_timeout_s)) as responses:
            async for reply in responses:  # an error reply ends the request at once (closed: cancelled)
                if not reply.ok:
                    raise from_code(reply.error_code, reply.error_message)
                if not reply.empty:
                    got.append(reply)
        if len(got) != 1:
            raise InferenceFailed(f"model '{model}' is decoupled and produced {len(got)} responses; a single "
                                  f"inference expects exactly 1 (stream it: generate_stream or gRPC streaming)")
        return got[0]

    def _submission(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer, trace: Trace | None,
                    caller_timeout_s: float | None) -> _Submission:
        if spec.sequence is not None and req.sequence is None:  # an ensemble's step: no worker reads its lane
            raise InvalidInput(f"{no_correlation_id(model)} (a sequence model cannot be an ensemble step in fleet)")
        rid = self.broker.next_id()
        log_context.name_request(model, v, rid)
        # Envelope times are Redis's clock, so a worker on another machine reads them right whatever
        # the skew between the two (fleet/redis_time.py).
        now_us = self.broker.redis_clock.to_redis(self.clock.now_us())
        admission = admit(spec, req.priority, req.timeout_us, now_us)
        expires_us = self.broker.expires_us(now_us)
        if caller_timeout_s is not None and caller_timeout_s < self.broker.timeout_s:  # only ever sooner
            expires_us = min(expires_us, now_us + int(caller_timeout_s * 1_000_000))
        env = RequestEnvelope(
            id=rid,
            model=model,
            version=v,
            inputs=req.inputs,
            reply_to=self.broker.reply_key,
            enqueued_at_us=now_us,
            outputs=req.outputs,
            parameters=req.parameters,
            priority=req.priority,
            deadline_us=admission.deadline_us,
            client_id=req.client_id,
            expires_us=expires_us,
            sequence=req.sequence,
        )
        if trace is not None:
            trace.request(v, req.client_id, req.inputs)
            env.trace = {}
            trace.stamp(QUEUE_START)
        return _Submission(env, admission, now_us)

    async def _sequence_route(self, sub: _Submission, spec: ModelSpec) -> Route:
        env = sub.env
        if self.sequences is None or env.sequence is None:
            raise Unsupported(f"model '{env.model}' uses sequence batching, which this gateway cannot route")
        return await self.sequences.route(env.model, env.version, spec, env.sequence)

    def _submit(self, sub: _Submission, streamed: bool = False, route: Route | None = None
                ) -> asyncio.Future[ReplyEnvelope]:
        """`route`: a sequence's request goes to its worker's stream, the next of the sequence after it."""
        env, admission = sub.env, sub.admission
        reject_at = None if admission.delay_on_timeout else admission.deadline_us
        stream = self.broker.keys.queue(env.model, admission.lane, version=env.version) if route is None \
            else route.stream
        return self.broker.submit(env.id, stream, request_payload(env), admission.max_queue_size, env.model,
                                  version=env.version, enqueued_us=sub.now_us, reject_at_us=reject_at,
                                  streamed=streamed, on_enqueued=None if route is None else route.release)


@dataclass(frozen=True, slots=True)
class _Submission:
    env: RequestEnvelope
    admission: Admission
    now_us: int


async def model_statistics(catalog: Catalog, client: aioredis.Redis, keys: Keys, name: str | None,
                           version: str | None) -> dict[str, Any]:
    """The statistics extension: every ready version of every model, or of the model asked for (or the one
    version asked for), summed across workers. A model or version that is not ready is refused as Triton
    refuses it: INVALID_ARG, in its words."""
    if name:
        ready = catalog.ready_versions(name)
        if not ready:
            raise InvalidInput(f"requested model '{name}' is not available")
        if version:
            if not version.isdigit() or int(version) not in ready:
                raise InvalidInput(f"requested model version is not available for model '{name}'")
            ready = [int(version)]
        targets = [(name, ready)]
    else:
        targets = [(n, catalog.ready_versions(n)) for n in sorted(catalog.views)]
        targets = [(n, vs) for n, vs in targets if vs]
    pipe = client.pipeline(transaction=False)
    for n, _ in targets:
        pipe.eval(*fold_args(keys, n))  # the batches the workers logged, into the hash first (fleet/stats.py)
        pipe.hgetall(keys.stats(n))
    raws = (await pipe.execute(raise_on_error=False))[1::2]  # a fold that failed leaves the hash as it was
    out: list[dict[str, object]] = []
    for (n, versions), raw in zip(targets, raws, strict=True):
        if isinstance(raw, Exception):
            raise raw
        decoded = {k.decode(): int(val) for k, val in raw.items()}
        for v in versions:
            doc = render_model_stats(n, v, decoded)
            if has_generation(decoded, v):  # a generative model's own figures (fleet/llm_stats.py)
                doc["generation"] = render_generation(decoded, v, set(catalog.serving.get((n, v), [])))
            out.append(doc)
    return {"model_stats": out}
