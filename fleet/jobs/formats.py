"""The file-format layer of bulk jobs, in one import: readers, packing, writers.

Pure file I/O and tensor bytes, no Redis and no asyncio: the job runner drives these. The code lives
in `inputs` (JSONL/.npy/.npz readers), `packing` (multi-row requests and reply splitting) and
`outputs` (JSONL/.npy/.npz writers); this module is the interface the runner imports.
"""

from __future__ import annotations

from fleet.jobs.inputs import JobInput, NpyInput, NpzInput, open_input
from fleet.jobs.items import InputItem
from fleet.jobs.jsonl_input import JsonlInput, count_lines
from fleet.jobs.jsonl_output import JsonlOutput
from fleet.jobs.outputs import NpyOutput, NpzOutput, open_output, remove_output
from fleet.jobs.packing import check_rows, explode, group_items, pack, request_batches, unpack
from fleet.jobs.sink import JobOutput, write_each

__all__ = [
    "InputItem",
    "JobInput",
    "JobOutput",
    "JsonlInput",
    "JsonlOutput",
    "NpyInput",
    "NpyOutput",
    "NpzInput",
    "NpzOutput",
    "check_rows",
    "count_lines",
    "explode",
    "group_items",
    "open_input",
    "open_output",
    "pack",
    "remove_output",
    "request_batches",
    "unpack",
    "write_each",
]
