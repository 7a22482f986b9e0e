"""Helpers of the `triton_python_backend_utils` shim over requests, responses and the model config
dict, plus the model-control calls (not supported yet). Re-exported by triton_python_backend_utils;
models never import this module directly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from _pb_utils_types import TritonModelException

_MODEL_CONTROL_UNSUPPORTED = "Model control from a Python model is not supported yet"


def get_input_tensor_by_name(inference_request: Any, name: str) -> Any:
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: Any, name: str) -> Any:
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    for properties in model_config.get("input", []):
        if properties["name"] == name:
            return properties  # type: ignore[no-any-return]
    return None


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    for properties in model_config.get("output", []):
        if properties["name"] == name:
            return properties  # type: ignore[no-any-return]
    return None


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    policy = model_config.get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))


def load_model(model_name: str, config: str = "", files: Mapping[str, bytes] | None = None) -> None:
    raise TritonModelException(_MODEL_CONTROL_UNSUPPORTED)


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    raise TritonModelException(_MODEL_CONTROL_UNSUPPORTED)


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    raise TritonModelException(_MODEL_CONTROL_UNSUPPORTED)
