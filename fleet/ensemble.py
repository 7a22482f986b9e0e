"""Ensembles (`platform: "ensemble"`, `ensemble_scheduling`): the plan of one ensemble checked against its
step models' configs, as Triton core's ValidateEnsembleConfig does, and the pure bookkeeping of a run.

* `plan(spec, step_specs)` returns an `EnsemblePlan` or raises `ConfigError` naming the step: every step
  model known, its input_map keys are inputs of that model and its output_map keys outputs of it, every
  ensemble tensor produced once (an ensemble input or one step output), every step input produced by
  something, every ensemble output produced, no cycle, and producer and consumer agree on the datatype.
* `EnsembleRun` tracks one request: which tensors exist, which steps can start now (all their inputs
  exist, steps run as soon as they can, in parallel where the graph allows), and when the ensemble's
  outputs are all there. The gateway drives it (gateway/ensembles.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fleet.envelope import WireTensor
from fleet.errors import ConfigError
from fleet.model_spec import ModelSpec


@dataclass(frozen=True, slots=True)
class Step:
    index: int
    model: str
    version: int  # -1: the version the model's unversioned requests go to
    inputs: Mapping[str, str]  # step model input -> ensemble tensor
    outputs: Mapping[str, str]  # step model output -> ensemble tensor


@dataclass(frozen=True, slots=True)
class EnsemblePlan:
    name: str
    steps: tuple[Step, ...]
    inputs: frozenset[str]
    outputs: tuple[str, ...]

    def models(self) -> set[str]:
        return {s.model for s in self.steps}


def steps_of(spec: ModelSpec) -> tuple[Step, ...]:
    return tuple(Step(i, s.model_name, int(s.model_version) if s.model_version else -1, dict(s.input_map),
                      dict(s.output_map))
                 for i, s in enumerate(spec.proto.ensemble_scheduling.step))


def plan(spec: ModelSpec, step_specs: Mapping[str, ModelSpec]) -> EnsemblePlan:
    """Check the ensemble against its step models (see the module contract)."""
    def fail(message: str) -> ConfigError:
        return ConfigError(f"ensemble '{spec.name}': {message}")

    steps = steps_of(spec)
    datatype = {t.name: t.datatype for t in spec.inputs}
    producer: dict[str, str] = {t.name: "an ensemble input" for t in spec.inputs}
    for step in steps:
        where = f"step {step.index} (model '{step.model}')"
        step_spec = step_specs.get(step.model)
        if step_spec is None:
            raise fail(f"{where}: model '{step.model}' is not available")
        if step_spec.decoupled:
            raise fail(f"{where}: decoupled models cannot be ensemble steps yet")
        for name in step.inputs:
            if step_spec.input(name) is None:
                raise fail(f"{where}: '{name}' in input_map is not an input of model '{step.model}'")
        for name, tensor in step.outputs.items():
            out = step_spec.output(name)
            if out is None:
                raise fail(f"{where}: '{name}' in output_map is not an output of model '{step.model}'")
            if tensor in producer:
                raise fail(f"{where}: ensemble tensor '{tensor}' is already produced by {producer[tensor]}")
            producer[tensor] = where
            datatype[tensor] = out.datatype
    for step in steps:
        where = f"step {step.index} (model '{step.model}')"
        step_spec = step_specs[step.model]
        for name, tensor in step.inputs.items():
            if tensor not in producer:
                raise fail(f"{where}: input '{name}' maps to ensemble tensor '{tensor}', which nothing produces")
            wanted = step_spec.input(name)
            assert wanted is not None
            if datatype[tensor] != wanted.datatype:
                raise fail(f"{where}: input '{name}' is {wanted.datatype.name} but ensemble tensor '{tensor}' is "
                           f"{datatype[tensor].name}")
    for out in spec.outputs:
        if out.name not in producer:
            raise fail(f"ensemble output '{out.name}' is not produced by any step")
        if datatype[out.name] != out.datatype:
            raise fail(f"ensemble output '{out.name}' is {out.datatype.name} but its producer makes "
                       f"{datatype[out.name].name}")
    result = EnsemblePlan(spec.name, steps, frozenset(t.name for t in spec.inputs), tuple(t.name for t in spec.outputs))
    run = EnsembleRun(result, set(result.inputs))
    while True:  # every step must become runnable from the ensemble inputs: no cycle, nothing dangling
        ready = run.startable()
        if not ready:
            break
        for step in ready:
            run.started.add(step.index)
            run.available |= set(step.outputs.values())
    stuck = [s for s in steps if s.index not in run.started]
    if stuck:
        raise fail(f"step {stuck[0].index} (model '{stuck[0].model}') can never run: its inputs form a cycle")
    return result


@dataclass(slots=True)
class EnsembleRun:
    """One request through an ensemble: tensors by ensemble name as they come."""

    plan: EnsemblePlan
    available: set[str]
    started: set[int] = field(default_factory=set)
    tensors: dict[str, WireTensor] = field(default_factory=dict)

    def startable(self) -> list[Step]:
        """Steps not started whose inputs all exist now."""
        return [s for s in self.plan.steps
                if s.index not in self.started and all(t in self.available for t in s.inputs.values())]

    def step_inputs(self, step: Step) -> list[WireTensor]:
        """The step's inputs: the ensemble tensors, named as the step model names them."""
        return [WireTensor(name, self.tensors[t].datatype, tuple(self.tensors[t].shape), self.tensors[t].data)
                for name, t in step.inputs.items()]

    def add_outputs(self, step: Step, outputs: list[WireTensor]) -> None:
        for out in outputs:
            tensor = step.outputs.get(out.name)
            if tensor is not None:
                self.tensors[tensor] = WireTensor(tensor, out.datatype, tuple(out.shape), out.data)
                self.available.add(tensor)

    def done(self) -> bool:
        return all(name in self.available for name in self.plan.outputs)
