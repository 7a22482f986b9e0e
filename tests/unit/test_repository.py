"""fleet.repository: scanning Triton-layout model repositories."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.errors import ConfigError
from fleet.repository import composing_models, load_model, scan, version_dirs, with_composing
from tests.support.model_repo import TRITON_EXAMPLES, python_config, write_model

EXAMPLE_NAMES = ["simple", "simple_dyna_sequence", "simple_int8", "simple_sequence",
                 "simple_string"]


def test_scan_triton_examples() -> None:
    repo = scan([TRITON_EXAMPLES])
    assert sorted(repo.models) == EXAMPLE_NAMES
    assert dict(repo.errors) == {}
    for name, entry in repo.models.items():
        assert entry.name == entry.spec.name == name
        assert entry.path == TRITON_EXAMPLES / name
        assert entry.versions == (1,)
        assert entry.model_file(1) == TRITON_EXAMPLES / name / "1" / "model.onnx"
        assert entry.model_file(1).is_file()


def test_skips_hidden_plain_files_and_dirs_without_config(tmp_path: Path) -> None:
    write_model(tmp_path, "good", python_config())
    write_model(tmp_path, ".hidden", python_config())
    write_model(tmp_path, "no_config", None)
    (tmp_path / "README.md").write_text("not a model")
    repo = scan([tmp_path])
    assert list(repo.models) == ["good"] and dict(repo.errors) == {}
    assert repo.models["good"].model_file(1) == tmp_path / "good" / "1" / "model.py"


def test_bad_config_is_an_error_not_a_crash(tmp_path: Path) -> None:
    write_model(tmp_path, "syntax", "backend: 'python'\ninput [ {")
    write_model(tmp_path, "semantic", python_config(max_batch_size=-1))
    write_model(tmp_path, "misnamed", python_config(name="other"))
    write_model(tmp_path, "good", python_config(name="good"))
    repo = scan([tmp_path])
    assert list(repo.models) == ["good"]
    assert sorted(repo.errors) == ["misnamed", "semantic", "syntax"]
    assert repo.errors["syntax"].startswith(f"{tmp_path / 'syntax' / 'config.pbtxt'}:2:")
    assert "non-negative" in repo.errors["semantic"]
    assert "does not match" in repo.errors["misnamed"]


def test_version_directories(tmp_path: Path) -> None:
    model = write_model(tmp_path, "m", python_config(), versions=["1", "3", "10", "0", "03", "x",
                                                                 "-2", "1.5"])
    (model / "7").write_text("a file, not a version directory")
    assert version_dirs(model) == (1, 3, 10)
    assert scan([tmp_path]).models["m"].versions == (10,)


def test_missing_versions_is_an_error(tmp_path: Path) -> None:
    write_model(tmp_path, "none", python_config(), versions=[])
    write_model(tmp_path, "only_zero", python_config(), versions=["0", "01"])
    policy = "version_policy { specific { versions: [ 5 ] } }\n"
    write_model(tmp_path, "not_selected", python_config(extra=policy), versions=[1, 2])
    repo = scan([tmp_path])
    assert dict(repo.models) == {}
    assert sorted(repo.errors) == ["none", "not_selected", "only_zero"]
    assert all("at least one version must be available" in m for m in repo.errors.values())
    with pytest.raises(ConfigError, match="at least one version"):
        load_model(tmp_path / "none")


@pytest.mark.parametrize(("policy", "expected"), [
    ("", (3,)),
    ("version_policy { latest { num_versions: 2 } }\n", (2, 3)),
    ("version_policy { all { } }\n", (1, 2, 3)),
    ("version_policy { specific { versions: [ 1, 3, 9 ] } }\n", (1, 3)),
])
def test_version_policies(tmp_path: Path, policy: str, expected: tuple[int, ...]) -> None:
    write_model(tmp_path, "m", python_config(extra=policy), versions=[1, 2, 3])
    entry = scan([tmp_path]).models["m"]
    assert entry.versions == expected
    assert entry.model_file(expected[0]) == tmp_path / "m" / str(expected[0]) / "model.py"


def test_duplicate_across_repositories(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    write_model(first, "dup", python_config())
    write_model(second, "dup", python_config())
    write_model(first, "only_a", python_config())
    write_model(second, "only_b", python_config())
    write_model(second, "no_config_in_b", None)
    write_model(first, "no_config_in_b", python_config())
    repo = scan([first, second])
    assert sorted(repo.models) == ["no_config_in_b", "only_a", "only_b"]
    assert list(repo.errors) == ["dup"]
    assert "multiple repositories" in repo.errors["dup"]
    assert str(first / "dup") in repo.errors["dup"] and str(second / "dup") in repo.errors["dup"]


def test_custom_model_filename_and_examples_plus_tmp(tmp_path: Path) -> None:
    write_model(tmp_path, "trt", 'backend: "tensorrt"\ndefault_model_filename: "x.engine"\n',
                model_file="x.engine")
    repo = scan([TRITON_EXAMPLES, tmp_path])
    assert sorted(repo.models) == sorted([*EXAMPLE_NAMES, "trt"])
    assert repo.models["trt"].model_file(1).is_file()


def test_missing_repository_raises(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        scan([tmp_path / "absent"])


def test_results_are_read_only(tmp_path: Path) -> None:
    write_model(tmp_path, "m", python_config())
    repo = scan([tmp_path])
    with pytest.raises(TypeError):
        repo.models["x"] = repo.models["m"]  # type: ignore[index]


def _ensemble(*steps: str) -> str:
    return ('platform: "ensemble"\nmax_batch_size: 8\n'
            'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
            'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]\nensemble_scheduling { step [ '
            + ", ".join(f'{{ model_name: "{s}" model_version: -1 input_map {{ key: "IN" value: "IN" }} '
                        f'output_map {{ key: "OUT" value: "OUT" }} }}' for s in steps) + " ] }\n")


def test_an_ensembles_composing_models_nested_first_without_repeats(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        write_model(tmp_path, name, python_config())
    write_model(tmp_path, "inner", _ensemble("b", "c"))
    write_model(tmp_path, "outer", _ensemble("a", "inner", "a"))
    repo = scan([tmp_path])
    assert composing_models(repo, "outer") == ["a", "b", "c", "inner"]
    assert composing_models(repo, "inner") == ["b", "c"] and composing_models(repo, "a") == []
    assert composing_models(repo, "missing") == []
    assert with_composing(repo, ["outer", "b"]) == ["a", "b", "c", "inner", "outer"]
