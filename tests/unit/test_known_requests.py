"""fleet/known_requests.py, the store both protocols' caches of decoded requests keep their entries in: an
entry answers only for the config it was checked against, the least recently used goes first, long keys are
not kept, and a request made from an entry has its own inputs."""

from __future__ import annotations

from fleet.envelope import WireTensor
from fleet.known_requests import LONGEST_KEY_BYTES, KnownRequests
from fleet.kserve import ParsedInfer
from fleet.model_config import parse_config

CONFIG = """
name: "m"
backend: "python"
max_batch_size: 8
input [ { name: "A", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""
SPEC = parse_config(CONFIG, source="test", model_name="m")


def _request(data: bytes = bytes(16)) -> ParsedInfer:
    return ParsedInfer(client_id="", inputs=[WireTensor("A", "FP32", (1, 4), data)], outputs=["Y"],
                       binary_outputs=frozenset({"Y"}), binary_default=True, parameters={"k": 1})


def test_an_entry_gives_each_request_its_own_data() -> None:
    known = KnownRequests()
    known.keep("m", b"head", SPEC, _request(bytes(range(16))))
    entry = known.get("m", b"head", SPEC)
    assert entry is not None and entry.sizes == (16,)
    assert entry.request.inputs[0].data == b""  # the first request's data is not kept
    made = entry.with_data([bytes(range(16, 32))])
    assert bytes(made.inputs[0].data) == bytes(range(16, 32))
    made.parameters["x"] = 2
    assert made.outputs is not None
    made.outputs.append("Z")
    again = entry.with_data([bytes(16)])
    assert again.parameters == {"k": 1} and again.outputs == ["Y"]


def test_an_entry_answers_only_for_its_config_and_model() -> None:
    known = KnownRequests()
    known.keep("m", b"head", SPEC, _request())
    reloaded = parse_config(CONFIG, source="test", model_name="m")  # equal, but another load's
    assert known.get("m", b"head", reloaded) is None
    assert known.get("other", b"head", SPEC) is None
    known.keep("m", b"head", reloaded, _request())  # replaces it
    assert len(known) == 1 and known.get("m", b"head", reloaded) is not None


def test_the_least_recently_used_goes_first() -> None:
    known = KnownRequests(capacity=2)
    known.keep("m", b"a", SPEC, _request())
    known.keep("m", b"b", SPEC, _request())
    assert known.get("m", b"a", SPEC) is not None  # used: "b" is now the oldest
    known.keep("m", b"c", SPEC, _request())
    assert len(known) == 2
    assert known.get("m", b"b", SPEC) is None
    assert known.get("m", b"a", SPEC) is not None and known.get("m", b"c", SPEC) is not None


def test_an_entry_kept_again_is_the_most_recently_used() -> None:
    known = KnownRequests(capacity=2)
    known.keep("m", b"a", SPEC, _request())
    known.keep("m", b"b", SPEC, _request())
    known.keep("m", b"a", parse_config(CONFIG, source="test", model_name="m"), _request())  # a reload's
    known.keep("m", b"c", SPEC, _request())
    assert len(known) == 2 and known.get("m", b"b", SPEC) is None


def test_long_keys_are_not_kept() -> None:
    known = KnownRequests()
    known.keep("m", bytes(LONGEST_KEY_BYTES + 1), SPEC, _request())
    known.keep("m", bytes(LONGEST_KEY_BYTES), SPEC, _request())
    assert len(known) == 1 and known.get("m", bytes(LONGEST_KEY_BYTES), SPEC) is not None
