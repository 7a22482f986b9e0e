"""The logging extension's settings (fleet/log_settings.py): validation with Triton's texts, merging
what the hash holds over a process's defaults."""

from __future__ import annotations

import json

import pytest

from fleet.errors import InvalidInput, Unsupported
from fleet.log_settings import LogSettings, decode_stored, parse_log_update


def test_an_update_keeps_only_what_it_changes() -> None:
    update = parse_log_update({"log_info": False, "log_verbose_level": 2, "log_format": "ISO8601",
                               "log_warning": None, "log_file": ""})
    assert update == {"log_info": False, "log_verbose_level": 2, "log_format": "ISO8601"}
    merged = LogSettings(log_verbose_level=1).merged(update)
    assert merged == LogSettings(log_info=False, log_verbose_level=2, log_format="ISO8601")
    assert merged.response() == {"log_file": "", "log_info": False, "log_warning": True, "log_error": True,
                                 "log_verbose_level": 2, "log_format": "ISO8601"}


@pytest.mark.parametrize(("doc", "text"), [
    ({"log_info": "false"}, "attempt to access JSON non-boolean as boolean: 'log_info' must be true or false"),
    ({"log_error": 0}, "attempt to access JSON non-boolean as boolean: 'log_error'"),
    ({"log_verbose_level": -1}, "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ({"log_verbose_level": "1"}, "'log_verbose_level' must be an integer from 0 to 2147483647, got \"1\""),
    ({"log_verbose_level": True}, "'log_verbose_level' must be an integer"),
    ({"log_verbose_level": 2**31}, "'log_verbose_level' must be an integer"),
    ({"log_format": "json"}, "invalid argument for --log_format, got: json"),
    ({"log_warnings": True}, "unknown log setting 'log_warnings'"),
    ([1], "must be a JSON object"),
])
def test_invalid_updates_name_the_setting(doc: object, text: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        parse_log_update(doc)
    assert text in exc.value.message


def test_the_log_file_cannot_be_changed() -> None:
    with pytest.raises(Unsupported, match="log file location can not be updated through network protocol"):
        parse_log_update({"log_file": "/tmp/x.log"})


def test_stored_fields_this_version_cannot_read_are_skipped() -> None:
    raw = {b"log_info": b"false", b"log_verbose_level": json.dumps(3).encode(), b"log_colour": b"true",
           b"log_format": b"not json"}
    assert decode_stored(raw) == {"log_info": False, "log_verbose_level": 3}
