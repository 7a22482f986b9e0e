"""The status page's HTML: plain server-rendered markup and inline CSS (no script, no build step), which
reloads itself every REFRESH_S seconds. Every text from the fleet (model names, job ids, worker ids,
error messages) is HTML-escaped here. Pure: fleet/status_format.py says what the tables hold."""

from __future__ import annotations

from html import escape

from fleet.status_format import Table, Tone, clock, summary, tables
from fleet.status_snapshot import Snapshot

REFRESH_S = 2

_CSS = """
:root { --fg: #1f2933; --muted: #7b8794; --line: #e4e7eb; --bg: #f5f7fa; --ok: #0e7c3a; --warn: #a15c00;
        --bad: #c81e1e; }
* { box-sizing: border-box; }
body { margin: 0; padding: 24px 32px; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
       color: var(--fg); background: var(--bg); }
header { display: flex; align-items: baseline; gap: 16px; margin-bottom: 16px; }
h1 { font-size: 22px; margin: 0; }
header .meta { color: var(--muted); }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin-bottom: 20px; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 10px 16px; min-width: 120px; }
.card .value { font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; }
.card .label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
section { background: #fff; border: 1px solid var(--line); border-radius: 8px; margin-bottom: 20px;
          overflow-x: auto; }
h2 { font-size: 15px; margin: 0; padding: 10px 14px; border-bottom: 1px solid var(--line); }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 6px 14px; text-align: left; vertical-align: top; border-bottom: 1px solid var(--line); }
th { font-size: 12px; color: var(--muted); font-weight: 600; white-space: nowrap; }
tr:last-child td { border-bottom: none; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.wrap { max-width: 420px; }
.empty { padding: 10px 14px; color: var(--muted); }
.ok { color: var(--ok); font-weight: 600; } .warn { color: var(--warn); font-weight: 600; }
.bad { color: var(--bad); font-weight: 600; } .muted { color: var(--muted); }
.error { background: #fde8e8; border: 1px solid #f8b4b4; color: var(--bad); border-radius: 8px; padding: 12px 16px; }
"""


def _table(table: Table) -> str:
    head = "".join(f'<th{" class=num" if i in table.numeric else ""}>{escape(c)}</th>'
                   for i, c in enumerate(table.columns))
    if not table.rows:
        body = f'<div class="empty">{escape(table.empty)}</div>'
    else:
        rows = []
        for row in table.rows:
            cells = []
            for i, cell in enumerate(row):
                classes = [c for c in ("num" if i in table.numeric else "wrap",
                                       "" if cell.tone is Tone.PLAIN else cell.tone.value) if c]
                cells.append(f'<td class="{" ".join(classes)}">{escape(cell.text)}</td>')
            rows.append(f"<tr>{''.join(cells)}</tr>")
        body = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    slug = table.title.split(" ", 1)[0].lower()
    return f'<section id="{slug}"><h2>{escape(table.title)}</h2>{body}</section>'


def render_page(snapshot: Snapshot | None, gateway_id: str, error: str = "") -> str:
    """The whole page; with no snapshot (Redis unreachable), the error and nothing else."""
    if snapshot is None:
        meta, content = "", f'<div class="error">{escape(error or "the status cannot be read")}</div>'
    else:
        meta = f"{clock(snapshot.at_ms)} · gateway {gateway_id}"
        cards = "".join(f'<div class="card"><div class="value">{escape(value)}</div>'
                        f'<div class="label">{escape(label)}</div></div>' for label, value in summary(snapshot))
        content = f'<div class="cards">{cards}</div>' + "".join(_table(t) for t in tables(snapshot))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="refresh" content="{REFRESH_S}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>fleet status</title><style>{_CSS}</style></head><body>"
            f'<header><h1>fleet</h1><span class="meta">{escape(meta)}</span></header>{content}</body></html>')
