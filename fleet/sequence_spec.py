"""`sequence_batching` as fleet runs it (protocol.md §3.8): the strategy's batching knobs, the control
tensors the worker adds to each request, and the implicit state it carries between a sequence's requests.

Pure config: parsed once from the normalised proto (fleet/model_config.py), validated as Triton's
model_config_utils does (a control input names one control of one kind, START/END/READY give a
false/true pair, CORRID a data type; a state names its input, output, type and dims).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NoReturn

from fleet.config_proto import model_config_pb2 as pb
from fleet.datatypes import BY_NAME, Datatype, from_config

_Fail = Callable[[str], NoReturn]


class ControlKind(StrEnum):
    START = "CONTROL_SEQUENCE_START"
    READY = "CONTROL_SEQUENCE_READY"
    END = "CONTROL_SEQUENCE_END"
    CORRID = "CONTROL_SEQUENCE_CORRID"


_KINDS = [ControlKind.START, ControlKind.READY, ControlKind.END, ControlKind.CORRID]  # proto enum order
_CORRID_TYPES = frozenset({"UINT64", "INT64", "UINT32", "INT32", "BYTES"})


@dataclass(frozen=True, slots=True)
class ControlInput:
    """One control tensor: `name` gets `true_value`/`false_value` (START, END, READY) or the correlation
    id (CORRID), one element per request row."""

    name: str
    kind: ControlKind
    datatype: Datatype
    false_value: float | int | bool = 0
    true_value: float | int | bool = 1


@dataclass(frozen=True, slots=True)
class StateSpec:
    """Implicit state: the model reads `input_name`, writes `output_name`; the worker feeds the output of
    one request of a sequence to the next as the input. `initial`: the first request's value, from
    `initial_state` (zeros or a data file's bytes; None: zeros of `dims`)."""

    input_name: str
    output_name: str
    datatype: Datatype
    dims: tuple[int, ...]
    initial_dims: tuple[int, ...] | None = None
    initial_file: str = ""  # under <model>/<version>/initial_state/; "" = zeros


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    strategy: str  # "direct" or "oldest"
    max_sequence_idle_us: int
    max_queue_delay_us: int
    preferred_batch_sizes: tuple[int, ...]
    max_candidate_sequences: int  # oldest only: sequences one instance batches over at once (0 = no bound)
    controls: tuple[ControlInput, ...]
    states: tuple[StateSpec, ...]

    def control(self, kind: ControlKind) -> ControlInput | None:
        return next((c for c in self.controls if c.kind == kind), None)


def _control(ci: Any, fail: _Fail) -> ControlInput:
    if len(ci.control) != 1:
        fail(f"sequence batching control input '{ci.name}' must specify exactly one control")
    ctl = ci.control[0]
    kind = _KINDS[ctl.kind]
    if kind == ControlKind.CORRID:
        datatype = from_config(pb.DataType.Name(ctl.data_type)) if ctl.data_type else None
        if datatype is None or datatype.name not in _CORRID_TYPES:
            fail(f"sequence batching control '{ci.name}' ({kind.value}) must specify data_type UINT64, INT64, "
                 f"UINT32, INT32 or STRING")
        return ControlInput(ci.name, kind, datatype)
    pairs = [("INT32", list(ctl.int32_false_true)), ("FP32", list(ctl.fp32_false_true)),
             ("BOOL", list(ctl.bool_false_true))]
    given = [(t, v) for t, v in pairs if v]
    if len(given) != 1 or len(given[0][1]) != 2:
        fail(f"sequence batching control '{ci.name}' ({kind.value}) must specify exactly one of int32_false_true, "
             f"fp32_false_true or bool_false_true, with two values")
    type_name, (false_value, true_value) = given[0]
    return ControlInput(ci.name, kind, BY_NAME[type_name], false_value, true_value)


def _state(st: Any, fail: _Fail) -> StateSpec:
    if not st.input_name or not st.output_name:
        fail("sequence batching state must specify both 'input_name' and 'output_name'")
    if st.data_type == 0 or not st.dims:
        fail(f"sequence batching state '{st.input_name}' must specify 'data_type' and 'dims'")
    if len(st.initial_state) > 1:
        fail(f"sequence batching state '{st.input_name}' supports one initial_state")
    initial_dims: tuple[int, ...] | None = None
    initial_file = ""
    if st.initial_state:
        init = st.initial_state[0]
        if init.data_type != st.data_type:
            fail(f"initial state of '{st.input_name}' has another data type than the state")
        initial_dims = tuple(init.dims)
        if any(d < 0 for d in initial_dims):
            fail(f"initial state of '{st.input_name}' must have fixed dims")
        initial_file = init.data_file if init.WhichOneof("state_data") == "data_file" else ""
    elif any(d < 0 for d in st.dims):
        fail(f"state '{st.input_name}' has variable dims: give it an initial_state with fixed dims")
    return StateSpec(st.input_name, st.output_name, from_config(pb.DataType.Name(st.data_type)),
                     tuple(st.dims), initial_dims, initial_file)


def parse_sequence(cfg: Any, fail: _Fail) -> SequenceSpec | None:
    """The `sequence_batching` of a normalised ModelConfig, or None when it has none."""
    if not cfg.HasField("sequence_batching"):
        return None
    seq = cfg.sequence_batching
    if seq.iterative_sequence:
        fail("sequence batching 'iterative_sequence' is not supported by fleet")
    controls = tuple(_control(ci, fail) for ci in seq.control_input)
    names = [c.name for c in controls]
    kinds = [c.kind for c in controls]
    taken = {t.name for t in (*cfg.input, *cfg.output)}
    for name in names:
        if names.count(name) > 1 or name in taken:
            fail(f"sequence batching control input '{name}' is specified more than once or is also a model "
                 f"input or output")
    for kind in set(kinds):
        if kinds.count(kind) > 1:
            fail(f"sequence batching specifies multiple {kind.value} tensors")
    states = tuple(_state(st, fail) for st in seq.state)
    for st in states:
        if st.input_name in taken or st.input_name in names or st.output_name in taken:
            fail(f"state '{st.input_name}'/'{st.output_name}' is also a model input, output or control input")
    oldest = seq.WhichOneof("strategy_choice") == "oldest"
    return SequenceSpec(
        strategy="oldest" if oldest else "direct",
        max_sequence_idle_us=seq.max_sequence_idle_microseconds,
        max_queue_delay_us=(seq.oldest if oldest else seq.direct).max_queue_delay_microseconds,
        preferred_batch_sizes=tuple(seq.oldest.preferred_batch_size) if oldest else (),
        max_candidate_sequences=seq.oldest.max_candidate_sequences if oldest else 0,
        controls=controls,
        states=states,
    )
