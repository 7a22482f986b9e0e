"""The tensors a sequence model gets besides the client's (protocol.md §3.8): control inputs (START, END,
READY, CORRID) with the config's false/true values, and implicit state, fed from what the sequence's
previous request produced (or the initial state), taken from what this one produces.

Each request of a sequence is one row (the gateway requires batch size 1), so a control or state tensor
of one request is [1, ...] for a batching model and [...] otherwise; the backend concatenates them with
the rest of the batch like any input. Every row fleet sends is a real request: READY is always true
(Triton's direct strategy also pads empty slots with READY false rows; fleet batches without padding).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from fleet import tensors
from fleet.datatypes import Datatype
from fleet.envelope import RequestEnvelope, SequenceFlags, WireTensor
from fleet.errors import ConfigError
from fleet.sequence_spec import ControlInput, ControlKind, SequenceSpec
from workers.backends.base import ItemResult

State = dict[str, WireTensor]  # state input name -> the tensor the next request of the sequence gets


def _wire(name: str, datatype: Datatype, array: np.ndarray) -> WireTensor:
    return WireTensor(name, datatype.name, tuple(array.shape), tensors.to_bytes(array, datatype))


class SequenceTensors:
    def __init__(self, spec: SequenceSpec, batched: bool, model_dir: Path | None = None, version: int = 1) -> None:
        """Reads the initial states' data files (raises ConfigError if one is missing or the wrong size)."""
        self.spec = spec
        self.batched = batched
        self._lead = (1,) if batched else ()
        self.initial: State = {}
        for st in spec.states:
            dims = st.initial_dims if st.initial_dims is not None else st.dims
            shape = self._lead + tuple(dims)
            if st.initial_file:
                if model_dir is None:
                    raise ConfigError(f"initial state '{st.input_name}' reads a file, but no model directory")
                path = model_dir / str(version) / "initial_state" / st.initial_file
                if not path.is_file():
                    raise ConfigError(f"initial state file {path} of state '{st.input_name}' is missing")
                array = tensors.from_bytes(path.read_bytes(), st.datatype, shape)
            else:
                array = np.zeros(shape, dtype=st.datatype.numpy) if st.datatype.name != "BYTES" else \
                    np.full(shape, b"", dtype=object)
            self.initial[st.input_name] = _wire(st.input_name, st.datatype, array)
        self.capture = tuple(st.output_name for st in spec.states)

    def _control(self, control: ControlInput, flags: SequenceFlags) -> WireTensor:
        if control.kind == ControlKind.CORRID:
            value: object = flags.id if control.datatype.name != "BYTES" else str(flags.id).encode()
        else:
            on = {ControlKind.START: flags.start, ControlKind.END: flags.end, ControlKind.READY: True}[control.kind]
            value = control.true_value if on else control.false_value
        array = np.array(value, dtype=control.datatype.numpy).reshape(self._lead + (1,))
        return _wire(control.name, control.datatype, array)

    def request(self, env: RequestEnvelope, state: object) -> RequestEnvelope:
        """`env` as its model runs it: the client's inputs, then the controls and the state it carries."""
        assert env.sequence is not None
        carried: State = state if isinstance(state, dict) else self.initial
        extra = [self._control(c, env.sequence) for c in self.spec.controls]
        extra += [carried.get(st.input_name) or self.initial[st.input_name] for st in self.spec.states]
        return replace(env, inputs=[*env.inputs, *extra])

    def state_of(self, result: ItemResult) -> State | None:
        """The state a request's result leaves for the next request; None if it produced none."""
        if not self.capture or result.error is not None:
            return None
        out: State = {}
        for st in self.spec.states:
            wire = (result.wire_outputs or {}).get(st.output_name)
            if wire is not None:
                # Its own bytes: a framework backend's outputs are views of the whole batch's, which a
                # state kept until the sequence's next request would keep alive.
                data = wire.data if type(wire.data) is bytes else bytes(wire.data)
                out[st.input_name] = WireTensor(st.input_name, wire.datatype, wire.shape, data)
                continue
            array = (result.outputs or {}).get(st.output_name)
            if array is None:
                return None
            out[st.input_name] = _wire(st.input_name, st.datatype, np.asarray(array))
        return out
