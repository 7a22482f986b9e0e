"""Statistics counters that workers keep in Redis and the field names both sides agree on. Values are
cumulative; several workers add into the same fields, so the gateway's /stats is the fleet-wide sum
(perf_analyzer diffs two samples).

Layout: one hash per model (Keys.stats) holds the sums. A worker does not add a batch's ~20-60 increments
into it on the request path: it appends them as one entry (a msgpack map) to the model's stats log
(Keys.stats_log), a plain XADD ahead of the batch's replies in the same pipeline. A script adding them in
Redis cost 50-100 µs of Redis's time a batch and held the reply's delivery to the gateway until it had
run (Redis writes the unblocked reader's reply only after the writer's whole pipeline). A worker's entry
carries a token; one written again after a write whose outcome is unknown (the connection dropped after
Redis may have run it, by custody's retry or the link's own resend) is marked a copy, and the fold counts
each token once, whichever copy comes first (a gateway's own entries have none: they are not retried, a
failed write loses them). FOLD_STATS adds
the log's entries into the hash and deletes them, atomically: every reader of the hash runs it first, in
the same pipeline (so a batch answered before the read is counted in it), and every worker runs it for its
models a chunk at a time, as often as their logs grow (so the log stays short when nobody reads, and no
fold holds Redis long: FOLD_CHUNK). Rare counts (claims, dead letters) still go straight into the hash;
the gateway's own (cache hits and misses, ensembles) are log entries too (gateway/counters.py)."""

from __future__ import annotations

import random
from bisect import bisect_left
from dataclasses import dataclass

import msgpack

from fleet.keys import Keys
from fleet.latency_stats import DISTRIBUTIONS, LATENCY_BOUNDS_US, bucket_index

# Model-wide fields (no version prefix), counted by the workers' custody (workers/custody.py): messages
# taken over from a dead or stalled consumer, those of them computed again, and messages dead-lettered.
CLAIMED = "model:claimed"
REDELIVERED = "model:redelivered"
DEAD_LETTERED = "model:dead_lettered"

DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
             "cache_hit", "cache_miss")


@dataclass(frozen=True, slots=True)
class BatchSample:
    """What one executed batch adds to the counters of one model version."""

    version: int
    batch_size: int  # rows executed
    requests_ok: int
    requests_failed: int
    request_ns_ok: int  # Σ end-to-end time of the successful requests
    request_ns_failed: int
    queue_ns: int  # Σ queue time of the successful requests
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    finished_ms: int
    requests_rejected: int = 0  # of requests_failed: timed out in the queue, never executed (REJECT)
    # Each successful request's end-to-end and queue time (µs), for the latency buckets
    # (fleet/latency_stats.py); empty: none counted.
    request_us: tuple[int, ...] = ()
    queue_us: tuple[int, ...] = ()
    # Under the rate limiter: how long the instance waited for its resources (-1: not rate limited).
    resource_wait_ns: int = -1
    # A request run as several executions of these rows each (workers/request_parts.py: a bulk job's packed
    # request); empty: one execution of batch_size rows.
    parts: tuple[int, ...] = ()


LAST_INFERENCE = "last_inference"  # a time (ms), not a count: the fold keeps the latest, never adds
LOG_FIELD = "s"  # a log entry's first field: its increments, a msgpack map (Lua's cmsgpack reads it)
# Its second field: a token unique to the batch (TOKEN_BYTES), under TOKEN_FIELD when first written, under
# COPY_FIELD when written again after a write whose outcome was unknown.
TOKEN_FIELD, COPY_FIELD = "t", "r"
TOKEN_BYTES = 16
# How long a folded token is remembered: its record is current for a rotation, then older until the next
# rotation or its expiry (three rotations after it was made), so at least a rotation. A copy comes within a
# write's retries (custody's finish_retry_s, 30 s by default, plus a round trip's 5 s timeout and the link's
# one resend); its first is folded within about a second. Memory: TOKEN_BYTES a batch (with APPEND's
# headroom up to twice that), two to three rotations of batches: up to ~6 MB per model at 1,000 batches a
# second.
FOLDED_ROTATE_S = 60

# KEYS[1] = stats log, KEYS[2] = stats hash, KEYS[3] / KEYS[4] = the tokens folded, in the current
# rotation / the one before, KEYS[5] / KEYS[6] = the same for the copies counted (strings: tokens back to
# back); ARGV[1] = most entries to fold, ARGV[2] = rotation (s), ARGV[3] = TOKEN_BYTES. Sums in Lua first,
# so a field costs one HINCRBY per fold, not per batch (Lua numbers are doubles: exact below 2^53, far
# above what a fold adds up to). Returns how many entries it folded. About 10-15 µs of Redis's time an
# entry here (a msgpack map in the one field LOG_FIELD, 's'; as 20-odd stream fields, each converted to a
# Lua string, it was up to twice that); a fold appends its entries' tokens with one APPEND.
# Which entries count: a token seen earlier in the same fold never again. A copy (COPY_FIELD) whose token
# is in the records is not counted (its first, or an earlier copy, was). A copy counted (its first had not
# come) goes into the copies' records too, and a first (TOKEN_FIELD) found there is not counted: a first
# delayed in the network past its copy. Copies are few (failed writes: after an outage, every write that
# was in flight), so a search through the records is only paid for them: ~0.2 ms of Redis's time a copy
# against two records of 60k tokens (1,000 batches a second), plus ~3-4 ms to read them once a fold
# (measured with 1-100 copies; less in proportion at fewer batches a second). The copies' records are read
# every fold, and are usually absent.
# An entry without a token (from a worker before tokens) is counted.
# Redis does not undo a script's writes when it fails part-way: everything that can fail (reading an
# entry and the records, the hash's times) comes before the first write, and the entries are deleted
# before their sums are added, so a failure can lose one fold's counts but never add them twice (the
# tokens are recorded before the sums, so a copy cannot add them again either). An entry that is not a
# msgpack map of numbers is dropped, not left to stop every later fold.
FOLD_STATS = """
local entries = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', ARGV[1])
if #entries == 0 then return 0 end
local rotate_s, size = tonumber(ARGV[2]), tonumber(ARGV[3])
local folded_ttl, copied_ttl = redis.call('PTTL', KEYS[3]), redis.call('PTTL', KEYS[5])
local copied = (redis.call('GET', KEYS[5]) or '') .. (redis.call('GET', KEYS[6]) or '')
local function aligned_in(record, token)  -- at a multiple of the token's size
  local from = 1
  while true do
    local at = string.find(record, token, from, true)
    if at == nil then return false end
    if (at - 1) % size == 0 then return true end
    from = at + 1
  end
end
local records = nil
local function folded_before(token)
  if records == nil then records = {redis.call('GET', KEYS[3]) or '', redis.call('GET', KEYS[4]) or ''} end
  return aligned_in(records[1], token) or aligned_in(records[2], token)
end
local sums, latest, is_time, tokens, copies, seen = {}, {}, {}, {}, {}, {}
for _, entry in ipairs(entries) do
  local fields = entry[2]
  local kind, token = fields[3], fields[4]
  local counted = true
  if token and #token == size and (kind == 't' or kind == 'r') then
    if seen[token] or (copied ~= '' and aligned_in(copied, token)) or (kind == 'r' and folded_before(token)) then
      counted = false  -- a copy of an entry already counted
    else
      seen[token] = true
      tokens[#tokens + 1] = token
      if kind == 'r' then copies[#copies + 1] = token end
    end
  end
  local ok, t = pcall(cmsgpack.unpack, fields[2] or '')
  if counted and fields[1] == 's' and ok and type(t) == 'table' then
    for name, value in pairs(t) do
      if type(name) == 'string' and type(value) == 'number' then
        local time = is_time[name]
        if time == nil then  -- once per field name, not per entry
          time = string.sub(name, -15) == ':last_inference'
          is_time[name] = time
        end
        if time then
          if value > (latest[name] or 0) then latest[name] = value end
        else
          sums[name] = (sums[name] or 0) + value
        end
      end
    end
  end
end
for name, value in pairs(latest) do
  if value <= (tonumber(redis.call('HGET', KEYS[2], name) or '0') or 0) then latest[name] = nil end
end
for i = 1, #entries, 500 do
  local ids = {}
  for j = i, math.min(i + 499, #entries) do ids[#ids + 1] = entries[j][1] end
  redis.call('XDEL', KEYS[1], unpack(ids))
end
-- The tokens before the sums: a fold that fails part-way through its sums must not leave them to be
-- counted again by a copy. A record is made the older one once it has been current for a rotation (it
-- expires three rotations after it was made).
local function record(current, older, ttl, added)
  if #added == 0 then return end
  if ttl >= 0 and ttl <= 2000 * rotate_s then
    redis.call('RENAME', current, older)
    ttl = -2
  end
  redis.call('APPEND', current, table.concat(added))
  if ttl < 0 then redis.call('EXPIRE', current, 3 * rotate_s) end
end
record(KEYS[3], KEYS[4], folded_ttl, tokens)
record(KEYS[5], KEYS[6], copied_ttl, copies)
for name, value in pairs(sums) do redis.call('HINCRBY', KEYS[2], name, string.format('%d', value)) end
for name, value in pairs(latest) do redis.call('HSET', KEYS[2], name, string.format('%d', value)) end
return #entries
"""
# Entries a reader folds before it reads (gateway/dataplane.py, queue_reading.py): everything the workers
# have not folded yet, which their own folds keep to a fraction of a second's batches.
FOLD_MAX = 2_000
# Entries a worker's or a gateway's own fold takes at once. A fold holds Redis ~6-7 µs an entry on stop 50's
# host (~1 ms a chunk), and every request in flight waits for it: when a worker folded a second's log each
# second (~1,100 batches, ~7 ms), that stall was the slowest 1 % of `mlp` requests at 2,000 a second
# (bench/RESULTS.md, stop 50). A backlog is folded a chunk a round trip, other clients served between.
FOLD_CHUNK = 128
# A worker folds at most this far apart (a log nobody writes costs one EVAL a second), at least FOLD_MIN_S
# apart unless its last fold came back full (fold_delay).
FOLD_IDLE_S = 1.0
FOLD_MIN_S = 0.01


def fold_delay(folded: int, elapsed_s: float, chunk: int = FOLD_CHUNK) -> float:
    """How long a worker waits before its next fold of up to `chunk` entries, given that its last one
    folded `folded` entries logged over the `elapsed_s` before it: about half a chunk's worth of the rate
    the log grew at, so a fold stays well under a chunk; at once after a full one (a backlog);
    FOLD_IDLE_S when nothing came."""
    if folded >= chunk:
        return 0.0
    if folded <= 0 or elapsed_s <= 0:
        return FOLD_IDLE_S
    return min(FOLD_IDLE_S, max(FOLD_MIN_S, elapsed_s * chunk / (2 * folded)))


def fold_args(keys: Keys, model: str, most: int = FOLD_MAX,
              rotate_s: int = FOLDED_ROTATE_S) -> tuple[str, int, str, str, str, str, str, str, int, int, int]:
    """EVAL's arguments after the command name: fold `model`'s stats log into its hash."""
    return (FOLD_STATS, 6, *fold_keys(keys, model), *fold_argv(most, rotate_s))


def fold_argv(most: int = FOLD_MAX, rotate_s: int = FOLDED_ROTATE_S) -> tuple[int, int, int]:
    """FOLD_STATS's ARGV: fold up to `most` entries."""
    return (most, rotate_s, TOKEN_BYTES)


def fold_keys(keys: Keys, model: str) -> tuple[str, str, str, str, str, str]:
    """FOLD_STATS's KEYS for `model`."""
    return (keys.stats_log(model), keys.stats(model), keys.stats_tokens(model), keys.stats_tokens(model, "old"),
            keys.stats_tokens(model, "copied"), keys.stats_tokens(model, "copied:old"))


@dataclass(frozen=True, slots=True)
class LoggedBatch:
    """One batch's stats-log entry (LOG_FIELD's value) and its token (TOKEN_BYTES random bytes)."""

    entry: bytes
    token: bytes


def logged_batches(samples: list[BatchSample]) -> list[LoggedBatch]:
    """The stats-log entries of `samples` (those with anything to count), each with a new random token
    (uniform bytes: a search through folded tokens in FOLD_STATS seldom stops at a false start; `random`
    reseeds itself in a forked child)."""
    return [LoggedBatch(entry, random.getrandbits(8 * TOKEN_BYTES).to_bytes(TOKEN_BYTES, "little"))
            for s in samples if (entry := log_entry(s)) is not None]


def field(version: int, name: str) -> str:
    return f"{version}:{name}"


def log_entry(s: BatchSample) -> bytes | None:
    """One batch's stats-log entry (LOG_FIELD's value): its increments, and when it finished (if any
    request succeeded). None: nothing to count."""
    d = increments(s)
    if s.requests_ok:
        d[_names_of(s.version).last_inference] = s.finished_ms
    return msgpack.packb(d) if d else None


class _Names:
    """One version's field names, made once: an entry is built on every batch's path, and formatting its
    ~20 names anew was most of a lone request's entry (11 µs of it in process)."""

    __slots__ = ("version", "sums", "fail", "rejected", "rate_limit", "last_inference", "buckets", "_batch")

    def __init__(self, version: int) -> None:
        self.version = version
        self.sums = tuple(field(version, n) for n in (
            "success:count", "success:ns", "queue:count", "queue:ns", "compute_input:count", "compute_input:ns",
            "compute_infer:count", "compute_infer:ns", "compute_output:count", "compute_output:ns",
            "inference_count", "execution_count"))
        self.fail = (field(version, "fail:count"), field(version, "fail:ns"))
        self.rejected = field(version, "rejected:count")
        self.rate_limit = (field(version, "rate_limit:count"), field(version, "rate_limit:ns"))
        self.last_inference = field(version, LAST_INFERENCE)
        # Per distribution, its buckets' fields by bucket_index (fleet/latency_stats.py's bucket_name).
        self.buckets = {dist: tuple(field(version, f"lat:{dist}:{i}") for i in range(len(LATENCY_BOUNDS_US) + 1))
                        for dist in DISTRIBUTIONS}
        self._batch: dict[int, tuple[str, ...]] = {}

    def of_batch(self, size: int) -> tuple[str, ...]:
        """A batch size's four fields (sizes are bounded by the model's max_batch_size)."""
        names = self._batch.get(size)
        if names is None:
            names = self._batch[size] = tuple(field(self.version, f"batch:{size}:{p}") for p in
                                              ("count", "compute_input", "compute_infer", "compute_output"))
        return names


_names: dict[int, _Names] = {}


def _names_of(version: int) -> _Names:
    names = _names.get(version)
    if names is None:
        names = _names[version] = _Names(version)
    return names


def increments(s: BatchSample) -> dict[str, int]:
    """The HINCRBY deltas for one batch (compute times count once per request, as Triton does)."""
    n = _names_of(s.version)
    ok = s.requests_ok
    sums = n.sums
    values = (ok, s.request_ns_ok, ok, s.queue_ns, ok, s.compute_input_ns * ok, ok, s.compute_infer_ns * ok,
              ok, s.compute_output_ns * ok, s.batch_size if ok else 0, (len(s.parts) or 1) if ok else 0)
    d = {name: value for name, value in zip(sums, values, strict=True) if value}
    if s.requests_failed:
        d[n.fail[0]] = s.requests_failed
        if s.request_ns_failed:
            d[n.fail[1]] = s.request_ns_failed
    if s.requests_rejected:
        d[n.rejected] = s.requests_rejected
    if s.resource_wait_ns >= 0:  # executions through the rate limiter, and their wait for resources
        d[n.rate_limit[0]] = 1
        if s.resource_wait_ns:
            d[n.rate_limit[1]] = s.resource_wait_ns
    if ok:
        _add_latencies(d, n, s)
        if s.parts:
            _add_parts(d, n, s)
            return d
        names = n.of_batch(s.batch_size)
        for name, value in zip(names, (1, s.compute_input_ns, s.compute_infer_ns, s.compute_output_ns), strict=True):
            if value:
                d[name] = value
    return d


def _add_parts(d: dict[str, int], n: _Names, s: BatchSample) -> None:
    """A request run in parts: one execution of each part's size, the request's compute times shared among
    them by rows (what each part took is not kept apart), each time's remainder on the last."""
    total = sum(s.parts)
    times = (s.compute_input_ns, s.compute_infer_ns, s.compute_output_ns)
    given = [0, 0, 0]
    for i, rows in enumerate(s.parts):
        last = i == len(s.parts) - 1
        shares = [t - g if last else t * rows // total for t, g in zip(times, given, strict=True)]
        given = [g + share for g, share in zip(given, shares, strict=True)]
        for name, value in zip(n.of_batch(rows), (1, *shares), strict=True):
            if value:
                d[name] = d.get(name, 0) + value


def _add_latencies(d: dict[str, int], n: _Names, s: BatchSample) -> None:
    """The latency-bucket deltas of a batch: one per request for the end-to-end and queue times, and
    the batch's compute times once per successful request (as their sums count them)."""
    buckets = n.buckets
    for dist, values in (("request", s.request_us), ("queue", s.queue_us)):
        names = buckets[dist]
        for value in values:
            name = names[bisect_left(LATENCY_BOUNDS_US, value)]  # bucket_index, inlined: per request
            d[name] = d.get(name, 0) + 1
    ok = s.requests_ok
    for dist, ns in (("compute_input", s.compute_input_ns), ("compute_infer", s.compute_infer_ns),
                     ("compute_output", s.compute_output_ns)):
        name = buckets[dist][bucket_index(ns // 1000)]
        d[name] = d.get(name, 0) + ok


def render_model_stats(name: str, version: int, raw: dict[str, int]) -> dict[str, object]:
    """Triton's statistics-extension object for one (model, version) from the decoded hash fields."""

    def get(key: str) -> int:
        return raw.get(field(version, key), 0)

    inference_stats = {d: {"count": get(f"{d}:count"), "ns": get(f"{d}:ns")} for d in DURATIONS}
    batch_sizes = sorted(
        {int(k.split(":")[2]) for k in raw if k.startswith(f"{version}:batch:") and k.endswith(":count")}
    )
    batch_stats = []
    for size in batch_sizes:
        count = get(f"batch:{size}:count")
        batch_stats.append({
            "batch_size": size,
            **{p: {"count": count, "ns": get(f"batch:{size}:{p}")}
               for p in ("compute_input", "compute_infer", "compute_output")},
        })
    return {
        "name": name,
        "version": str(version),
        "last_inference": get(LAST_INFERENCE),
        "inference_count": get("inference_count"),
        "execution_count": get("execution_count"),
        "inference_stats": inference_stats,
        "response_stats": {},
        "batch_stats": batch_stats,
        "memory_usage": [],
    }
