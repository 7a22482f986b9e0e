"""BLS: a Python model's call to another model (`pb_utils.InferenceRequest(...).exec()`), made for it by
the worker that runs it.

The stub sends the call over its pipe (workers/backends/stub_bls.py); the worker resolves the callee's
version from the workers' heartbeats (the highest ready one when the request names none), checks the
inputs against the config the callee's worker published, and queues the request on the callee's
stream like any other (fleet/broker.py, with this worker's own reply stream): the callee batches it with
all its other traffic, here or on another worker. The reply goes back to the stub as it came.

Deadlock freedom. A call waits while its caller's instance stays busy, so a call that needs that very
instance would wait for ever: a model calling itself, or a cycle (A calls B calls A). Every request
made by BLS carries its chain, the models waiting on it ("model:version", outermost first). A call
whose callee is already on the chain is not queued: it runs here, on a nested instance of the callee
(its own stub, started on first need, kept for the next such call at that depth), so it never waits on
a slot the chain holds. A call more than FLEET_BLS_MAX_DEPTH calls deep (a client's request is depth 0,
the call it makes depth 1) fails with an error naming the chain. Acyclic calls cannot wait on a slot
of their own chain, and an instance blocked in a call never blocks its worker's loop, which keeps
reading and running the callee's batches.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.admission import admit
from fleet.broker import Broker
from fleet.envelope import ReplyEnvelope, RequestEnvelope, WireTensor, request_payload
from fleet.errors import InferenceFailed, InvalidInput, ModelNotFound, ModelNotReady, ServingError, Unsupported
from fleet.input_checks import check_input, check_input_set
from fleet.keys import Keys
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec
from fleet.redis_clients import async_client
from fleet.settings import Settings
from workers.backends.base import LoadContext
from workers.execute import run_batch

log = logging.getLogger(__name__)

READY_TTL_S = 0.5  # how long the heartbeats read for a resolution are reused
NESTED_THREADS = 4  # cyclic calls of one depth run at once (each on a nested instance of its own)
Reply = Callable[[dict[str, Any]], None]


def _frame(reply: ReplyEnvelope, final: bool = True) -> dict[str, Any]:
    if not reply.ok:
        return {"e": [reply.error_code, reply.error_message], "final": final}
    frame: dict[str, Any] = {"o": [[t.name, t.datatype, list(t.shape), t.data] for t in reply.outputs or []],
                             "final": final}
    if reply.parameters:
        frame["p"] = reply.parameters
    return frame


class BlsService:
    """One per worker; `call` is thread-safe (the stubs' reader threads call it)."""

    def __init__(self, settings: Settings, keys: Keys, client: aioredis.Redis, worker_id: str,
                 loop: asyncio.AbstractEventLoop, local: Callable[[str, int], LoadContext | None]) -> None:
        self._settings = settings
        self._keys = keys
        self._client = client
        self._worker_id = worker_id
        self._loop = loop
        self._local = local  # the load context of a version loaded here, for nested instances
        self._max_depth = settings.bls_max_depth
        self._broker: Broker | None = None
        self._broker_lock = asyncio.Lock()
        self._ready: dict[str, dict[int, str]] = {}  # model -> version -> generation, from heartbeats
        self._ready_read = 0.0
        self._specs: dict[tuple[str, str], ModelSpec] = {}
        # (model, version, depth) -> the config they were loaded with and the idle backends: a reload's new
        # config (a new spec) retires them, so a cyclic call never runs the model's old code or config.
        self._nested: dict[tuple[str, int, int], tuple[ModelSpec, list[Any]]] = {}
        self._nested_lock = threading.Lock()
        # A pool of threads per depth: a nested call waits only for calls deeper than itself, so no call can
        # wait for a thread that a call waiting on it holds (one pool for all depths deadlocked once its
        # threads all held calls waiting for deeper ones).
        self._inline: dict[int, ThreadPoolExecutor] = {}

    # ------------------------------------------------------------------ entry (any thread)

    def call(self, frame: dict[str, Any], chain: list[str], reply: Reply) -> None:
        asyncio.run_coroutine_threadsafe(self._run(frame, chain, reply), self._loop)

    async def _run(self, frame: dict[str, Any], chain: list[str], reply: Reply) -> None:
        try:
            await self._call(frame, chain, reply)
        except ServingError as exc:
            reply({"e": [exc.code.value, exc.message], "final": True})
        except Exception as exc:  # a bug here must still answer the model, which waits
            log.exception("BLS call failed")
            reply({"e": ["INTERNAL", f"the BLS call failed: {type(exc).__name__}: {exc}"], "final": True})

    # ------------------------------------------------------------------ one call

    async def _call(self, frame: dict[str, Any], chain: list[str], reply: Reply) -> None:
        req = frame["req"]
        model = str(req["model"])
        if len(chain) > self._max_depth:  # a client's request is depth 0; the call it makes, depth 1
            raise InferenceFailed(
                f"BLS call to '{model}' refused: it would be {len(chain)} calls deep (models waiting on it: "
                f"{' -> '.join(chain)}), past the limit FLEET_BLS_MAX_DEPTH = {self._max_depth}")
        spec, version = await self._resolve(model, int(req.get("version", -1)))
        inputs = self._inputs(spec, req)
        if spec.sequence is not None:  # its requests go to the worker holding the sequence (gateway/sequences.py)
            raise Unsupported(f"model '{model}' uses sequence batching: BLS calls to sequence models are not "
                              f"supported by fleet yet")
        if spec.decoupled and not frame.get("decoupled"):
            raise InvalidInput(f"model '{model}' is decoupled: call it with exec(decoupled=True)")
        outputs = list(req.get("o") or [])
        for name in outputs:
            if spec.output(name) is None:
                raise InvalidInput(f"unexpected inference output '{name}' for model '{model}'")
        broker = await self._started_broker()
        now_us = broker.redis_clock.to_redis(broker.redis_clock.now_us())
        admission = admit(spec, 0, int(req.get("timeout_us") or 0), now_us)
        env = RequestEnvelope(id=broker.next_id(), model=model, version=version, inputs=inputs,
                              reply_to=broker.reply_key, enqueued_at_us=now_us, outputs=outputs or None,
                              parameters=dict(req.get("p") or {}), deadline_us=admission.deadline_us,
                              client_id=str(req.get("id") or ""), expires_us=broker.expires_us(now_us),
                              bls_chain=chain)
        if f"{model}:{version}" in chain:
            reply(_frame(await self._nested_call(spec, env, len(chain))))
            return
        stream = self._keys.queue(model, admission.lane, version=version)
        first = broker.submit(env.id, stream, request_payload(env), admission.max_queue_size, model,
                              version=version, enqueued_us=now_us, streamed=spec.decoupled)
        try:
            if not spec.decoupled:
                reply(_frame(await first))
                return
            later = broker.later(env.id)
            result = await first
            while True:  # a decoupled callee: each response on to the stub as it comes
                if not result.empty or result.final:
                    reply(_frame(result, final=result.final) if not result.empty else {"final": True})
                if result.final:
                    return
                result = await later.get()
        finally:
            broker.forget(env.id)

    def _inputs(self, spec: ModelSpec, req: dict[str, Any]) -> list[WireTensor]:
        inputs: list[WireTensor] = []
        batch: int | None = None
        for name, datatype, shape, data in req.get("i") or []:
            _, _, batch = check_input(spec, inputs, name, datatype, list(shape), batch)
            inputs.append(WireTensor(name, datatype, tuple(shape), data))
        check_input_set(spec, inputs, batch)
        return inputs

    async def _started_broker(self) -> Broker:
        """This worker's reply stream and reader, started on the first call (most workers make none)."""
        async with self._broker_lock:
            if self._broker is None:
                s = self._settings
                url = s.redis_url_or_default
                broker = Broker(async_client(url), async_client(url), self._keys, f"bls-{self._worker_id}",
                                block_ms=s.block_ms, request_timeout_s=s.request_timeout_s,
                                outage_s=s.redis_outage_s)
                await broker.start()
                self._broker = broker
            return self._broker

    # ------------------------------------------------------------------ which version, which config

    async def _resolve(self, model: str, version: int) -> tuple[ModelSpec, int]:
        if time.monotonic() - self._ready_read > READY_TTL_S:
            await self._read_heartbeats()
        versions = self._ready.get(model, {})
        if version > 0:
            if version not in versions:
                raise ModelNotReady(f"Request for unknown model: '{model}' version {version} is not at ready state")
            v = version
        elif versions:
            v = max(versions)
        elif await self._client.exists(self._keys.model_configs(model)):
            raise ModelNotReady(f"Request for unknown model: '{model}' has no available versions")
        else:
            raise ModelNotFound(model)
        return await self._spec(model, versions[v]), v

    async def _read_heartbeats(self) -> None:
        try:
            now_ms = int(time.time() * 1000)
            # Scores are expiry times; a key gone since reads as None below (clocks differ: generous).
            ids: list[bytes] = await self._client.zrangebyscore(  # type: ignore[assignment]
                self._keys.workers(), now_ms - 60_000, "+inf")
            pipe = self._client.pipeline(transaction=False)
            for worker_id in ids:
                pipe.hget(self._keys.worker(worker_id.decode()), "models")
            ready: dict[str, dict[int, str]] = {}
            for raw in await pipe.execute():
                for item in json.loads(raw or b"[]"):
                    ready.setdefault(item[0], {})[int(item[1])] = item[2] if len(item) > 2 else ""
        except (RedisError, OSError) as exc:
            raise InferenceFailed(f"cannot read which workers serve what: {exc}") from exc
        self._ready = ready
        self._ready_read = time.monotonic()

    async def _spec(self, model: str, gen: str) -> ModelSpec:
        spec = self._specs.get((model, gen))
        if spec is None:
            text = await self._client.hget(self._keys.model_configs(model), gen)
            if text is None:
                raise ModelNotReady(f"Request for unknown model: '{model}' has no published config yet")
            spec = parse_config(text.decode() if isinstance(text, bytes) else text,
                                source=f"config of '{model}' generation {gen}", model_name=model)
            self._specs[(model, gen)] = spec
        return spec

    # ------------------------------------------------------------------ cyclic calls

    async def _nested_call(self, spec: ModelSpec, env: RequestEnvelope, depth: int) -> ReplyEnvelope:
        if spec.decoupled:
            raise InvalidInput(f"a cyclic BLS call to the decoupled model '{spec.name}' is not supported")
        ctx = self._local(env.model, env.version)  # (on the loop, which changes what is loaded)
        if ctx is None:
            raise ModelNotReady(f"BLS call to '{env.model}' would wait on an instance its own chain holds, and "
                                f"this worker does not load '{env.model}' version {env.version} to run it on a "
                                f"nested instance")
        with self._nested_lock:
            pool = self._inline.get(depth)
            if pool is None:
                pool = self._inline[depth] = ThreadPoolExecutor(NESTED_THREADS, thread_name_prefix=f"bls-nested{depth}")
        return await self._loop.run_in_executor(pool, self._run_nested, spec, env, depth, ctx)

    def _run_nested(self, spec: ModelSpec, env: RequestEnvelope, depth: int, ctx: LoadContext) -> ReplyEnvelope:
        key = (env.model, env.version, depth)
        with self._nested_lock:
            entry = self._nested.get(key)
            stale: list[Any] = []
            if entry is None or entry[0] is not ctx.spec:
                stale = entry[1] if entry is not None else []
                entry = self._nested[key] = (ctx.spec, [])
            backend = entry[1].pop() if entry[1] else None
        if stale:  # loaded with a config the model no longer has; closed aside (a finalize may take long)
            threading.Thread(target=_close, args=(stale,), name="bls-nested-retire", daemon=True).start()
        if backend is None:
            from workers.backends import load_backend  # the backend registry imports frameworks lazily

            backend = load_backend(replace(ctx, instance_name=f"{ctx.instance_name}_bls{depth}", bls=self))
            log.info("started nested instance %s_bls%d for a cyclic BLS call", ctx.instance_name, depth)
        try:
            outcome = run_batch(spec, backend, [env])
        finally:
            with self._nested_lock:
                current = self._nested.get(key)
                kept = current is not None and current[0] is ctx.spec
                if kept and current is not None:
                    current[1].append(backend)
            if not kept:
                _close([backend])
        return outcome.replies[0]

    def close(self) -> None:
        with self._nested_lock:
            backends = [b for _, idle in self._nested.values() for b in idle]
            self._nested.clear()
        _close(backends)
        with self._nested_lock:
            pools, self._inline = list(self._inline.values()), {}
        for pool in pools:
            pool.shutdown(wait=False)

    async def stop(self) -> None:
        if self._broker is not None:
            await self._broker.stop()
        await asyncio.to_thread(self.close)


def _close(backends: list[Any]) -> None:
    for backend in backends:
        try:
            backend.close()
        except Exception:
            log.exception("closing a nested BLS instance")
