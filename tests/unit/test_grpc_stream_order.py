"""gateway/grpc/stream.py's order of answers on one ModelStreamInfer stream, as tritonserver writes them: a
request's one response (a model that is not decoupled, or an error) after those of the requests before it,
however much sooner it completes; a decoupled model's responses as they come, waiting for no one and held
back by no one. The answers are made here (StreamSessions takes them as a function), timed by the test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

from gateway.dataplane import DataPlane
from gateway.grpc.service_proto import service_pb2 as pb
from gateway.grpc.stream import StreamAnswer, StreamSessions

# How long each request takes to answer, by its id; "dec*" ones are a decoupled model's two responses.
DELAYS_S = {"slow": 0.3, "fast": 0.0, "error": 0.0, "dec": 0.05, "decslow": 0.3}


class _Places:
    """DataPlane's admission count, the one part of it a stream uses."""

    in_flight = 0

    def admit(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


async def _answers(request: Any, timeout_s: float | None) -> AsyncIterator[StreamAnswer]:
    if request.id.startswith("dec"):  # as service.infer_stream: a decoupled model's request says so first
        yield StreamAnswer(None, None, False, in_order=False)
    await asyncio.sleep(DELAYS_S[request.id.rstrip("0123456789")])
    if request.id.startswith("error"):
        yield StreamAnswer(None, f"{request.id} failed", True)
    elif request.id.startswith("dec"):
        for last in (False, True):
            yield StreamAnswer(pb.ModelInferResponse(id=request.id), None, last, in_order=False)
    else:
        yield StreamAnswer(pb.ModelInferResponse(id=request.id), None, True)


class _Context:
    def time_remaining(self) -> float | None:
        return None


def _served(ids: list[str]) -> list[str]:
    async def main() -> list[str]:
        places = _Places()
        sessions = StreamSessions(_answers, cast(DataPlane, places))

        async def requests() -> AsyncIterator[bytes]:
            for rid in ids:
                yield pb.ModelInferRequest(model_name="m", id=rid).SerializeToString()

        out = []
        async for raw in sessions.serve(requests(), _Context()):
            answer = pb.ModelStreamInferResponse.FromString(raw)
            out.append(answer.error_message or answer.infer_response.id)
        assert places.in_flight == 0
        return out

    return asyncio.run(main())


def test_one_response_requests_are_answered_in_the_order_they_came() -> None:
    assert _served(["slow", "fast1", "error", "fast2"]) == ["slow", "fast1", "error failed", "fast2"]


def test_a_decoupled_models_responses_go_as_they_come() -> None:
    # dec's two responses (50 ms) before slow's (300 ms) that came first; fast waits for slow, not for dec.
    assert _served(["slow", "dec", "fast"]) == ["dec", "dec", "slow", "fast"]


def test_a_decoupled_request_holds_no_one_back_before_its_first_response() -> None:
    assert _served(["decslow", "fast"]) == ["fast", "decslow", "decslow"]
