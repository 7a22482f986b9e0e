"""Triton's config auto-completion in workers (workers/auto_complete.py), the raw-config half of
fleet.model_config (parse_config_proto / spec_from_proto) and the shim's pb_utils.ModelConfig."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from tritonclient.grpc import model_config_pb2 as pb

from fleet.errors import ConfigError
from fleet.model_config import parse_config_proto, spec_from_proto
from fleet.model_spec import ModelSpec
from gateway.grpc.response_heads import varint  # protobuf's varint, which the ONNX file is written in
from tests.support.model_repo import TRITON_EXAMPLES
from workers.auto_complete import complete_config

SIMPLE = TRITON_EXAMPLES / "simple"  # INPUT0/1, OUTPUT0/1: int32 [-1, 16]

SHIM_DIR = Path(__file__).resolve().parents[2] / "workers" / "backends" / "python_shim"
if str(SHIM_DIR) not in sys.path:
    sys.path.insert(0, str(SHIM_DIR))

import triton_python_backend_utils as pb_utils  # noqa: E402


def completed(model_dir: Path, text: str | None = None, *, override: str | None = None,
              versions: tuple[int, ...] = (1,)) -> Any:
    cfg = parse_config_proto(text, source=f"{model_dir}/config.pbtxt", model_name=model_dir.name,
                             override_json=override)
    complete_config(cfg, model_dir, versions)
    return cfg


def spec_of(model_dir: Path, cfg: Any) -> ModelSpec:
    return spec_from_proto(cfg, source=f"{model_dir}/config.pbtxt", model_name=model_dir.name)


def io_summary(ios: Any) -> list[tuple[str, str, list[int]]]:
    return [(io.name, pb.DataType.Name(io.data_type), list(io.dims)) for io in ios]


# --- a tiny ONNX model, encoded by hand (the onnx package is not installed) ----------------------

FLOAT, INT32 = 1, 6  # onnx.TensorProto element types


def _int(field: int, value: int) -> bytes:
    return varint(field << 3) + varint(value)


def _bytes(field: int, value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return varint(field << 3 | 2) + varint(len(data)) + data


def _value_info(name: str, elem_type: int, shape: list[int | str]) -> bytes:
    dims = b"".join(_bytes(1, _int(1, d) if isinstance(d, int) else _bytes(2, d)) for d in shape)
    tensor_type = _int(1, elem_type) + _bytes(2, dims)  # TypeProto.Tensor: elem_type, shape
    return _bytes(1, name) + _bytes(2, _bytes(1, tensor_type))  # ValueInfoProto: name, type


def identity_onnx(shape: list[int | str], elem_type: int = FLOAT) -> bytes:
    """ModelProto of y = Identity(x), both of `shape` (an int is fixed, a str a named variable dim)."""
    node = _bytes(1, "x") + _bytes(2, "y") + _bytes(4, "Identity")
    graph = (_bytes(1, node) + _bytes(2, "g") + _bytes(11, _value_info("x", elem_type, shape))
             + _bytes(12, _value_info("y", elem_type, shape)))
    return _int(1, 8) + _bytes(7, graph) + _bytes(8, _int(2, 13))  # ir_version 8, opset 13


def onnx_model(tmp_path: Path, shape: list[int | str], name: str = "ident") -> Path:
    model_dir = tmp_path / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.onnx").write_bytes(identity_onnx(shape))
    return model_dir


# --- ONNX ---------------------------------------------------------------------------------------


def test_onnx_without_config_is_completed_from_the_graph() -> None:
    cfg = completed(SIMPLE)
    assert cfg.backend == "onnxruntime"
    assert cfg.max_batch_size == 4
    assert cfg.HasField("dynamic_batching")
    assert io_summary(cfg.input) == [("INPUT0", "TYPE_INT32", [16]), ("INPUT1", "TYPE_INT32", [16])]
    assert io_summary(cfg.output) == [("OUTPUT0", "TYPE_INT32", [16]), ("OUTPUT1", "TYPE_INT32", [16])]
    spec = spec_of(SIMPLE, cfg)
    assert (spec.platform, spec.max_batch_size) == ("onnxruntime_onnx", 4)
    assert spec.dynamic_batching is not None and spec.dynamic_batching.preferred_batch_sizes == (4,)


def test_override_max_batch_size_is_kept_and_io_completed() -> None:
    cfg = completed(SIMPLE, "this text is ignored: the override replaces config.pbtxt",
                    override='{"max_batch_size":"16"}')
    assert cfg.max_batch_size == 16
    assert [io.name for io in cfg.input] == ["INPUT0", "INPUT1"]
    assert list(cfg.input[0].dims) == [16]
    assert cfg.HasField("dynamic_batching")


def test_partial_config_keeps_its_inputs_and_fills_outputs() -> None:
    text = ('platform: "onnxruntime_onnx"\nmax_batch_size: 2\nsequence_batching {}\n'
            'input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 16 ] } ]')
    cfg = completed(SIMPLE, text)
    assert [io.name for io in cfg.input] == ["INPUT0"]  # as in Triton: a non-empty list is not extended
    assert io_summary(cfg.output) == [("OUTPUT0", "TYPE_INT32", [16]), ("OUTPUT1", "TYPE_INT32", [16])]
    assert cfg.max_batch_size == 2
    assert not cfg.HasField("dynamic_batching")  # a scheduler is already set


@pytest.mark.parametrize(
    ("io", "message"),
    [
        ('name: "INPUT0", data_type: TYPE_INT32, dims: [ 17 ]',
         "model 'simple', tensor 'INPUT0': the model expects 2 dimensions (shape [-1,16]) but the model "
         "configuration specifies 2 dimensions (an initial batch dimension because max_batch_size > 0 "
         "followed by the explicit tensor shape, making complete shape [-1,17])"),
        ('name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ]',
         "configuration expects datatype TYPE_FP32 for input 'INPUT0', model provides TYPE_INT32"),
        ('name: "NOPE", data_type: TYPE_INT32, dims: [ 16 ]',
         "unexpected inference input 'NOPE', allowed inputs are: INPUT0, INPUT1"),
    ],
)
def test_config_inputs_that_contradict_the_model_fail(io: str, message: str) -> None:
    text = f'platform: "onnxruntime_onnx"\nmax_batch_size: 8\ninput [ {{ {io} }} ]'
    with pytest.raises(ConfigError) as err:
        completed(SIMPLE, text)
    assert message in str(err.value)
    assert str(err.value).startswith(f"{SIMPLE}: ")


def test_complete_onnx_config_is_left_alone(tmp_path: Path) -> None:
    # Inputs and outputs given: Triton does not even open the model (here there is none).
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    text = ('backend: "onnxruntime"\ninput [ { name: "A", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
            'output [ { name: "B", data_type: TYPE_FP32, dims: [ 1 ] } ]')
    cfg = completed(model_dir, text)
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")


def test_onnx_completion_without_a_model_file_fails(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no version directory holds 'model.onnx'"):
        completed(model_dir, 'backend: "onnxruntime"')


def test_model_without_a_batch_dim_does_not_batch(tmp_path: Path) -> None:
    model_dir = onnx_model(tmp_path, [2, 3])
    cfg = completed(model_dir)
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")
    assert io_summary(cfg.input) == [("x", "TYPE_FP32", [2, 3])]
    assert io_summary(cfg.output) == [("y", "TYPE_FP32", [2, 3])]
    assert spec_of(model_dir, cfg).max_batch_size == 0
    with pytest.raises(ConfigError, match="model does not support batching while non-zero max_batch_size"):
        completed(model_dir, "max_batch_size: 8")


def test_named_batch_dim_and_per_item_scalars(tmp_path: Path) -> None:
    cfg = completed(onnx_model(tmp_path, ["batch", 3]))
    assert cfg.max_batch_size == 4 and io_summary(cfg.input) == [("x", "TYPE_FP32", [3])]
    scalar_dir = onnx_model(tmp_path, ["n"], name="scalar")
    cfg = completed(scalar_dir)
    assert list(cfg.input[0].dims) == [1]
    assert cfg.input[0].HasField("reshape") and list(cfg.input[0].reshape.shape) == []
    assert spec_of(scalar_dir, cfg).inputs[0].reshape == ()


def test_highest_version_with_the_file_is_used(tmp_path: Path) -> None:
    model_dir = onnx_model(tmp_path, [2, 3])
    (model_dir / "1" / "model.onnx").write_bytes(identity_onnx(["b", 5]))
    (model_dir / "2").mkdir()
    (model_dir / "2" / "model.onnx").write_bytes(identity_onnx([4]))
    (model_dir / "3").mkdir()  # no model file: skipped
    cfg = completed(model_dir, versions=(1, 2, 3))
    assert cfg.max_batch_size == 0 and io_summary(cfg.input) == [("x", "TYPE_FP32", [4])]


# --- backend inference, TorchScript -------------------------------------------------------------


@pytest.mark.parametrize(
    ("filename", "backend"),
    [("model.pt", "pytorch"), ("model.plan", "tensorrt"), ("model.py", "python")],
)
def test_backend_from_the_model_file(tmp_path: Path, filename: str, backend: str) -> None:
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / filename).write_text("", encoding="utf-8")
    cfg = completed(model_dir)
    assert cfg.backend == backend
    assert not cfg.input and cfg.max_batch_size == 0  # no names in a .pt: nothing more, as in Triton


def test_backend_from_default_model_filename_and_unknown_files(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    assert completed(model_dir, 'default_model_filename: "model.pt"').backend == "pytorch"
    (model_dir / "1" / "weights.bin").write_bytes(b"")
    cfg = completed(model_dir)
    assert cfg.backend == ""
    with pytest.raises(ConfigError, match="must specify 'platform' or 'backend'"):
        spec_of(model_dir, cfg)


# --- Python -------------------------------------------------------------------------------------


def python_model(tmp_path: Path, body: str, name: str = "pm", config: str | None = None) -> Path:
    model_dir = tmp_path / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(textwrap.dedent(body), encoding="utf-8")
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config, encoding="utf-8")
    return model_dir


def completed_python(model_dir: Path) -> Any:
    path = model_dir / "config.pbtxt"
    return completed(model_dir, path.read_text(encoding="utf-8") if path.exists() else None)


ADDS_IO = """
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(config):
            print("stdout is not the reply channel")
            config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": ["4"]})
            config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]})
            config.set_max_batch_size(8)
            config.set_dynamic_batching()
            config.set_model_transaction_policy({"decoupled": False})
            return config

        def execute(self, requests):
            return []
"""


def test_python_auto_complete_config_is_called(tmp_path: Path) -> None:
    model_dir = python_model(tmp_path, ADDS_IO, config='backend: "python"')
    cfg = completed_python(model_dir)
    assert cfg.name == "pm" and cfg.backend == "python"
    assert cfg.max_batch_size == 8 and cfg.HasField("dynamic_batching")
    assert io_summary(cfg.input) == [("IN", "TYPE_FP32", [4])]
    spec = spec_of(model_dir, cfg)
    assert [t.name for t in spec.outputs] == ["OUT"] and not spec.decoupled


def test_python_model_without_config_pbtxt(tmp_path: Path) -> None:
    cfg = completed_python(python_model(tmp_path, ADDS_IO))  # backend from model.py, as in Triton
    assert cfg.backend == "python" and [io.name for io in cfg.input] == ["IN"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("raise RuntimeError('no config for you')", "RuntimeError: no config for you"),
        ("return None", "must return a valid pb.ModelConfig object"),
        ("config.set_max_batch_size(2); return config",
         "configuration specified max_batch_size 8, but in auto-complete-config function for model 'pm' "
         "specified max_batch_size 2"),
        ("import sys; sys.exit(3)", "SystemExit: 3"),
    ],
)
def test_python_auto_complete_failures(tmp_path: Path, body: str, message: str) -> None:
    source = f"""
        class TritonPythonModel:
            @staticmethod
            def auto_complete_config(config):
                {body}
    """
    model_dir = python_model(tmp_path, source, config='backend: "python"\nmax_batch_size: 8')
    with pytest.raises(ConfigError) as err:
        completed_python(model_dir)
    assert message in str(err.value) and "auto_complete_config of model 'pm' failed" in str(err.value)


def test_python_auto_complete_that_hangs_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("workers.auto_complete.PYTHON_TIMEOUT_S", 1.0)
    source = """
        import time

        class TritonPythonModel:
            @staticmethod
            def auto_complete_config(config):
                time.sleep(60)
    """
    model_dir = python_model(tmp_path, source, config='backend: "python"')
    with pytest.raises(ConfigError, match="auto_complete_config of model 'pm' did not return within 1 s"):
        completed_python(model_dir)


def test_python_model_that_cannot_be_imported(tmp_path: Path) -> None:
    source = "import no_such_module_here\n\nclass TritonPythonModel:\n    auto_complete_config = None\n"
    model_dir = python_model(tmp_path, source, config='backend: "python"')
    with pytest.raises(ConfigError, match="ModuleNotFoundError"):
        completed_python(model_dir)


def test_python_model_never_naming_auto_complete_is_not_imported(tmp_path: Path) -> None:
    """No child interpreter for a model.py that never names the hook (the load itself reports its errors)."""
    model_dir = python_model(tmp_path, "import no_such_module_here\n", config='backend: "python"')
    assert completed_python(model_dir) is not None


def test_python_model_without_auto_complete_is_unchanged(tmp_path: Path) -> None:
    text = 'backend: "python"\nmax_batch_size: 2'
    model_dir = python_model(tmp_path, "class TritonPythonModel:\n    pass\n", config=text)
    cfg = completed_python(model_dir)
    assert cfg.max_batch_size == 2 and not cfg.input


# The flow of Triton's python_backend examples/auto_complete (batch_model.py / nobatch_model.py): read
# the names through as_dict(), add what is missing, then set the batch size (and the scheduler).
TRITON_EXAMPLE_FLOW = """
    import triton_python_backend_utils as pb_utils

    BATCH = {batch}

    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(auto_complete_model_config):
            wanted_in = [{{"name": n, "data_type": "TYPE_FP32", "dims": [4]}} for n in ("INPUT0", "INPUT1")]
            wanted_out = [{{"name": n, "data_type": "TYPE_FP32", "dims": [4]}} for n in ("OUTPUT0", "OUTPUT1")]
            config = auto_complete_model_config.as_dict()
            have_in = [i["name"] for i in config["input"]]
            have_out = [o["name"] for o in config["output"]]
            for tensor in wanted_in:
                if tensor["name"] not in have_in:
                    auto_complete_model_config.add_input(tensor)
            for tensor in wanted_out:
                if tensor["name"] not in have_out:
                    auto_complete_model_config.add_output(tensor)
            auto_complete_model_config.set_max_batch_size(4 if BATCH else 0)
            if BATCH:
                auto_complete_model_config.set_dynamic_batching()
            return auto_complete_model_config
"""


def test_triton_auto_complete_example_flow(tmp_path: Path) -> None:
    batch_dir = python_model(tmp_path, TRITON_EXAMPLE_FLOW.format(batch=True), name="batch_auto_complete",
                             config='name: "batch_auto_complete"\nbackend: "python"\n')
    spec = spec_of(batch_dir, completed_python(batch_dir))
    assert spec.max_batch_size == 4 and spec.dynamic_batching is not None
    assert [t.name for t in spec.inputs] == ["INPUT0", "INPUT1"]
    assert [t.name for t in spec.outputs] == ["OUTPUT0", "OUTPUT1"]
    assert spec.metadata_shape(spec.inputs[0]) == [-1, 4]

    nobatch_dir = python_model(tmp_path, TRITON_EXAMPLE_FLOW.format(batch=False), name="nobatch_auto_complete")
    spec = spec_of(nobatch_dir, completed_python(nobatch_dir))
    assert spec.max_batch_size == 0 and spec.dynamic_batching is None
    assert spec.metadata_shape(spec.outputs[1]) == [4]


def test_triton_example_flow_conflicting_config(tmp_path: Path) -> None:
    text = 'backend: "python"\ninput [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 5 ] } ]'
    model_dir = python_model(tmp_path, TRITON_EXAMPLE_FLOW.format(batch=True), config=text)
    # The example skips names the config has: the config's INPUT0 [5] stays and INPUT1 is added.
    cfg = completed_python(model_dir)
    assert io_summary(cfg.input) == [("INPUT0", "TYPE_FP32", [5]), ("INPUT1", "TYPE_FP32", [4])]


# --- parse_config_proto -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("{not json", "invalid config override: Expecting property name"),
        ('{"max_batch_size": 1, "no_such_field": 2}', 'has no field named "no_such_field"'),
        ("[]", "expected a JSON object, got list"),
    ],
)
def test_bad_override(override: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config_proto("", source="x", model_name="m", override_json=override)
    assert str(err.value).startswith("failed to load 'm': invalid config override: ") and why in str(err.value)


def test_parse_config_proto_text_and_empty() -> None:
    assert parse_config_proto(None, source="s", model_name="m") == pb.ModelConfig()
    assert parse_config_proto("max_batch_size: 3", source="s", model_name="m").max_batch_size == 3
    with pytest.raises(ConfigError, match=r"^s:1:\d+: "):
        parse_config_proto("max_batch_size: x", source="s", model_name="m")


# --- pb_utils.ModelConfig -----------------------------------------------------------------------


def test_model_config_dims_may_be_strings() -> None:
    config = pb_utils.ModelConfig(json.dumps({"name": "m", "input": [{"name": "A", "data_type": "TYPE_FP32",
                                                                       "dims": ["4"]}]}))
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [4]})
    config.add_input({"name": "B", "data_type": "TYPE_FP32", "dims": ["-1", 2]})
    assert [i["dims"] for i in config.as_dict()["input"]] == [[4], [-1, 2]]
    with pytest.raises(ValueError, match="the model expects dims \\[5\\] but the model configuration "
                                         "specifies dims \\[4\\]"):
        config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": ["5"]})
    with pytest.raises(ValueError, match="not a list of integers"):
        config.add_output({"name": "C", "data_type": "TYPE_FP32", "dims": ["x"]})


def test_model_config_messages_follow_triton() -> None:
    config = pb_utils.ModelConfig({"name": "m", "model_transaction_policy": {"decoupled": True}})
    with pytest.raises(ValueError, match="contains property other than 'name', 'data_type', 'dims' and "
                                         "'optional'"):
        config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [1], "reshape": {}})
    with pytest.raises(ValueError, match="input in auto-complete-config function for model 'm' is missing "
                                         "'name' property"):
        config.add_input({"data_type": "TYPE_FP32", "dims": [1]})
    with pytest.raises(ValueError, match="which is already set to 'True'"):
        config.set_model_transaction_policy({"decoupled": False})


def test_model_config_warmup() -> None:
    config = pb_utils.ModelConfig({"name": "m"})
    sample = {"name": "w", "batch_size": 1, "inputs": {"IN": {"data_type": "TYPE_FP32", "dims": [4],
                                                              "zero_data": True}}}
    config.add_model_warmup(sample)
    config.add_model_warmup(dict(sample))  # the same sample again: fine
    assert config.as_dict()["model_warmup"] == [sample]
    with pytest.raises(ValueError, match="differs"):
        config.add_model_warmup({**sample, "count": 2})
    with pytest.raises(ValueError, match="contains property other than"):
        config.add_model_warmup({"name": "x", "inputs": {}, "bogus": 1})
