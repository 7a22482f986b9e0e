"""`pb_utils.ModelConfig`: the model configuration a Python model's `auto_complete_config` receives and
returns (re-exported by triton_python_backend_utils; models never import this module directly).

Behaviour and error texts follow Triton's python_backend (`ModelConfig` in
`triton_python_backend_utils.py`): only max_batch_size, the scheduler, inputs, outputs, the transaction
policy and warmup samples may be added, and each addition that contradicts what the configuration
already says raises ValueError. Two deliberate differences: `dims` may be given as ints or numeric
strings (protobuf's JSON form of int64) and are compared and stored as ints, and a configuration given
as a dict is accepted as well as a JSON string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

_INPUT_PROPERTIES = ("name", "data_type", "dims", "optional")
_OUTPUT_PROPERTIES = ("name", "data_type", "dims")
_WARMUP_PROPERTIES = ("name", "batch_size", "inputs", "count")  # ModelWarmup in model_config.proto


def _quoted_and(names: Sequence[str]) -> str:
    """"'a', 'b' and 'c'", as Triton spells a list of allowed properties."""
    quoted = [f"'{n}'" for n in names]
    return ", ".join(quoted[:-1]) + " and " + quoted[-1]


class ModelConfig:
    """The model configuration handed to `auto_complete_config`, in its JSON (dict) form."""

    def __init__(self, model_config: str | Mapping[str, Any]) -> None:
        cfg = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
        # Triton's JSON always carries these; a hand-made config may not, and models index them.
        cfg.setdefault("max_batch_size", 0)
        cfg.setdefault("input", [])
        cfg.setdefault("output", [])
        self._model_config: dict[str, Any] = cfg

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._model_config["max_batch_size"])
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config "
                f"function for model '{self._name()}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but auto-complete-config "
                    f"function for model '{self._name()}' tries to set scheduling_choice as "
                    "'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:
        self._add_tensor("input", input, _INPUT_PROPERTIES)

    def add_output(self, output: Mapping[str, Any]) -> None:
        self._add_tensor("output", output, _OUTPUT_PROPERTIES)

    def _add_tensor(self, kind: str, tensor: Mapping[str, Any], allowed: Sequence[str]) -> None:
        model = self._name()
        label = f"{kind} '{tensor.get('name', '')}' in auto-complete-config function for model '{model}'"
        if any(key not in allowed for key in tensor):
            raise ValueError(f"{label} contains property other than {_quoted_and(allowed)}.")
        if "name" not in tensor:
            raise ValueError(f"{kind} in auto-complete-config function for model '{model}' is missing "
                             "'name' property.")
        for key in ("data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"{label} is missing '{key}' property.")
        name, data_type = tensor["name"], tensor["data_type"]
        dims = _int_dims(tensor["dims"], label)
        for current in self._model_config[kind]:
            if current.get("name") != name:
                continue
            current_type = current.get("data_type", "TYPE_INVALID")
            if current_type != "TYPE_INVALID" and current_type != data_type:
                raise ValueError(f"unable to load model '{model}', configuration expects datatype "
                                 f"{current_type} for {kind} '{name}', model provides {data_type}")
            current_dims = _int_dims(current.get("dims", []), label)
            if current_dims and current_dims != dims:
                raise ValueError(f"model '{model}', tensor '{name}': the model expects dims {dims} but the "
                                 f"model configuration specifies dims {current_dims}")
            if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
                raise ValueError(f"model '{model}', tensor '{name}': the model expects optional "
                                 f"{tensor['optional']} but the model configuration specifies optional "
                                 f"{current['optional']}")
            current["data_type"] = data_type
            current["dims"] = dims
            if "optional" in tensor:
                current["optional"] = tensor["optional"]
            return
        self._model_config[kind].append({**tensor, "dims": dims})

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        if any(key != "decoupled" for key in transaction_policy_dict):
            raise ValueError("model transaction property in auto-complete-config function for model "
                             f"'{self._name()}' contains property other than 'decoupled'.")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            decoupled = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != decoupled:
                raise ValueError(f"trying to change decoupled property in auto-complete-config for model "
                                 f"'{self._name()}', which is already set to '{policy['decoupled']}'.")
            policy["decoupled"] = decoupled

    def add_model_warmup(self, model_warmup: Mapping[str, Any]) -> None:
        """Append one `model_warmup` sample (a dict in ModelWarmup's JSON form). A sample with the same
        name that the configuration already has must be the same sample."""
        label = (f"model warmup '{model_warmup.get('name', '')}' in auto-complete-config function for "
                 f"model '{self._name()}'")
        if any(key not in _WARMUP_PROPERTIES for key in model_warmup):
            raise ValueError(f"{label} contains property other than {_quoted_and(_WARMUP_PROPERTIES)}.")
        for key in ("name", "inputs"):
            if key not in model_warmup:
                raise ValueError(f"{label} is missing '{key}' property.")
        warmups = self._model_config.setdefault("model_warmup", [])
        for current in warmups:
            if current.get("name") == model_warmup["name"]:
                if current != dict(model_warmup):
                    raise ValueError(f"{label} differs from the configuration's sample of that name.")
                return
        warmups.append(dict(model_warmup))


def _int_dims(dims: Any, label: str) -> list[int]:
    """`dims` as ints; protobuf's JSON form spells int64 values as strings."""
    try:
        return [int(d) for d in dims]
    except (TypeError, ValueError):
        raise ValueError(f"{label} has dims {dims!r}, which are not a list of integers.") from None
