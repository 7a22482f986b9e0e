"""Pure parts of generation: sampling parameters and the choice of a token, incremental detokenisation
that never splits a UTF-8 character, stop strings that are held back and cut."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fleet.errors import InvalidInput
from workers.generation.sampling import SamplingParams, generator_for, next_token, parse_sampling, sampling_json
from workers.generation.text import Detokenizer, StopText

TOKENIZER = Path(__file__).resolve().parents[2] / "model_repository" / "smollm2" / "1"


@pytest.fixture(scope="module")
def tok() -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def test_sampling_parameters_merge_and_validate() -> None:
    p = parse_sampling([{"max_tokens": 5, "temperature": 0.5}, sampling_json('{"temperature": 0, "stop": "x"}'),
                        {"stream": True}])
    assert (p.max_tokens, p.temperature, p.stop, p.stream, p.greedy) == (5, 0.0, ("x",), True, True)
    assert parse_sampling([{"max_new_tokens": 7}]).max_tokens == 7
    assert parse_sampling([]).greedy and parse_sampling([]).max_tokens == 16
    assert parse_sampling([{"top_k": -1}]).top_k == 0
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 2.5},
                {"stream": "yes"}, {"stop": [""]}, {"seed": "x"}, {"temperature": True}):
        with pytest.raises(InvalidInput):
            parse_sampling([bad])
    with pytest.raises(InvalidInput):
        sampling_json("[1]")


def test_greedy_top_k_top_p_and_repetition_penalty() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert next_token(logits, SamplingParams(), [], None) == 1
    # The penalty divides a seen positive logit: 3/4 < 2, so token 2 wins.
    assert next_token(logits, SamplingParams(repetition_penalty=4.0), [1], None) == 2
    params = SamplingParams(temperature=1.0, top_k=1, seed=1)
    assert params.greedy and next_token(logits, params, [], generator_for(params)) == 1
    nucleus = SamplingParams(temperature=1.0, top_p=0.5, seed=3)
    gen = generator_for(nucleus)
    assert {next_token(torch.tensor([0.0, 5.0, 0.0, 0.0]), nucleus, [], gen) for _ in range(50)} == {1}
    wide = SamplingParams(temperature=5.0, seed=7)
    draws = [next_token(logits, wide, [], generator_for(wide)) for _ in range(3)]
    assert len(set(draws)) == 1  # one seed, one draw sequence
    g = generator_for(wide)
    assert len({next_token(logits, wide, [], g) for _ in range(200)}) == 4


def test_detokenizer_never_splits_a_character(tok: object) -> None:
    text = "naïve café 🚀🚀 日本語 done"
    ids = tok.encode(text)  # type: ignore[attr-defined]
    prompt = tok.encode("Say:")  # type: ignore[attr-defined]
    d = Detokenizer(tok, prompt)
    pieces = [d.add(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids)  # type: ignore[attr-defined]
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # the rocket's bytes span tokens: held until complete


def test_stop_strings_are_held_back_and_cut() -> None:
    s = StopText(("STOP", "\n\n"))
    assert s.add("hello ST") == "hello "  # "ST" may begin STOP
    assert s.add("AY") == "STAY"
    assert s.add(" and\n") == " and"
    assert s.add("\nmore") == "" and s.stopped and s.text == "hello STAY and"
    assert s.add("x") == ""
    plain = StopText(())
    assert plain.add("abc") == "abc" and plain.flush() == ""


@given(st.lists(st.text(alphabet="abS\nTOP", max_size=4), max_size=12))
def test_stop_text_streams_exactly_the_text_before_the_first_stop(deltas: list[str]) -> None:
    s = StopText(("STOP", "aa"))
    sent = "".join(s.add(d) for d in deltas) + s.flush()
    whole = "".join(deltas)
    cuts = [i for i in (whole.find("STOP"), whole.find("aa")) if i >= 0]
    assert sent == (whole[:min(cuts)] if cuts else whole)
    assert s.stopped == bool(cuts)
