"""fleet/reshape.py: the shapes a model and its client see when the config has `reshape` (Triton's
InferenceRequest::Normalize and InferenceResponse::Output::Reshape)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.reshape import client_shape, model_shape


@pytest.mark.parametrize(("dims", "reshape", "sent", "batched", "seen"), [
    ([4], [2, 2], [3, 4], True, (3, 2, 2)),
    ([1], [], [5, 1], True, (5,)),  # Triton's scalar reshape of a batched [1]
    ([2, 3], [6], [2, 3], False, (6,)),
    ([-1, 4], [-1, 2, 2], [2, 7, 4], True, (2, 7, 2, 2)),
    ([-1, 2, -1], [-1, 2, -1], [1, 3, 2, 5], True, (1, 3, 2, 5)),
    ([-1, 6], [-1, 3, 2], [4, 6], False, (4, 3, 2)),
])
def test_inputs_take_the_reshape_and_outputs_go_back(dims: list[int], reshape: list[int], sent: list[int],
                                                   batched: bool, seen: tuple[int, ...]) -> None:
    assert model_shape(dims, reshape, sent, batched) == seen
    assert client_shape(dims, reshape, seen, batched) == tuple(sent)


@pytest.mark.parametrize(("dims", "reshape", "produced", "batched"), [
    ([4], [2, 2], (3, 4), True),  # the model ignored its reshape
    ([4], [2, 2], (3, 2, 2, 1), True),
    ([4], [2, 2], (3, 2, 3), True),
    ([6], [2, 3], (2, 2), False),
])
def test_an_output_that_does_not_fit_its_reshape_is_none(dims: list[int], reshape: list[int],
                                                         produced: tuple[int, ...], batched: bool) -> None:
    assert client_shape(dims, reshape, produced, batched) is None


@given(factors=st.lists(st.integers(1, 4), min_size=1, max_size=4), rows=st.integers(1, 5), batched=st.booleans())
def test_model_then_client_shape_is_the_identity(factors: list[int], rows: int, batched: bool) -> None:
    dims = [math.prod(factors)]  # the client's flat view; the model's is the factors
    sent = ([rows] if batched else []) + dims
    seen = model_shape(dims, factors, sent, batched)
    assert math.prod(seen) == math.prod(sent)
    assert client_shape(dims, factors, seen, batched) == tuple(sent)
