"""The one Settings object, read from the environment (FLEET_ prefix) once per entrypoint."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
MAX_PACK_BATCHES = 16  # the most batches of rows a bulk job may put in one request (`pack_batches`)


class Settings(BaseSettings):
    """Everything a fleet process needs to know; frozen, passed down explicitly.

    `redis_url` also reads the conventional REDIS_URL. Per-model behaviour (batching, instances, queue
    policy) comes from config.pbtxt, never from here.
    """

    model_config = SettingsConfigDict(env_prefix="FLEET_", frozen=True, extra="ignore")

    # Empty: `fleet up` starts an embedded server; gateway/worker alone use DEFAULT_REDIS_URL.
    redis_url: str = Field(
        default="",
        validation_alias=AliasChoices("FLEET_REDIS_URL", "REDIS_URL", "redis_url"),
    )
    key_prefix: str = "fleet"
    model_repositories: tuple[Path, ...] = (Path("model_repository"),)
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    metrics_port: int = 8002
    # gRPC (Triton's inference.GRPCInferenceService), served by the gateway process next to HTTP.
    allow_grpc: bool = True
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 8001
    # Several gateway processes on one host serve the same HTTP, metrics and gRPC ports (SO_REUSEPORT,
    # fleet/listen.py); `fleet up --gateways N` sets it for each. Off: a taken port fails the start.
    reuse_port: bool = False
    # Gateway processes on this host's ports (one Python event loop each; the kernel spreads connections):
    # what `fleet up --gateways N` runs, and `fleet gateway --processes N` (a container's front end).
    gateways: int = Field(default=1, ge=1)
    # A directory the gateway processes of one host share their system shared-memory registrations
    # through (gateway/shm_registrations.py); `fleet up --gateways N` sets one. None: each process its own.
    shared_memory_dir: Path | None = None
    # tritonserver's --grpc-keepalive-* / --grpc-http2-* flags, with its defaults (times in ms).
    grpc_keepalive_time_ms: int = 7_200_000
    grpc_keepalive_timeout_ms: int = 20_000
    grpc_keepalive_permit_without_calls: bool = False
    grpc_http2_max_pings_without_data: int = 2
    grpc_http2_min_recv_ping_interval_without_data_ms: int = 300_000
    grpc_http2_max_ping_strikes: int = 2
    # tritonserver's --grpc-infer-response-compression-level: none, low, med or high (gzip).
    grpc_response_compression_level: Literal["none", "low", "med", "high"] = "none"
    log_verbose: int = 0
    # text: for a terminal (fleet up prefixes each line with its process); json: one object per line with
    # role, pid and the request's model/version/id (fleet/log_format.py), what containers run with.
    log_format: Literal["text", "json"] = "text"
    # Where this gateway process writes its traces (Triton's --trace-config triton,file=...; the trace
    # extension cannot change it). With log_frequency N: FILE.0, FILE.1, ... each N traces. Several
    # gateway processes on one host need one each.
    trace_file: Path = Path(".fleet/trace.json")
    # The gateway gives up waiting for a worker's reply after this long (504).
    request_timeout_s: float = 60.0
    max_input_bytes: int = 64 * 1024 * 1024
    # A request line and headers longer than this are answered 431 (uvicorn itself sets no limit).
    max_header_bytes: int = 64 * 1024
    # Inference requests one gateway process holds at once; past it, 503 with Retry-After at once.
    max_in_flight: int = 4096
    # Request-body bytes one gateway process holds at once (read, or announced by Content-Length and
    # being read); past it, 503 with Retry-After at once.
    max_in_flight_bytes: int = 1024 * 1024 * 1024
    # Slow clients (Apache mod_reqtimeout's model): a request head must arrive within read_timeout_s,
    # extended by 1 s per read_min_rate_bps bytes received, never past header_timeout_max_s; a body
    # within read_timeout_s, extended the same way (no cap, so a large upload at a sane rate passes).
    # Past it: 408 and the connection is closed.
    read_timeout_s: float = Field(default=20.0, gt=0)
    header_timeout_max_s: float = Field(default=40.0, gt=0)
    read_min_rate_bps: int = Field(default=500, gt=0)
    # Bulk-job uploads (POST /v2/jobs/uploads) may be this large; one JSONL line at most this long.
    max_upload_bytes: int = 2 * 1024 * 1024 * 1024
    max_job_line_bytes: int = 16 * 1024 * 1024
    # Heartbeats: a worker refreshes its key every interval; the key expires after ttl.
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    # A reader blocks this long on XREADGROUP / XREAD before checking for shutdown.
    block_ms: int = 1000
    # A worker keeps at most this many batches per model and instance read ahead (the one executing, the one
    # staged behind it, and one more: with two, a GPU-like model's instance found no batch staged after half
    # its batches of 328 µs, 0.80x the rows a second of three; bench/RESULTS.md, stop 65).
    read_ahead_batches: int = 3
    # Messages a dead worker left pending are claimed by another after this much idle time: 0 derives
    # it from the model's observed batch execution time (fleet/claims.py), never under claim_min_ms.
    # A live worker refreshes what it holds every claim_keepalive_s, so only a dead one's messages age.
    # A message delivered more than max_deliveries times goes to the dead letters with an error reply.
    claim_idle_ms: int = 0
    claim_min_ms: int = 3000
    claim_keepalive_s: float = 1.0
    claim_interval_s: float = 1.0
    max_deliveries: int = 3
    # A consumer (a worker's name in a model's group) that holds nothing, has been idle this long and
    # whose worker has no heartbeat any more is removed from the group.
    dead_consumer_idle_s: float = 300.0
    # An instance executing one batch longer than this is hung: the worker stops advertising the model
    # and restarts the instance (Python backend: its stub process) or exits for its supervisor.
    watchdog_s: float = 120.0
    # A batch of an in-process CPU model (TorchScript, ONNX) is computed by the worker's event loop itself
    # (no hand-off to and from the instance's thread) when the batches it computed before say it takes at
    # most this long (about the longest the loop computes one), it has no bulk-lane request, no other model or
    # version on the worker holds requests not yet answered, and the model version has one instance or its
    # clients send one at a time (workers/inline.py has every condition). 0 = always on the thread.
    inline_max_us: int = Field(default=5000, ge=0)
    # The gateway fails requests waiting for a reply with 503 once Redis has been unreachable this long
    # (a restart shorter than this loses nothing: with AOF, queued requests are answered after it).
    redis_outage_s: float = 5.0
    # Lane aging (batching.policy): a queued request rises one priority lane per this much waiting, so
    # bulk work progresses (slowly) even under saturating online load. 0 = strict priority.
    lane_aging_ms: int = 1000
    # On CPU workers, the most of an instance's time bulk batches may take while online requests are
    # coming in: bulk compute holds a core the online path needs. 1.0 = no limit (GPU workers always).
    bulk_share_cpu: float = Field(default=0.35, gt=0, le=1)
    worker_id: str = ""
    gateway_id: str = ""
    # Model control (fleet/model_control.py), Triton's flags: --model-control-mode, --load-model (repeatable;
    # `*` = all; explicit mode), --repository-poll-secs (poll mode), --disable-auto-complete-config /
    # --strict-model-config (auto_complete_config off: a model needs a complete config.pbtxt).
    model_control_mode: Literal["none", "poll", "explicit"] = "none"
    load_models: tuple[str, ...] = ()
    repository_poll_secs: float = Field(default=15.0, gt=0)
    auto_complete_config: bool = True
    # A load call answers once a worker serves the model or every live worker failed to, within this.
    model_load_timeout_s: float = Field(default=120.0, gt=0)
    # A version being unloaded keeps reading this long after it stops being advertised (gateways follow
    # heartbeats within ~1.5 s), then until its streams are empty, so nothing routed to it is stranded.
    unload_grace_s: float = Field(default=2.0, ge=0)
    # BLS (workers/bls.py): how many calls deep a chain of Python models calling models may go (a client's
    # request is depth 0). A call that would go deeper fails with an error that shows the chain.
    bls_max_depth: int = Field(default=8, ge=1, le=64)
    # Triton's rate limiter (workers/rate_limiter.py): --rate-limit off|execution_count and
    # --rate-limit-resource NAME:COUNT[:DEVICE] (repeatable; from the env as a JSON list).
    rate_limit: Literal["off", "execution_count"] = "off"
    rate_limit_resources: tuple[str, ...] = ()
    # Triton's --cache-config (`local,size=BYTES`): the response cache's budget, kept in Redis and shared by
    # the fleet (gateway/response_cache.py); empty: no cache, whatever models enable.
    cache_config: str = ""
    # Where a worker writes the `file:` overrides of a load call, one directory per load.
    model_load_dir: Path = Path(".fleet/loads")
    # Auth (gateway/auth.py): bearer keys, comma-separated and/or one per line in a file; the scopes
    # that need one when keys exist; model control without keys only if enabled.
    api_keys: str = ""
    api_keys_file: Path | None = None
    auth_scopes: str = "infer,control,jobs"
    control_api: bool = False
    # Bulk jobs: uploads and outputs live here (shared by the gateway and the job workers).
    jobs_dir: Path = Path(".fleet/jobs")
    # Rows a job holds at once, from submitting them until they are written to its output (flow control:
    # never the whole input in Redis, and bounded memory however long the head of the window waits).
    job_window_rows: int = 4096
    # Batches of rows a job puts in one request where it does not say (`pack_batches`): the worker runs them
    # one after another (workers/request_parts.py), giving way between them while online requests wait.
    job_pack_batches: int = Field(default=4, ge=1, le=MAX_PACK_BATCHES)
    # A job's request still unanswered after this long is checked: sent again if its lane entry is gone
    # (its reply was lost), left waiting if the entry is still queued or held by a worker.
    job_reply_timeout_s: float = Field(default=60.0, gt=0)
    # A job runner holds its job's lease this long between refreshes; a job whose lease lapsed is
    # resumed by another job worker.
    job_lease_ms: int = 10_000
    # RQ job workers `fleet up` runs.
    job_workers: int = 1
    # Processes a job worker forks to parse a JSONL job's lines beside its own thread (fleet/jobs/parse_pool.py);
    # None: two where the job worker's host has four cores or more, else 0: parse in the job worker.
    job_parse_processes: int | None = Field(default=None, ge=0)
    # Directories a job's server-side input path may lie in (after symlinks), besides jobs_dir/uploads;
    # empty: only uploads. From the env as a JSON list: FLEET_JOB_INPUT_DIRS='["/data/in"]'.
    job_input_dirs: tuple[Path, ...] = ()

    @property
    def redis_url_or_default(self) -> str:
        return self.redis_url or DEFAULT_REDIS_URL
