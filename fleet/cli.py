"""The `fleet` command line. Flag names follow tritonserver where it has one.

    fleet up       embedded Redis (or --redis-url) + one gateway + one worker per device
    fleet gateway  the gateway alone, HTTP and gRPC (compose runs this)
    fleet worker   one worker process alone (compose runs this)
    fleet jobs-worker  an RQ worker running bulk jobs (compose runs this)
    fleet dead-letters MODEL [--replay]  what could not be answered, and putting it back
    fleet submit | jobs | job | cancel   bulk jobs through a gateway's /v2/jobs (fleet/job_client.py)
    fleet analyze MODEL   Model Analyzer: sweep instances and batching against a running fleet (fleet/analyzer)
    fleet status   live view of workers, models, queues, throughput and jobs (fleet/status_cli.py)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleet import client_args, grpc_flags
from fleet.settings import Settings


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-repository", "--model-store", dest="model_repository", action="append", type=Path,
        help="model repository directory (repeatable); default ./model_repository",
    )
    p.add_argument("--redis-url", help="use this Redis instead of the default (env REDIS_URL)")
    p.add_argument("--log-verbose", type=int, default=None, help="verbose logging level (0 = off)")
    p.add_argument("--log-format", choices=["text", "json"], default=None,
                   help="text (default) or json: one object per line (env FLEET_LOG_FORMAT); Triton's "
                        "default/ISO8601 timestamps are the logging extension's (/v2/logging)")
    p.add_argument("--key-prefix", help="prefix of every Redis key (default fleet)")
    p.add_argument("--jobs-dir", type=Path, help="bulk job uploads and outputs (default .fleet/jobs)")
    p.add_argument("--cache-config", default=None, metavar="local,size=BYTES",
                   help="response cache budget (kept in Redis, shared by the fleet); models opt in with "
                        "response_cache { enable: true }")
    p.add_argument("--rate-limit", choices=["off", "execution_count"], default=None,
                   help="off (default): instances execute at will; execution_count: under their rate_limiter")
    p.add_argument("--rate-limit-resource", action="append", default=None, metavar="NAME:COUNT[:DEVICE]",
                   help="how many of a rate-limiter resource there are (repeatable)")
    control = p.add_argument_group("model control (tritonserver's flags)")
    control.add_argument("--model-control-mode", choices=["none", "poll", "explicit"], default=None,
                         help="none (default): serve the repository as found; poll: follow its changes; "
                              "explicit: load and unload through the repository API")
    control.add_argument("--load-model", action="append", default=None, metavar="NAME",
                         help="explicit mode: load this model at start (repeatable; * = all)")
    control.add_argument("--repository-poll-secs", type=float, default=None, help="poll mode: rescan period (15)")
    control.add_argument("--disable-auto-complete-config", "--strict-model-config", dest="strict_model_config",
                         action="store_true", default=None,
                         help="never complete a config from the model file: config.pbtxt must be complete")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleet", description="Triton-compatible inference fleet on Redis")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run Redis, a gateway and workers locally")
    _common(up)
    up.add_argument("--http-port", type=int, default=None)
    up.add_argument("--metrics-port", type=int, default=None)
    up.add_argument("--http-address", default=None)
    up.add_argument("--workers", type=int, default=None, help="worker processes (default: one per device)")
    up.add_argument("--data-dir", type=Path, default=Path(".fleet"), help="embedded Redis files and logs")
    up.add_argument("--job-workers", type=int, default=None, help="RQ workers for bulk jobs (default 1)")
    up.add_argument("--gateways", type=_positive, default=None,
                    help="gateway processes sharing the ports (SO_REUSEPORT; default 1)")
    grpc_flags.add_arguments(up)

    gw = sub.add_parser("gateway", help="run the gateway (HTTP and gRPC)")
    _common(gw)
    gw.add_argument("--http-port", type=int, default=None)
    gw.add_argument("--metrics-port", type=int, default=None)
    gw.add_argument("--http-address", default=None)
    gw.add_argument("--reuse-port", action="store_true", default=None,
                    help="share the ports with other gateway processes on this host (SO_REUSEPORT)")
    gw.add_argument("--trace-file", type=Path, default=None, help="where this process writes traces")
    gw.add_argument("--gateway-id", default=None, help="this gateway's id (its reply stream; default: made up)")
    gw.add_argument("--shared-memory-dir", type=Path, default=None,
                    help="share system shared-memory registrations with this host's other gateways through it "
                         "(with --processes: where their own directory is made)")
    gw.add_argument("--processes", dest="gateways", type=_positive, default=None,
                    help="run N gateway processes on these ports, supervised (SO_REUSEPORT; env FLEET_GATEWAYS; "
                         "default 1)")
    grpc_flags.add_arguments(gw)

    wk = sub.add_parser("worker", help="run one worker process")
    _common(wk)
    wk.add_argument("--device", default="cpu", help="cpu or cuda:N")
    wk.add_argument("--worker-id", default=None)

    jw = sub.add_parser("jobs-worker", help="run one RQ worker for bulk jobs")
    _common(jw)

    dl = sub.add_parser("dead-letters", help="list a model's dead-letter stream (and --replay it)")
    _common(dl)
    dl.add_argument("model")
    dl.add_argument("--replay", action="store_true", help="queue every readable dead letter again")

    client_args.add_job_commands(sub)  # submit, jobs, job, cancel: HTTP clients of a gateway, no Settings
    client_args.add_analyze(sub)  # analyze: an HTTP client of a gateway too
    client_args.add_status(sub)  # status: polls a gateway's /v2/fleet/status
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Environment first, then whatever the command line set explicitly."""
    overrides: dict[str, Any] = {}
    if args.model_repository:
        overrides["model_repositories"] = tuple(args.model_repository)
    if args.redis_url:
        overrides["redis_url"] = args.redis_url
    if args.log_verbose is not None:
        overrides["log_verbose"] = args.log_verbose
    if getattr(args, "log_format", None) is not None:
        overrides["log_format"] = args.log_format
    if args.key_prefix:
        overrides["key_prefix"] = args.key_prefix
    if args.jobs_dir:
        overrides["jobs_dir"] = args.jobs_dir
    if getattr(args, "rate_limit", None):
        overrides["rate_limit"] = args.rate_limit
    if getattr(args, "rate_limit_resource", None):
        overrides["rate_limit_resources"] = tuple(args.rate_limit_resource)
    if getattr(args, "cache_config", None):
        overrides["cache_config"] = args.cache_config
    if getattr(args, "model_control_mode", None):
        overrides["model_control_mode"] = args.model_control_mode
    if getattr(args, "load_model", None):
        overrides["load_models"] = tuple(args.load_model)
    if getattr(args, "repository_poll_secs", None) is not None:
        overrides["repository_poll_secs"] = args.repository_poll_secs
    if getattr(args, "strict_model_config", None):
        overrides["auto_complete_config"] = False
    if getattr(args, "job_workers", None) is not None:
        overrides["job_workers"] = args.job_workers
    for flag, field in (("http_port", "http_port"), ("metrics_port", "metrics_port"),
                        ("http_address", "http_host"), ("worker_id", "worker_id"), ("gateways", "gateways"),
                        ("reuse_port", "reuse_port"), ("trace_file", "trace_file"),
                        ("shared_memory_dir", "shared_memory_dir"), ("gateway_id", "gateway_id")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[field] = value
    overrides |= grpc_flags.overrides(args)
    return Settings(**overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Each command's module is imported only to run it: a server process keeps what it imports (client_args).
    if args.command in client_args.JOB_COMMANDS:
        from fleet import job_client

        return job_client.run(args)
    if args.command == "analyze":
        from fleet.analyzer import run as analyzer

        return analyzer.run(args)
    if args.command == "status":
        from fleet import status_cli

        return status_cli.run(args)
    settings = settings_from_args(args)
    if args.command == "up":
        from fleet.launcher import run_up

        return run_up(settings, workers=args.workers, data_dir=args.data_dir)
    if args.command == "gateway" and settings.gateways > 1:
        from fleet.launcher import run_gateways

        return run_gateways(settings)
    if args.command == "gateway":
        from gateway.server import serve

        return serve(settings)
    if args.command == "dead-letters":
        from fleet.dead_letters import run as run_dead_letters

        return run_dead_letters(args.model, settings.redis_url_or_default, settings.key_prefix, args.replay)
    if args.command == "jobs-worker":
        from fleet.jobs.worker import serve as serve_jobs

        return serve_jobs(settings)
    from workers.main import serve as serve_worker

    return serve_worker(settings, device=args.device)


if __name__ == "__main__":
    sys.exit(main())
