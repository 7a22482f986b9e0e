"""A request run in parts (workers/request_parts.py) counts one execution a part, each of its own size, in
the statistics; its rows and its request once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fleet.stats import BatchSample, field, increments, render_model_stats


def sample(parts: tuple[int, ...], times: tuple[int, int, int]) -> BatchSample:
    return BatchSample(version=1, batch_size=sum(parts) or 4, requests_ok=1, requests_failed=0, request_ns_ok=10,
                       request_ns_failed=0, queue_ns=1, compute_input_ns=times[0], compute_infer_ns=times[1],
                       compute_output_ns=times[2], finished_ms=1, parts=parts)


def test_a_request_in_three_parts_is_three_executions_of_their_sizes() -> None:
    d = increments(sample((4, 4, 2), (10, 1000, 7)))
    assert d[field(1, "execution_count")] == 3 and d[field(1, "inference_count")] == 10
    assert d[field(1, "success:count")] == 1
    assert d[field(1, "batch:4:count")] == 2 and d[field(1, "batch:2:count")] == 1
    assert d[field(1, "batch:4:compute_infer")] == 800 and d[field(1, "batch:2:compute_infer")] == 200
    stats = render_model_stats("m", 1, {k: v for k, v in d.items()})
    assert stats["execution_count"] == 3 and stats["inference_count"] == 10
    assert [b["batch_size"] for b in stats["batch_stats"]] == [2, 4]  # type: ignore[index]


@given(st.lists(st.integers(1, 64), min_size=1, max_size=8), st.tuples(*[st.integers(0, 10**9)] * 3))
def test_the_parts_share_the_compute_times_without_losing_any(parts: list[int], times: tuple[int, int, int]) -> None:
    d = increments(sample(tuple(parts), times))
    for i, name in enumerate(("compute_input", "compute_infer", "compute_output")):
        assert sum(d.get(field(1, f"batch:{size}:{name}"), 0) for size in set(parts)) == times[i]
    assert sum(d.get(field(1, f"batch:{size}:count"), 0) for size in set(parts)) == len(parts)
    assert d[field(1, "execution_count")] == len(parts)


def test_a_batch_not_in_parts_is_counted_as_before() -> None:
    d = increments(sample((), (1, 2, 3)))
    assert d[field(1, "execution_count")] == 1 and d[field(1, "batch:4:count")] == 1
