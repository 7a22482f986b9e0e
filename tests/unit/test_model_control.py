"""fleet/model_control.py (records, targets per mode, poll fingerprints) and the gateway's view of model
control (gateway/catalog.py: which config a model renders, where requests go during a roll;
gateway/model_info.py: the repository index), from heartbeats written by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from google.protobuf import text_format

from fleet.errors import ModelNotFound, ModelNotReady, NotFound, VersionNotFound
from fleet.model_control import (
    BOOT_GEN,
    ControlMode,
    ControlRecord,
    decode_records,
    desired_targets,
    fingerprint,
    startup_names,
)
from fleet.repository import scan
from gateway.catalog import Catalog
from gateway.model_control import _overrides
from gateway.model_info import repository_index

CONFIG = ('backend: "python"\nmax_batch_size: 8\n'
          'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
          'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n')


def model(repo: Path, name: str, versions: tuple[int, ...] = (1,), config: str = CONFIG) -> Path:
    for v in versions:
        (repo / name / str(v)).mkdir(parents=True, exist_ok=True)
        (repo / name / str(v) / "model.py").write_text("# model\n")
    (repo / name / "config.pbtxt").write_text(config)
    return repo / name


def beat(*units: tuple[str, int, str, str], failed: dict[str, str] | None = None,
         failed_gens: dict[str, str] | None = None, seen: dict[str, str] | None = None) -> dict[bytes, bytes]:
    ready = [[m, v, g] for m, v, g, s in units if s == "READY"]
    return {b"models": json.dumps(ready).encode(), b"units": json.dumps([list(u) for u in units]).encode(),
            b"failed": json.dumps(failed or {}).encode(), b"failed_gens": json.dumps(failed_gens or {}).encode(),
            b"seen": json.dumps(seen or {}).encode(), b"queued": b"{}"}


def test_records_round_trip_and_unreadable_ones_are_skipped() -> None:
    record = ControlRecord("e7", True, '{"max_batch_size": 4}', ("1/model.onnx",))
    assert ControlRecord.decode(record.encode()) == record
    assert ControlRecord.decode(ControlRecord("e8", False).encode()) == ControlRecord("e8", False)
    assert decode_records({b"a": record.encode().encode(), b"b": b"not json", b"c": b'{"gen": 1, "load": true}'}) \
        == {"a": record}


def test_targets_per_mode(tmp_path: Path) -> None:
    dirs = {"a": tmp_path / "a", "b": tmp_path / "b"}
    assert {t.gen for t in desired_targets(ControlMode.NONE, dirs, {}).values()} == {BOOT_GEN}
    poll = desired_targets(ControlMode.POLL, dirs, {}, {"a": "p1", "b": "p2"})
    assert (poll["a"].gen, poll["b"].gen) == ("p1", "p2")
    records = {"a": ControlRecord("e1", True, "{}"), "b": ControlRecord("e2", False),
               "uploaded": ControlRecord("e3", True, "{}", ("1/model.onnx",)), "missing": ControlRecord("e4", True)}
    explicit = desired_targets(ControlMode.EXPLICIT, dirs, records)
    assert sorted(explicit) == ["a", "uploaded"]
    assert explicit["a"].config_override == "{}" and explicit["uploaded"].model_dir is None
    assert startup_names(["*"], dirs) == ["a", "b"] and startup_names(["b", "x"], dirs) == ["b", "x"]


def test_fingerprint_follows_files_and_ignores_hidden_ones(tmp_path: Path) -> None:
    path = model(tmp_path, "m")
    first = fingerprint(path)
    assert fingerprint(path) == first
    (path / ".swap").write_text("editor noise")
    assert fingerprint(path) == first
    (path / "2").mkdir()
    (path / "2" / "model.py").write_text("# v2\n")
    second = fingerprint(path)
    assert second != first
    os.utime(path / "config.pbtxt", ns=(1, 1))
    assert fingerprint(path) != second


def test_load_parameters_are_checked_before_anything_is_written() -> None:
    assert _overrides("m", {}) == (None, {})
    assert _overrides("m", {"config": '{"max_batch_size":"16"}'}) == ('{"max_batch_size":"16"}', {})
    for bad, why in (({"config": '"parameters": {"config": {{"max_batch_size": "16"}}}'}, "failed to load"),
                     ({"config": 7}, "must be a JSON string"),
                     ({"config": "{}", "file:../x": "eA=="}, "must be relative"),
                     ({"config": "{}", "file:/abs": "eA=="}, "must be relative"),
                     ({"config": "{}", "file:1/m": "not base64!"}, "not base64"),
                     ({"file:1/m": "eA=="}, "needs a 'config'")):
        with pytest.raises(Exception, match=why):
            _overrides("m", bad)
    assert _overrides("m", {"config": "{}", "file:1/model.onnx": b"raw"})[1] == {"1/model.onnx": b"raw"}


def published(text: str) -> str:
    from fleet.model_config import parse_config

    return text_format.MessageToString(parse_config(text, source="t", model_name="m").proto)


def test_a_roll_keeps_the_old_version_until_the_new_one_serves(tmp_path: Path) -> None:
    model(tmp_path, "m", versions=(1, 2))
    repository = scan([tmp_path])
    catalog = Catalog.from_repository(repository, desired_targets(ControlMode.POLL, repository.dirs, {}, {"m": "p2"}))
    catalog.update_from_heartbeats([beat(("m", 1, "p1", "READY"), ("m", 2, "p2", "LOADING"))])
    assert catalog.resolve("m", None)[1] == 1  # the new version is not ready yet: the old one serves
    assert catalog.resolve("m", "1")[1] == 1
    with pytest.raises(ModelNotReady, match="version 2 is not at ready state"):
        catalog.resolve("m", "2")
    catalog.update_from_heartbeats([beat(("m", 1, "p1", "UNLOADING"), ("m", 2, "p2", "READY"))])
    assert catalog.resolve("m", None)[1] == 2
    with pytest.raises(VersionNotFound):
        catalog.resolve("m", "1")  # unloading: no longer routed (and not a version of the policy)
    states = [(i["version"], i["state"]) for i in repository_index(catalog, False)]
    assert states == [("1", "UNLOADING"), ("2", "READY")]


def test_the_published_config_of_the_serving_generation_is_rendered(tmp_path: Path) -> None:
    model(tmp_path, "m")
    repository = scan([tmp_path])
    records = {"m": ControlRecord("e2", True, '{"max_batch_size": 16}')}
    catalog = Catalog.from_repository(repository, desired_targets(ControlMode.EXPLICIT, repository.dirs, records))
    with pytest.raises(ModelNotFound):  # an override not yet published: nothing to render
        catalog.view("m")
    catalog.add_configs({("m", "e1"): published(CONFIG)})
    catalog.update_from_heartbeats([beat(("m", 1, "e1", "READY"), ("m", 1, "e2", "LOADING"))])
    assert catalog.view("m").entry.spec.max_batch_size == 8  # the generation still serving
    catalog.add_configs({("m", "e2"): published(CONFIG.replace("max_batch_size: 8", "max_batch_size: 16"))})
    # Published, but not serving yet: requests are still checked against what serves them.
    assert catalog.view("m").entry.spec.max_batch_size == 8
    catalog.update_from_heartbeats([beat(("m", 1, "e1", "UNLOADING"), ("m", 1, "e2", "READY"))])
    assert catalog.view("m").entry.spec.max_batch_size == 16
    assert catalog.wanted_gens() == [("m", "e2")]  # just became ready: read again (a republish)
    catalog.add_configs({("m", "e2"): published(CONFIG.replace("max_batch_size: 8", "max_batch_size: 16"))})
    assert catalog.wanted_gens() == []


def test_the_index_says_why_and_names_a_model_never_loaded(tmp_path: Path) -> None:
    for name in ("loaded", "broken", "never", "gone"):
        model(tmp_path, name)
    repository = scan([tmp_path])
    records = {"loaded": ControlRecord("e1", True), "broken": ControlRecord("e2", True),
               "gone": ControlRecord("e3", False)}
    catalog = Catalog.from_repository(repository, desired_targets(ControlMode.EXPLICIT, repository.dirs, records))
    catalog.unloaded = frozenset({"gone"})
    catalog.update_from_heartbeats([beat(("loaded", 1, "e1", "READY"), failed={"broken": "initialize raised"},
                                         failed_gens={"broken": "e2"})])
    index = {i["name"]: i for i in repository_index(catalog, False)}
    assert index["loaded"] == {"name": "loaded", "version": "1", "state": "READY"}
    assert index["broken"]["state"] == "UNAVAILABLE" and index["broken"]["reason"] == "initialize raised"
    assert index["never"] == {"name": "never"}
    assert index["gone"] == {"name": "gone", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    assert [i["name"] for i in repository_index(catalog, True)] == ["loaded"]
    with pytest.raises(NotFound, match="'gone' has no available versions$"):  # Triton's 404, not a 503
        catalog.resolve("gone", None)
    with pytest.raises(NotFound, match="'gone' has no available versions$"):  # its metadata and config too
        catalog.view("gone")
    with pytest.raises(ModelNotFound, match="'never' is not found"):  # never loaded: as one not there
        catalog.resolve("never", None)
    with pytest.raises(ModelNotFound):
        catalog.resolve("nothing", None)
