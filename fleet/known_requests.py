"""Infer requests already decoded and checked, kept by model and the bytes that decided them.

A client sends every request of the same shapes with the same request head: perf_analyzer, tritonclient, a
service calling one model. Only its tensors' bytes differ. Decoding that head and checking it against the
config is a function of the head and the config alone when every input's data comes from the bytes that
follow it, so each protocol keeps the result here once and hands each later request its own data:
HTTP's JSON header (gateway/header_cache.py), gRPC's request without its raw contents
(gateway/grpc/request_heads.py). A bulk job's JSONL lines (fleet/jobs/line_heads.py) carry their data in the
JSON itself: their key is the line without it, and each line's data is packed anew.

An entry holds the request with its inputs' data empty, the config object it was checked against (a reload
makes another, and the entry is checked anew) and each input's size in bytes. The least recently used entry
goes when the store is full; a key longer than LONGEST_KEY_BYTES is not kept (no large keys held). One per
gateway process and protocol (its event loop's), or per job input reader: not thread-safe.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from fleet.envelope import WireTensor
from fleet.kserve import ParsedInfer
from fleet.model_spec import ModelSpec

CAPACITY = 256  # entries; a head of a few hundred bytes each
LONGEST_KEY_BYTES = 4096

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LeastRecentlyUsed(Generic[K, V]):
    """Values by key, the least recently used dropped past `capacity` (the caches of decoded requests here,
    gateway/grpc/response_heads.py's serialized heads). One event loop's: not thread-safe."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: dict[K, V] = {}  # the least recently used first

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[K]:
        """The least recently used first."""
        return list(self._items)

    def peek(self, key: K) -> V | None:
        return self._items.get(key)

    def get(self, key: K) -> V | None:
        """The value of `key`, now the most recently used."""
        value = self._items.pop(key, None)
        if value is not None:
            self._items[key] = value
        return value

    def put(self, key: K, value: V) -> None:
        """`value` for `key`, the most recently used (replacing what `key` had); nothing is kept without room."""
        if self._capacity <= 0:
            return
        if self._items.pop(key, None) is None and len(self._items) >= self._capacity:
            del self._items[next(iter(self._items))]
        self._items[key] = value


@dataclass(frozen=True, slots=True)
class Known:
    """One request head's decoding: what every request with that head and config decodes to, but its data."""

    spec: ModelSpec  # the config it was checked against
    request: ParsedInfer  # its inputs' data empty
    sizes: tuple[int, ...]  # each input's bytes, in input order

    def with_data(self, data: Sequence[bytes | memoryview], client_id: str | None = None) -> ParsedInfer:
        """The request with each input's data (as many as `sizes`, each of its size: the caller's check), and
        this request id if given."""
        return self.request.with_inputs([WireTensor(t.name, t.datatype, t.shape, d)
                                         for t, d in zip(self.request.inputs, data, strict=True)], client_id)


class KnownRequests:
    """The entries of one protocol's cache, by model and key; an entry answers only for the config object it
    was checked against."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._entries: LeastRecentlyUsed[tuple[str, bytes], Known] = LeastRecentlyUsed(capacity)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, model: str, key: bytes, spec: ModelSpec) -> Known | None:
        """The entry of `key`, if it was checked against `spec` itself."""
        entry = (model, key)
        known = self._entries.peek(entry)
        if known is None or known.spec is not spec:
            return None
        return self._entries.get(entry)

    def keep(self, model: str, key: bytes, spec: ModelSpec, request: ParsedInfer) -> None:
        """`request`, decoded from `key` and checked against `spec`, for the requests with the same key (a
        reloaded config's replaces its entry)."""
        if len(key) > LONGEST_KEY_BYTES:
            return
        self._entries.put((model, key), Known(
            spec, request.with_inputs([WireTensor(t.name, t.datatype, t.shape, b"") for t in request.inputs]),
            tuple(len(t.data) for t in request.inputs)))
