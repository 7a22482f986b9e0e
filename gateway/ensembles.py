"""Running an ensemble (fleet/ensemble.py has the plan): the gateway that got the request drives its graph.

Each step is an ordinary request on its model's stream (DataPlane.run: admission, queue policy, the
response cache, nested ensembles), issued as soon as its inputs exist, so a step batches with all
other traffic to that model on whichever worker has room, and independent steps run at once. The
gateway drives because it already holds the request and its caller: a worker driving the graph would
hold an instance slot while waiting on other models, and the tensors would cross Redis just the same.
The cost of that choice is the intermediate tensors: each one goes worker -> Redis -> gateway as a
step's reply and gateway -> Redis -> worker as the next step's input (two Redis round trips per hop,
the data copied each time), which for large intermediates is the price of batching every step with
the rest of the fleet.

The caller's priority, its `timeout` (what remains of it at each step), its parameters and its
cancellation carry into every step; the first failing step fails the request with that step's error,
and the steps still running are cancelled. Statistics as Triton's: the ensemble counts one request
(success or fail, with its duration), each step model counts its own in its workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from fleet.ensemble import EnsembleRun, Step
from fleet.envelope import ReplyEnvelope, WireTensor
from fleet.errors import InferenceFailed, ModelNotReady
from fleet.input_checks import check_input, check_input_set
from fleet.keys import Keys
from fleet.kserve import ParsedInfer
from fleet.latency_stats import bucket_deltas
from fleet.model_spec import ModelSpec
from gateway.catalog import Catalog
from gateway.counters import Counters

log = logging.getLogger(__name__)

# DataPlane.run's signature, for the steps: (model, version, spec, request, caller_timeout_s, gen).
RunStep = Callable[[str, int, ModelSpec, ParsedInfer, float | None, str], Awaitable[ReplyEnvelope]]


class Ensembles:
    def __init__(self, catalog: Catalog, keys: Keys, counters: Counters) -> None:
        self.catalog = catalog
        self.keys = keys
        self.counters = counters

    async def run(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer, run_step: RunStep,
                  caller_timeout_s: float | None) -> ReplyEnvelope:
        plan = self.catalog.ensemble_plans.get(model)
        if plan is None:
            why = self.catalog.ensemble_problems.get(model, "its steps are not ready")
            raise ModelNotReady(f"Request for unknown model: '{model}' has no available versions: {why}")
        started = time.perf_counter_ns()
        run = EnsembleRun(plan, {t.name for t in req.inputs}, tensors={t.name: t for t in req.inputs})
        pending: dict[asyncio.Future[list[WireTensor]], Step] = {}
        try:
            while not run.done():
                for step in run.startable():
                    run.started.add(step.index)
                    job = self._step(step, run, req, started, run_step, caller_timeout_s)
                    pending[asyncio.ensure_future(job)] = step
                if not pending:
                    raise InferenceFailed(f"ensemble '{model}' cannot complete: no step can produce "
                                          f"{sorted(set(plan.outputs) - run.available)}")
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for finished in done:
                    run.add_outputs(pending.pop(finished), finished.result())  # a step's error fails the request
        except BaseException:
            for unfinished in pending:
                unfinished.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self._count(model, v, spec, req, time.perf_counter_ns() - started, ok=False)
            raise
        for unneeded in pending:  # steps whose outputs nothing needs any more
            unneeded.cancel()
        wanted = req.outputs if req.outputs is not None else list(plan.outputs)
        self._count(model, v, spec, req, time.perf_counter_ns() - started, ok=True)
        return ReplyEnvelope(id="", model_version=v, outputs=[run.tensors[name] for name in wanted])

    async def _step(self, step: Step, run: EnsembleRun, req: ParsedInfer, started_ns: int, run_step: RunStep,
                    caller_timeout_s: float | None) -> list[WireTensor]:
        view, sv = self.catalog.resolve(step.model, None if step.version < 0 else str(step.version))
        spec = view.entry.spec
        inputs: list[WireTensor] = []
        batch: int | None = None
        for tensor in run.step_inputs(step):
            _, _, batch = check_input(spec, inputs, tensor.name, tensor.datatype, list(tensor.shape), batch)
            inputs.append(tensor)
        check_input_set(spec, inputs, batch)
        timeout_us = 0
        if req.timeout_us:
            timeout_us = max(1, req.timeout_us - (time.perf_counter_ns() - started_ns) // 1000)
        step_req = ParsedInfer(client_id=req.client_id, inputs=inputs, outputs=sorted(step.outputs),
                               binary_outputs=frozenset(step.outputs), binary_default=True,
                               parameters=dict(req.parameters), priority=req.priority, timeout_us=timeout_us)
        reply = await run_step(step.model, sv, spec, step_req, caller_timeout_s, view.gen)
        return list(reply.outputs or [])

    def _count(self, model: str, v: int, spec: ModelSpec, req: ParsedInfer, took_ns: int, ok: bool) -> None:
        batched = spec.max_batch_size > 0 and req.inputs and req.inputs[0].shape
        rows = req.inputs[0].shape[0] if batched else 1
        kind = "success" if ok else "fail"
        deltas = {f"{kind}:count": 1, f"{kind}:ns": took_ns}
        if ok:
            deltas |= {"queue:count": 1, "inference_count": rows, "execution_count": 1}
            deltas |= bucket_deltas("request", (took_ns // 1000,))
        self.counters.add(model, v, deltas, last_inference=ok)

    async def drain(self) -> None:
        await self.counters.drain()
