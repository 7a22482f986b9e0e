"""fleet.model_config: parsing with Triton's schema, semantic checks, normalisation, /config JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2 as pb

from fleet.datatypes import BY_NAME
from fleet.envelope import WireTensor
from fleet.errors import ConfigError
from fleet.model_config import load_config, parse_config
from fleet.model_spec import ModelSpec, VersionPolicy
from tests.support.model_repo import TRITON_EXAMPLES, python_config

NATIVE_DOUBLE = (TRITON_EXAMPLES / "../../anchors/triton/native_repo/double").resolve()

# GET /v2/models/double/config from tritonserver 2.51.0 (anchors/triton/captured/examples.txt),
# less PyTriton's "workspace-path" parameter, which the native config does not have.
TRITON_DOUBLE_JSON = (
    '{"name":"double","platform":"","backend":"python","runtime":"","version_policy":{"latest":'
    '{"num_versions":1}},"max_batch_size":64,"input":[{"name":"INPUT0","data_type":"TYPE_FP32",'
    '"format":"FORMAT_NONE","dims":[16],"is_shape_tensor":false,"allow_ragged_batch":false,'
    '"optional":false,"is_non_linear_format_io":false}],"output":[{"name":"OUTPUT0","data_type":'
    '"TYPE_FP32","dims":[16],"label_filename":"","is_shape_tensor":false,'
    '"is_non_linear_format_io":false}],"batch_input":[],"batch_output":[],"optimization":'
    '{"priority":"PRIORITY_DEFAULT","input_pinned_memory":{"enable":true},"output_pinned_memory":'
    '{"enable":true},"gather_kernel_buffer_threshold":0,"eager_batching":false},'
    '"dynamic_batching":{"preferred_batch_size":[64],"max_queue_delay_microseconds":100,'
    '"preserve_ordering":false,"priority_levels":0,"default_priority_level":0,'
    '"priority_queue_policy":{}},"instance_group":[{"name":"double_0","kind":"KIND_CPU","count":1,'
    '"gpus":[],"secondary_devices":[],"profile":[],"passive":false,"host_policy":""}],'
    '"default_model_filename":"model.py","cc_model_filenames":{},"metric_tags":{},"parameters":{},'
    '"model_warmup":[]}'
)


def parse(text: str, name: str = "m") -> ModelSpec:
    return parse_config(text, source="cfg.pbtxt", model_name=name)


# ---------------------------------------------------------------- the Triton examples

@pytest.mark.parametrize("name", ["simple", "simple_int8", "simple_string", "simple_sequence",
                                  "simple_dyna_sequence"])
def test_triton_examples_parse(name: str) -> None:
    spec = load_config(TRITON_EXAMPLES / name)
    assert spec.name == name
    assert (spec.platform, spec.backend) == ("onnxruntime_onnx", "onnxruntime")
    assert spec.metadata_platform == "onnxruntime_onnx"
    assert spec.max_batch_size == 8
    assert spec.default_model_filename == "model.onnx"
    assert spec.version_policy == VersionPolicy("latest", num_versions=1)
    assert spec.dynamic_batching is None and not spec.ensemble and not spec.decoupled
    assert spec.instance_kind == "KIND_CPU"
    # Triton's SetDefaultInstanceCount: onnxruntime CPU groups without a count get 2 instances.
    assert spec.instance_count == 2 and len(spec.proto.instance_group) == 1
    for t in spec.inputs + spec.outputs:
        assert t.dims in ((16,), (1,)) and t.reshape is None
        assert spec.metadata_shape(t) == [-1, *t.dims]
    assert not spec.needs_equal_shapes


def test_triton_example_details() -> None:
    simple = load_config(TRITON_EXAMPLES / "simple")
    assert [t.name for t in simple.inputs] == ["INPUT0", "INPUT1"]
    assert simple.input("INPUT1") is simple.inputs[1]
    assert simple.input("OUTPUT0") is None and simple.output("OUTPUT0") is simple.outputs[0]
    assert simple.inputs[0].datatype is BY_NAME["INT32"]
    assert simple.proto.instance_group[0].name == "simple"  # Triton names the added group so
    assert load_config(TRITON_EXAMPLES / "simple_string").inputs[0].datatype is BY_NAME["BYTES"]
    assert load_config(TRITON_EXAMPLES / "simple_int8").outputs[1].datatype is BY_NAME["INT8"]

    seq = load_config(TRITON_EXAMPLES / "simple_sequence")
    assert seq.sequence_batching and seq.dynamic_batching is None
    assert seq.proto.sequence_batching.max_sequence_idle_microseconds == 1_000_000
    assert seq.proto.instance_group[0].name == "simple_sequence_0"

    dyna = load_config(TRITON_EXAMPLES / "simple_dyna_sequence")
    assert dyna.sequence_batching and dyna.parameters == {"execute_delay_ms": "3"}
    assert dyna.instance_count == 2
    oldest = dyna.to_json()["sequence_batching"]["oldest"]
    assert oldest["preferred_batch_size"] == [8]
    assert oldest["max_queue_delay_microseconds"] == 10000
    assert dyna.to_json()["sequence_batching"]["max_sequence_idle_microseconds"] == 10_000_000


# ---------------------------------------------------------------- Triton's /config JSON

def test_double_renders_exactly_like_triton() -> None:
    spec = load_config(NATIVE_DOUBLE)
    expected = json.loads(TRITON_DOUBLE_JSON)
    assert spec.to_json() == expected
    # Same field order too, so the body is byte-identical to Triton's.
    assert json.dumps(spec.to_json(), separators=(",", ":")) == TRITON_DOUBLE_JSON
    assert spec.metadata_platform == "python" and spec.platform == ""
    assert spec.metadata_shape(spec.inputs[0]) == [-1, 16]


def test_int64_fields_render_as_numbers() -> None:
    spec = parse(
        'backend: "python"\nmax_batch_size: 4\n'
        'version_policy { specific { versions: [ 1, 3 ] } }\n'
        'input [ { name: "I", data_type: TYPE_FP32, dims: [ -1, 4 ],'
        " reshape { shape: [ -1, 2, 2 ] } } ]\n"
        'output [ { name: "O", data_type: TYPE_INT64, dims: [ 2 ] } ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 500 priority_levels: 2 "
        "default_priority_level: 2 default_queue_policy { default_timeout_microseconds: 7 "
        "max_queue_size: 3 } priority_queue_policy { key: 1 value { "
        "default_timeout_microseconds: 9 } } }\n"
        'model_warmup [ { name: "w" batch_size: 1 inputs { key: "I" value { data_type: TYPE_FP32 '
        "dims: [ 4 ] zero_data: true } } } ]\n"
    )
    doc = spec.to_json()
    assert doc["input"][0]["dims"] == [-1, 4]
    assert doc["input"][0]["reshape"] == {"shape": [-1, 2, 2]}
    assert doc["output"][0]["dims"] == [2]
    assert doc["version_policy"] == {"specific": {"versions": [1, 3]}}
    db = doc["dynamic_batching"]
    assert (db["max_queue_delay_microseconds"], db["priority_levels"]) == (500, 2)
    assert db["default_priority_level"] == 2
    assert db["default_queue_policy"] == {
        "timeout_action": "REJECT", "default_timeout_microseconds": 7,
        "allow_timeout_override": False, "max_queue_size": 3,
    }
    assert db["priority_queue_policy"]["1"]["default_timeout_microseconds"] == 9  # key stays str
    assert doc["model_warmup"][0]["inputs"]["I"]["dims"] == [4]
    assert spec.dynamic_batching is not None
    assert spec.dynamic_batching.preferred_batch_sizes == (4,)
    assert spec.needs_equal_shapes


def test_ensemble_and_sequence_int64_fields() -> None:
    ens = parse(
        'platform: "ensemble"\nmax_batch_size: 2\n'
        'input [ { name: "A", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "B", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "inner" model_version: -1 '
        'input_map { key: "X" value: "A" } output_map { key: "Y" value: "B" } } ] }\n',
        name="ens",
    )
    assert ens.ensemble and ens.backend == "" and ens.metadata_platform == "ensemble"
    assert ens.instance_count == 0 and ens.default_model_filename == ""
    doc = ens.to_json()
    assert doc["ensemble_scheduling"]["step"][0]["model_version"] == -1
    assert doc["instance_group"] == [] and "optimization" not in doc

    seq = parse(python_config(extra=(
        "sequence_batching { direct { max_queue_delay_microseconds: 5 } "
        'state [ { input_name: "a" output_name: "b" data_type: TYPE_FP32 dims: [ 3 ] } ] }\n'
    )))
    sb = seq.to_json()["sequence_batching"]
    assert sb["direct"]["max_queue_delay_microseconds"] == 5
    assert sb["max_sequence_idle_microseconds"] == 1_000_000
    assert sb["state"][0]["dims"] == [3]


# ---------------------------------------------------------------- errors

def test_syntax_error_reports_file_line_column() -> None:
    text = "name: \"m\"\nbackend: \"python\"\ndynamic_batching { max_queue_delay_us: 3 }\n"
    with pytest.raises(ConfigError) as err:
        parse(text)
    assert err.value.message.startswith("cfg.pbtxt:3:20: ")
    assert "max_queue_delay_us" in err.value.message


def test_load_config_uses_path_as_source(tmp_path: Path) -> None:
    model = tmp_path / "mine"
    model.mkdir()
    (model / "config.pbtxt").write_text('backend: "python"\ninput [ { data_type: TYPE_FOO } ]')
    with pytest.raises(ConfigError, match=rf"^{model / 'config.pbtxt'}:2:"):
        load_config(model)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent")


IO_OK = 'input [ { name: "I", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
SEMANTIC_ERRORS = [
    ('name: "other"\nbackend: "python"\n', "does not match"),
    ("max_batch_size: 4\n", "must specify 'platform' or 'backend'"),
    ('backend: "tensorflow"\n', "unknown backend"),
    ('platform: "tensorflow_savedmodel"\n', "unknown platform"),
    ('platform: "onnxruntime_onnx"\nbackend: "pytorch"\n', "'platform' and 'backend' pair"),
    ('platform: "ensemble"\nbackend: "python"\n', "empty backend"),
    ('platform: "ensemble"\n', "ensemble_scheduling"),
    ('backend: "python"\nensemble_scheduling { step [ { model_name: "x" } ] }\n',
     "ensemble_scheduling"),
    ('platform: "ensemble"\nensemble_scheduling { }\n', "must specify 'step'"),
    ('platform: "ensemble"\nensemble_scheduling { step [ { model_name: "x" } ] }\n',
     "'input_map' in step 0"),
    ('platform: "ensemble"\ninstance_group [ { count: 1 } ]\n'
     'ensemble_scheduling { step [ { model_name: "x" } ] }\n', "instance group"),
    ('backend: "python"\nmax_batch_size: -1\n', "non-negative"),
    ('backend: "python"\ninput [ { data_type: TYPE_FP32, dims: [ 4 ] } ]\n',
     "input 0 must specify 'name'"),
    ('backend: "python"\ninput [ { name: "I", dims: [ 4 ] } ]\n', "must specify 'data_type'"),
    ('backend: "python"\ninput [ { name: "I", data_type: TYPE_FP32 } ]\n', "must specify 'dims'"),
    ('backend: "python"\noutput [ { name: "O", data_type: TYPE_FP32, dims: [ -2 ] } ]\n',
     "dimension must be integer >= 1"),
    ('backend: "python"\noutput [ { name: "O", data_type: TYPE_FP32, dims: [ 0 ] } ]\n',
     "dimension must be integer >= 1"),
    ('backend: "python"\n' + IO_OK + IO_OK, "duplicate model input name 'I'"),
    ('backend: "python"\noutput [ { name: "O", data_type: TYPE_FP32, dims: [ 1 ] },'
     ' { name: "O", data_type: TYPE_FP32, dims: [ 1 ] } ]\n', "duplicate model output name 'O'"),
    ('backend: "python"\ninput [ { name: "I", data_type: TYPE_FP32, dims: [ 4 ], '
     "reshape { shape: [ 3 ] } } ]\n", "different size for dims and reshape"),
    ('backend: "python"\ninput [ { name: "I", data_type: TYPE_FP32, dims: [ 2, -1, 6 ], '
     "reshape { shape: [ -1, 12 ] } } ]\n", "different size for dims and reshape"),
    ('backend: "python"\ninput [ { name: "I", data_type: TYPE_FP32, dims: [ 1 ], '
     "reshape { } } ]\n", "cannot have empty reshape"),
    ('backend: "python"\ninput [ { name: "I", data_type: TYPE_FP32, dims: [ 4 ], '
     "is_shape_tensor: true } ]\n", "shape tensors are only supported"),
    ('backend: "python"\ndynamic_batching { }\n', "dynamic batching requires max_batch_size > 0"),
    ('backend: "python"\nmax_batch_size: 4\ndynamic_batching { preferred_batch_size: [ 0 ] }\n',
     "preferred batch size must be positive"),
    ('backend: "python"\nmax_batch_size: 4\ndynamic_batching { preferred_batch_size: [ 2, 8 ] }\n',
     "must be <= max batch size"),
    ('backend: "python"\nmax_batch_size: 4\ndynamic_batching { priority_levels: 2 }\n',
     r"default priority level must be in range \[1, 2\]"),
    ('backend: "python"\nmax_batch_size: 4\ndynamic_batching { priority_levels: 2 '
     "default_priority_level: 3 }\n", r"range \[1, 2\]"),
    ('backend: "python"\nmax_batch_size: 4\ndynamic_batching { priority_levels: 2 '
     "default_priority_level: 1 priority_queue_policy { key: 3 value { } } }\n",
     "priority queue policy"),
    ('backend: "python"\nmax_batch_size: 4\ndynamic_batching { priority_levels: 2 '
     "default_priority_level: 1 preserve_ordering: true }\n", "Only one priority level"),
    ('backend: "python"\nmax_batch_size: 4\nsequence_batching { oldest { '
     "preferred_batch_size: [ 5 ] } }\n", "sequence batching preferred batch size"),
    ('backend: "python"\nversion_policy { specific { versions: [ 0, 2 ] } }\n',
     "versions must be positive"),
    ('backend: "python"\nversion_policy { specific { } }\n', "at least one version"),
    ('backend: "python"\nversion_policy { latest { num_versions: 0 } }\n', "num_versions"),
    ('backend: "python"\ninstance_group [ { kind: KIND_CPU, gpus: [ 0 ] } ]\n',
     "KIND_CPU but specifies one or more GPUs"),
]


@pytest.mark.parametrize(("text", "message"), SEMANTIC_ERRORS)
def test_semantic_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse(text)
    assert err.value.message.startswith("cfg.pbtxt: ")


# ---------------------------------------------------------------- normalisation

def test_normalisation() -> None:
    spec = parse(python_config(max_batch_size=16, extra=(
        "dynamic_batching { }\n"
        "instance_group [ { count: 3 }, { kind: KIND_CPU, name: \"mine\" }, { kind: KIND_GPU } ]\n"
    )), name="m")
    proto = spec.proto
    assert proto.name == "m"
    assert proto.version_policy.latest.num_versions == 1
    assert list(proto.dynamic_batching.preferred_batch_size) == [16]
    assert [(g.name, pb.ModelInstanceGroup.Kind.Name(g.kind), g.count)
            for g in proto.instance_group] == [
        ("m_0", "KIND_CPU", 3), ("mine", "KIND_CPU", 1), ("m_2", "KIND_GPU", 1)]
    assert spec.instance_count == 5 and spec.instance_kind == "KIND_CPU"
    assert proto.optimization.input_pinned_memory.enable
    assert proto.default_model_filename == "model.py"


@pytest.mark.parametrize(("header", "platform", "backend", "filename"), [
    ('backend: "onnxruntime"', "onnxruntime_onnx", "onnxruntime", "model.onnx"),
    ('platform: "onnxruntime_onnx"', "onnxruntime_onnx", "onnxruntime", "model.onnx"),
    ('backend: "pytorch"', "pytorch_libtorch", "pytorch", "model.pt"),
    ('platform: "pytorch_libtorch"', "pytorch_libtorch", "pytorch", "model.pt"),
    ('platform: "tensorrt_plan"', "tensorrt_plan", "tensorrt", "model.plan"),
    ('backend: "tensorrt"\ndefault_model_filename: "x.engine"', "tensorrt_plan", "tensorrt",
     "x.engine"),
    ('backend: "python"', "", "python", "model.py"),
])
def test_platform_backend_filled(header: str, platform: str, backend: str, filename: str) -> None:
    spec = parse(header + "\n" + IO_OK)
    assert (spec.platform, spec.backend, spec.default_model_filename) == (platform, backend,
                                                                          filename)
    assert spec.metadata_platform == (platform or backend)


def test_sequence_and_decoupled_and_ragged() -> None:
    spec = parse(
        'backend: "python"\nmax_batch_size: 4\n'
        'input [ { name: "A", data_type: TYPE_STRING, dims: [ -1 ], allow_ragged_batch: true },'
        ' { name: "B", data_type: TYPE_FP32, dims: [ 1 ], optional: true, reshape { } } ]\n'
        "model_transaction_policy { decoupled: true }\n"
        'parameters [ { key: "k" value { string_value: "v" } } ]\n'
        "sequence_batching { oldest { } }\n"
    )
    assert spec.decoupled and spec.sequence_batching and spec.dynamic_batching is None
    assert not spec.needs_equal_shapes  # the only variable input allows ragged batches
    assert spec.inputs[1].optional and spec.inputs[1].reshape == ()
    assert spec.parameters == {"k": "v"}
    assert list(spec.proto.sequence_batching.oldest.preferred_batch_size) == [4]


def test_no_batching_metadata_shape() -> None:
    spec = parse('backend: "python"\n' + IO_OK)
    assert spec.max_batch_size == 0 and spec.metadata_shape(spec.inputs[0]) == [4]


def test_json_parses_back_into_the_same_config() -> None:
    for name in ("simple", "simple_dyna_sequence"):
        spec = load_config(TRITON_EXAMPLES / name)
        back = json_format.ParseDict(spec.to_json(), pb.ModelConfig())
        assert back == spec.proto


# ---------------------------------------------------------------- version policy

def test_version_policy_select() -> None:
    available = [3, 1, 10, 2]
    assert VersionPolicy("latest").select(available) == (10,)
    assert VersionPolicy("latest", num_versions=2).select(available) == (3, 10)
    assert VersionPolicy("latest", num_versions=9).select(available) == (1, 2, 3, 10)
    assert VersionPolicy("all").select(available) == (1, 2, 3, 10)
    assert VersionPolicy("specific", versions=(2, 4, 10)).select(available) == (2, 10)
    assert VersionPolicy("latest").select([]) == ()


def test_version_policy_from_config() -> None:
    assert parse('backend: "python"\nversion_policy { all { } }\n').version_policy == (
        VersionPolicy("all"))
    spec = parse('backend: "python"\nversion_policy { latest { num_versions: 3 } }\n')
    assert spec.version_policy == VersionPolicy("latest", num_versions=3)
    spec = parse('backend: "python"\nversion_policy { specific { versions: [ 4, 2 ] } }\n')
    assert spec.version_policy == VersionPolicy("specific", versions=(4, 2))


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(1, 50), max_size=12), st.integers(1, 15),
       st.sets(st.integers(1, 50), max_size=8))
def test_version_policy_properties(available: set[int], n: int, wanted: set[int]) -> None:
    latest = VersionPolicy("latest", num_versions=n).select(available)
    assert list(latest) == sorted(available)[-n:]
    assert all(v > u for v in latest for u in available - set(latest))  # the highest n
    assert VersionPolicy("all").select(available) == tuple(sorted(available))
    specific = VersionPolicy("specific", versions=tuple(wanted)).select(available)
    assert specific == tuple(sorted(available & wanted))


# ---------------------------------------------------------------- batch_input / batch_output, batch key

RAGGED_IO = (
    'backend: "python"\nmax_batch_size: 8\n'
    'input [ { name: "R", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true },'
    ' { name: "V", data_type: TYPE_FP32, dims: [ -1, 2 ] }, { name: "F", data_type: TYPE_INT32, dims: [ 3 ] },'
    ' { name: "O", data_type: TYPE_FP32, dims: [ 2 ], optional: true } ]\n'
    'output [ { name: "Y", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
)


def batch_input(kind: str = "BATCH_ACCUMULATED_ELEMENT_COUNT", target: str = 'target_name: "IDX"',
                dtype: str = "TYPE_INT32", source: str = 'source_input: "R"') -> str:
    return f"batch_input [ {{ kind: {kind} {target} data_type: {dtype} {source} }} ]\n"


BATCH_IO_ERRORS = [
    (batch_input(source=""), "batch input kind 'BATCH_ACCUMULATED_ELEMENT_COUNT' expects 1 source input, got 0"),
    (batch_input(kind="BATCH_ITEM_SHAPE", source='source_input: [ "R", "V" ]'),
     "'BATCH_ITEM_SHAPE' expects 1 source input, got 2"),
    (batch_input(dtype="TYPE_INT64"), "batch input data type must be TYPE_INT32 or TYPE_FP32"),
    (batch_input(source='source_input: "NOPE"'), "unknown source input name 'NOPE'"),
    (batch_input(target=""), "must specify 'target_name'"),
    (batch_input(target='target_name: "V"'), "batch input target name 'V' is also the name of a model input"),
    (batch_input() + batch_input(kind="BATCH_ELEMENT_COUNT"), "target name 'IDX' can only be specified once"),
    ('batch_output [ { target_name: "Z" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "R" } ]\n',
     "unknown target output name 'Z'"),
    ('batch_output [ { target_name: [ "Y", "Y" ] source_input: "R" } ]\n', "'Y' can only be specified once"),
    ('batch_output [ { target_name: "Y" source_input: "NOPE" } ]\n', "unknown source input name 'NOPE'"),
    ('batch_output [ { target_name: "Y" } ]\n', "expects 1 source input, got 0"),
]


@pytest.mark.parametrize(("extra", "message"), BATCH_IO_ERRORS)
def test_batch_io_errors(extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(RAGGED_IO + extra)


def test_batch_inputs_and_outputs_parse_and_render_like_triton() -> None:
    spec = parse(RAGGED_IO + batch_input(kind="BATCH_ITEM_SHAPE", dtype="TYPE_FP32")
                 + 'batch_output [ { target_name: "Y" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "R" } ]\n')
    (bi,) = spec.batch_inputs
    assert (bi.kind.value, bi.target_name, bi.datatype.name, bi.source_input) == ("BATCH_ITEM_SHAPE", "IDX",
                                                                               "FP32", "R")
    assert [(bo.target_names, bo.source_input) for bo in spec.batch_outputs] == [(("Y",), "R")]
    assert spec.ragged_inputs == {"R"}
    doc = spec.to_json()
    # Triton's ModelConfigToJson: enums by name, repeated names as lists, fields in .proto order.
    assert doc["batch_input"] == [{"kind": "BATCH_ITEM_SHAPE", "target_name": ["IDX"], "data_type": "TYPE_FP32",
                                   "source_input": ["R"]}]
    assert doc["batch_output"] == [{"target_name": ["Y"], "kind": "BATCH_SCATTER_WITH_INPUT_SHAPE",
                                    "source_input": ["R"]}]
    assert list(doc["batch_input"][0]) == ["kind", "target_name", "data_type", "source_input"]


def test_a_batch_input_may_read_a_non_ragged_input() -> None:
    # Triton requires nothing of the source input: element counts and item shapes exist for any input.
    spec = parse(RAGGED_IO + batch_input(kind="BATCH_ELEMENT_COUNT", source='source_input: "F"'))
    assert spec.batch_inputs[0].source_input == "F"


def wire(name: str, *shape: int) -> WireTensor:
    return WireTensor(name, "FP32", shape, b"")


def test_batch_key_compares_only_non_ragged_variable_shapes() -> None:
    spec = parse(RAGGED_IO)
    assert spec.equal_shape_inputs == {"V"} and spec.needs_equal_shapes

    def key(*inputs: WireTensor) -> object:
        return spec.batch_key(list(inputs))

    base = key(wire("R", 1, 5), wire("V", 1, 3, 2), wire("F", 1, 3))
    # Ragged R and fixed F never split a batch, nor do batch sizes or the order inputs come in.
    assert key(wire("R", 2, 9), wire("V", 2, 3, 2), wire("F", 2, 3)) == base
    assert key(wire("F", 1, 3), wire("R", 1, 1), wire("V", 4, 3, 2)) == base
    # A variable, non-ragged input of another shape does; so does another set of supplied inputs.
    assert key(wire("R", 1, 5), wire("V", 1, 4, 2), wire("F", 1, 3)) != base
    assert key(wire("R", 1, 5), wire("V", 1, 3, 2), wire("F", 1, 3), wire("O", 1, 2)) != base


def test_batch_key_without_equal_shape_inputs_is_the_set_of_names() -> None:
    spec = parse('backend: "python"\nmax_batch_size: 8\n'
                 'input [ { name: "R", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true },'
                 ' { name: "F", data_type: TYPE_FP32, dims: [ 2 ], optional: true } ]\n')
    assert not spec.needs_equal_shapes
    assert spec.batch_key([wire("R", 1, 3)]) == spec.batch_key([wire("R", 3, 1)])
    assert spec.batch_key([wire("R", 1, 3)]) != spec.batch_key([wire("R", 1, 3), wire("F", 1, 2)])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=2), st.lists(st.integers(0, 4), min_size=2, max_size=2),
       st.integers(1, 3), st.integers(1, 3))
def test_batch_key_equal_iff_the_non_ragged_variable_shapes_agree(
    v1: list[int], v2: list[int], r1: int, r2: int,
) -> None:
    spec = parse(RAGGED_IO)
    k1 = spec.batch_key([wire("R", 1, r1), wire("V", 1, *v1), wire("F", 1, 3)])
    k2 = spec.batch_key([wire("R", 1, r2), wire("V", 2, *v2), wire("F", 1, 3)])
    assert (k1 == k2) == (v1 == v2)
