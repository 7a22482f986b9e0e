"""`fleet analyze MODEL`: Triton's Model Analyzer, against a running fleet (the CLI driver).

For each point of the sweep (fleet/analyzer/sweep.py) the model is loaded with that config through the
repository extension (`POST /v2/repository/models/M/load` with a `config` override: the gateway must run in
explicit model-control mode with the control API on, as Model Analyzer's remote mode needs), then measured at
each concurrency (fleet/analyzer/load.py), the mean batch from the statistics extension around each window.
It says up front how many points and about how long, shows progress, prints the table and a chart, names
the best config within --latency-budget-ms, and either loads it (--apply) or loads back the config the model
had (also on Ctrl-C or an error). --write-config FILE writes the best config as config.pbtxt text, for the
repository; --json and --plot (SVG) keep the measurements. The arguments are defined in fleet/client_args.py.

Exit codes: 0 a best config was found, 1 nothing met the budget, 2 usage or server error, 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from fleet.analyzer import sweep
from fleet.analyzer.load import LoadError, http_request, measure, request_body
from fleet.analyzer.report import chart, svg, table
from fleet.client_args import DEFAULT_URL
from fleet.job_client import resolve_url

EXIT_OK, EXIT_NOTHING, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
LOAD_ESTIMATE_S = 3.0  # a model load with a config override, as measured for small models here


class Server:
    """The gateway calls the analyzer makes, through tritonclient (Triton's own HTTP client)."""

    def __init__(self, url: str, headers: Mapping[str, str], load_timeout_s: float = 300.0) -> None:
        import tritonclient.http as th

        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected a gateway URL like {DEFAULT_URL}, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.headers = dict(headers)
        self.client = th.InferenceServerClient(f"{self.host}:{self.port}", network_timeout=load_timeout_s,
                                               connection_timeout=load_timeout_s)

    def config(self, model: str) -> dict[str, Any]:
        return dict(self.client.get_model_config(model, headers=self.headers))

    def metadata(self, model: str) -> dict[str, Any]:
        return dict(self.client.get_model_metadata(model, headers=self.headers))

    def load(self, model: str, config: dict[str, Any]) -> None:
        self.client.load_model(model, headers=self.headers, config=json.dumps(config))

    def counts(self, model: str) -> tuple[int, int]:
        stats = self.client.get_inference_statistics(model, headers=self.headers).get("model_stats", [])
        return (sum(int(s.get("inference_count", 0)) for s in stats),
                sum(int(s.get("execution_count", 0)) for s in stats))

    def close(self) -> None:
        self.client.close()


def _measure_point(server: Server, args: argparse.Namespace, request: bytes, point: sweep.Point,
                   progress: Progress, task: Any) -> list[sweep.Measurement]:
    rows = []
    for c in args.concurrency:
        progress.update(task, description=f"{point.label()}, C={c}")
        before = server.counts(args.model)
        window = measure(server.host, server.port, request, c, args.warmup, args.seconds)
        after = server.counts(args.model)
        executions = after[1] - before[1]
        rows.append(sweep.Measurement(point, c, window.infer_s, window.percentile_ms(50), window.percentile_ms(99),
                                      (after[0] - before[0]) / executions if executions > 0 else 0.0, window.errors))
        if window.errors:
            progress.console.print(f"  {point.label()}, C={c}: {window.errors} errors, first: {window.first_error}")
        progress.advance(task)
    return rows


def run(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    out = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    err = Console(file=sys.stderr, markup=False, highlight=False, soft_wrap=True)
    from tritonclient.utils import InferenceServerException

    key = args.api_key or environ.get("FLEET_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        server = Server(resolve_url(args.url, environ), headers)
    except ValueError as exc:
        err.print(f"error: {exc}")
        return EXIT_USAGE
    original: dict[str, Any] | None = None
    applied = False
    try:
        original = server.config(args.model)
        batching = int(original.get("max_batch_size", 0) or 0) > 0
        delays = args.delays if args.delays is not None else ([0, 100, 1000] if sweep.sweeps_batching(original) else [])
        points = sweep.plan(original, args.instances, delays, args.preferred, args.threads)
        request = http_request(server.host, server.port, args.model,
                               *request_body(server.metadata(args.model), batching, dict(args.shape)), headers)
        total = sweep.estimate_s(len(points), len(args.concurrency), args.seconds, args.warmup, LOAD_ESTIMATE_S)
        out.print(f"fleet analyze {args.model}: {len(points)} configs x {len(args.concurrency)} concurrencies "
                  f"({', '.join(map(str, args.concurrency))}) = {len(points) * len(args.concurrency)} measurements "
                  f"of {args.warmup:g}+{args.seconds:g} s, about {total / 60:.1f} min")
        if args.dry_run:
            for i, p in enumerate(points, 1):
                out.print(f"  {i}: {p.label()}")
            return EXIT_OK
        measurements: list[sweep.Measurement] = []
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=out, transient=True) as progress:
            task = progress.add_task("loading", total=len(points) * len(args.concurrency))
            for point in points:
                progress.update(task, description=f"loading {point.label()}")
                server.load(args.model, sweep.configure(original, point))
                measurements += _measure_point(server, args, request, point, progress, task)
        chosen = sweep.best(measurements, args.latency_budget_ms, args.min_gain / 100)
        out.print(table(measurements, chosen, args.latency_budget_ms))
        out.print(chart(measurements, args.latency_budget_ms))
        if args.json:
            args.json.write_text(json.dumps({"model": args.model, "latency_budget_ms": args.latency_budget_ms,
                                             "measurements": [asdict(m) for m in measurements],
                                             "best": asdict(chosen) if chosen else None}, indent=1) + "\n")
        if args.plot:
            args.plot.write_text(svg(measurements, args.latency_budget_ms, f"fleet analyze {args.model}"))
        if chosen is None:
            out.print(f"no config kept p99 within {args.latency_budget_ms:g} ms with no errors")
            return EXIT_NOTHING
        best_config = sweep.configure(original, chosen.point)
        out.print(f"best: {chosen.point.label()}: {chosen.infer_s:,.0f} infer/s at C={chosen.concurrency}, "
                  f"p99 {chosen.p99_ms:.2f} ms, mean batch {chosen.mean_batch:.2f}")
        if args.write_config:
            args.write_config.write_text(pbtxt(best_config))
            out.print(f"wrote {args.write_config}")
        if args.apply:
            server.load(args.model, best_config)
            applied = True
            out.print(f"loaded the best config into '{args.model}' (a config override, as `load` with config)")
        return EXIT_OK
    except (sweep.SweepError, LoadError) as exc:
        err.print(f"error: {exc}")
        return EXIT_USAGE
    except InferenceServerException as exc:
        hint = (" (fleet analyze loads each config through model control: start the gateway with "
                "--model-control-mode explicit and the control API on)") if "load" in str(exc).lower() else ""
        err.print(f"error: {exc.message() if hasattr(exc, 'message') else exc}{hint}")
        return EXIT_USAGE
    except OSError as exc:
        err.print(f"error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print("\ninterrupted")
        return EXIT_INTERRUPTED
    finally:
        if original is not None and not applied:
            _restore(server, args.model, original, err)
        server.close()


def _restore(server: Server, model: str, original: dict[str, Any], err: Console) -> None:
    """Load the config the model had; the model must not stay at the last point measured."""
    try:
        if server.config(model) != original:
            server.load(model, original)
    except Exception as exc:  # the sweep's own error, if any, is already reported; say this one too
        err.print(f"error: could not load back the original config of '{model}': {exc}")


def pbtxt(config: dict[str, Any]) -> str:
    """The JSON config as config.pbtxt text (Triton's ModelConfig message)."""
    from google.protobuf import json_format, text_format

    from fleet.config_proto import model_config_pb2 as pb

    message = json_format.ParseDict(config, pb.ModelConfig(), ignore_unknown_fields=True)
    return str(text_format.MessageToString(message))

