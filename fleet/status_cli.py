"""`fleet status`: a live terminal view of a running fleet (rich), polling a gateway's
`/v2/fleet/status` every --interval seconds; `--once` prints one frame and exits (for scripts).

    render(snapshot, url)   pure: the frame (fleet/status_format.py's tables, coloured by tone)
    fetch(client, url, ...) one poll; every failure becomes StatusFetchError
    run(args)               the driver: rich.live.Live until Ctrl-C

Exit codes: 0 (--once printed a frame; Ctrl-C ends the live view), 2 the gateway could not be read with
--once. The live view rides out an unreachable gateway, saying so in place of the frame.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table as RichTable
from rich.text import Text

from fleet.job_client import EXIT_OK, EXIT_USAGE, resolve_url
from fleet.status_format import Table, Tone, clock, summary, tables
from fleet.status_snapshot import Snapshot, from_json

STATUS_PATH = "/v2/fleet/status"
_STYLES = {Tone.PLAIN: "", Tone.OK: "bold green", Tone.WARN: "bold yellow", Tone.BAD: "bold red", Tone.MUTED: "dim"}


class StatusFetchError(Exception):
    """The gateway could not be reached, answered an error, or sent something that is not a status."""


def _table(table: Table) -> RenderableType:
    if not table.rows:
        return Text.assemble((table.title, "bold"), "\n", (table.empty, "dim"), "\n")
    out = RichTable(title=table.title, title_justify="left", title_style="bold", expand=False)
    for i, column in enumerate(table.columns):
        numeric = i in table.numeric
        out.add_column(column, justify="right" if numeric else "left", no_wrap=numeric, overflow="fold")
    for row in table.rows:
        out.add_row(*(Text(cell.text, style=_STYLES[cell.tone]) for cell in row))
    return out


def render(snapshot: Snapshot, url: str) -> RenderableType:
    """One frame: a headline (time, gateway, the summary figures), then workers, models and jobs."""
    figures = "   ".join(f"{label} {value}" for label, value in summary(snapshot))
    head = Text.assemble(("fleet status", "bold"), f"  {url}  {clock(snapshot.at_ms)}\n", figures)
    return Group(head, *(_table(t) for t in tables(snapshot)))


def fetch(client: httpx.Client, url: str, headers: Mapping[str, str]) -> Snapshot:
    try:
        response = client.get(url.rstrip("/") + STATUS_PATH, headers=dict(headers))
    except httpx.HTTPError as exc:
        raise StatusFetchError(f"cannot reach the gateway at {url}: {exc}") from exc
    if response.status_code != 200:
        raise StatusFetchError(f"the gateway at {url} answered HTTP {response.status_code}: {response.text.strip()}")
    try:
        return from_json(response.json())
    except (ValueError, KeyError, TypeError) as exc:
        raise StatusFetchError(f"the gateway at {url} sent no status document: {exc}") from exc


def _live(client: httpx.Client, url: str, headers: Mapping[str, str], interval_s: float, console: Console,
          sleep: Callable[[float], None]) -> None:
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            try:
                frame: RenderableType = render(fetch(client, url, headers), url)
            except StatusFetchError as exc:
                frame = Text(f"{exc}\nretrying every {interval_s:g} s (Ctrl-C to stop)", style="bold red")
            live.update(frame, refresh=True)
            sleep(interval_s)


def run(args: argparse.Namespace, *, environ: Mapping[str, str] = os.environ, client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep, console: Console | None = None) -> int:
    """Run `fleet status` parsed by fleet.cli.build_parser(); returns the process exit code."""
    url = resolve_url(args.url, environ)
    key = args.api_key or environ.get("FLEET_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out = console or Console(file=sys.stdout, highlight=False)
    http = client or httpx.Client(timeout=httpx.Timeout(10.0))
    try:
        if args.once:
            try:
                out.print(render(fetch(http, url, headers), url))
            except StatusFetchError as exc:
                Console(file=sys.stderr, markup=False, highlight=False).print(f"error: {exc}")
                return EXIT_USAGE
            return EXIT_OK
        _live(http, url, headers, max(0.1, args.interval), out, sleep)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        if client is None:
            http.close()
    return EXIT_OK
