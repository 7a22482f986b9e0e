"""fleet/ensemble.py: an ensemble checked against its steps as Triton does (errors name the step), and
the bookkeeping of one run (steps start as soon as their inputs exist)."""

from __future__ import annotations

import pytest

from fleet.ensemble import EnsembleRun, plan
from fleet.envelope import WireTensor
from fleet.errors import ConfigError
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec


def model(name: str, inputs: dict[str, str], outputs: dict[str, str]) -> ModelSpec:
    ios = "".join(f'input {{ name: "{n}", data_type: {t}, dims: [ 4 ] }}\n' for n, t in inputs.items())
    ios += "".join(f'output {{ name: "{n}", data_type: {t}, dims: [ 4 ] }}\n' for n, t in outputs.items())
    return parse_config(f'backend: "python"\nmax_batch_size: 8\n{ios}', source=name, model_name=name)


STEPS = {
    "a": model("a", {"X": "TYPE_FP32"}, {"Y": "TYPE_FP32"}),
    "b": model("b", {"U": "TYPE_FP32"}, {"V": "TYPE_FP32"}),
    "c": model("c", {"P": "TYPE_FP32", "Q": "TYPE_FP32"}, {"R": "TYPE_FP32", "S": "TYPE_INT32"}),
}


def ensemble(steps: str, outputs: str = 'output { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] }') -> ModelSpec:
    text = (f'platform: "ensemble"\nmax_batch_size: 8\ninput {{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }}\n'
            f'{outputs}\nensemble_scheduling {{ {steps} }}')
    return parse_config(text, source="e", model_name="e")


def step(name: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f'input_map {{ key: "{k}" value: "{v}" }} ' for k, v in inputs.items())
    maps += "".join(f'output_map {{ key: "{k}" value: "{v}" }} ' for k, v in outputs.items())
    return f'step {{ model_name: "{name}" model_version: -1 {maps}}} '


DIAMOND = (step("a", {"X": "IN"}, {"Y": "left"}) + step("b", {"U": "IN"}, {"V": "right"})
           + step("c", {"P": "left", "Q": "right"}, {"R": "OUT"}))


def test_a_diamond_runs_its_independent_steps_together() -> None:
    planned = plan(ensemble(DIAMOND), STEPS)
    run = EnsembleRun(planned, {"IN"}, tensors={"IN": WireTensor("IN", "FP32", (1, 4), b"\0" * 16)})
    first = run.startable()
    assert [s.model for s in first] == ["a", "b"]  # both at once
    run.started |= {s.index for s in first}
    assert run.step_inputs(first[0])[0].name == "X"  # the step model's own name for the tensor
    run.add_outputs(first[0], [WireTensor("Y", "FP32", (1, 4), b"\0" * 16)])
    assert run.startable() == []  # c needs both branches
    run.add_outputs(first[1], [WireTensor("V", "FP32", (1, 4), b"\0" * 16)])
    assert [s.model for s in run.startable()] == ["c"] and not run.done()
    run.add_outputs(planned.steps[2], [WireTensor("R", "FP32", (1, 4), b"\0" * 16),
                                       WireTensor("S", "INT32", (1, 4), b"\0" * 16)])  # S not mapped: dropped
    assert run.done() and set(run.tensors) == {"IN", "left", "right", "OUT"}


@pytest.mark.parametrize(("steps", "why"), [
    (step("nope", {"X": "IN"}, {"Y": "OUT"}), "step 0 \\(model 'nope'\\): model 'nope' is not available"),
    (step("a", {"Z": "IN"}, {"Y": "OUT"}), "'Z' in input_map is not an input of model 'a'"),
    (step("a", {"X": "IN"}, {"Z": "OUT"}), "'Z' in output_map is not an output of model 'a'"),
    (step("a", {"X": "IN"}, {"Y": "OUT"}) + step("b", {"U": "IN"}, {"V": "OUT"}),
     "step 1 \\(model 'b'\\): ensemble tensor 'OUT' is already produced by step 0"),
    (step("a", {"X": "missing"}, {"Y": "OUT"}), "maps to ensemble tensor 'missing', which nothing produces"),
    (step("a", {"X": "IN"}, {"Y": "mid"}), "ensemble output 'OUT' is not produced by any step"),
    (step("c", {"P": "IN", "Q": "IN"}, {"S": "OUT"}), "ensemble output 'OUT' is FP32 but its producer makes INT32"),
    (step("c", {"P": "IN", "Q": "IN"}, {"R": "OUT", "S": "s"}) + step("a", {"X": "s"}, {"Y": "t"}),
     "step 1 \\(model 'a'\\): input 'X' is FP32 but ensemble tensor 's' is INT32"),
    (step("a", {"X": "IN"}, {"Y": "y"}) + step("c", {"P": "y", "Q": "v"}, {"R": "OUT"})
     + step("b", {"U": "OUT"}, {"V": "v"}), "step 1 \\(model 'c'\\) can never run: its inputs form a cycle"),
])
def test_a_wrong_ensemble_is_refused_naming_the_step(steps: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        plan(ensemble(steps), STEPS)
