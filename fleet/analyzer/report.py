"""`fleet analyze`'s output: the table, a terminal chart and an SVG plot (pure: measurements in, text out)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from rich.console import Group
from rich.table import Table
from rich.text import Text

from fleet.analyzer.sweep import Measurement, points_of, scores

BAR_WIDTH = 40


def table(measurements: Sequence[Measurement], chosen: Measurement | None, budget_ms: float | None) -> Table:
    t = Table(title="fleet analyze: every point, every concurrency")
    for name in ("#", "config", "C", "infer/s", "p50 ms", "p99 ms", "mean batch", "errors", ""):
        t.add_column(name, justify="left" if name == "config" else "right")
    order = points_of(measurements)
    for m in measurements:
        over = budget_ms is not None and m.p99_ms > budget_ms
        mark = "best" if m == chosen else ("over budget" if over else "")
        style = "bold green" if m == chosen else ("dim" if over or m.errors else "")
        t.add_row(str(order.index(m.point) + 1), m.point.label(), str(m.concurrency), f"{m.infer_s:,.0f}",
                  f"{m.p50_ms:.2f}", f"{m.p99_ms:.2f}", f"{m.mean_batch:.2f}", str(m.errors), mark, style=style)
    return t


def chart(measurements: Sequence[Measurement], budget_ms: float | None) -> Group:
    """One bar per point: its best throughput within the budget (none: no bar)."""
    tops = scores(measurements, budget_ms)
    peak = max((t.infer_s for _, t in tops if t is not None), default=0.0) or 1.0
    within = f"p99 <= {budget_ms:g} ms" if budget_ms is not None else "no latency budget"
    lines = [Text(f"best infer/s per config ({within})", style="bold")]
    for i, (point, top) in enumerate(tops, 1):
        line = Text(f"{i:>3} ")
        if top is None:
            line.append("(nothing within the budget)", style="dim")
        else:
            n = max(1, round(BAR_WIDTH * top.infer_s / peak))
            line.append("█" * n, style="green" if top.infer_s == peak else "cyan")
            line.append(f" {top.infer_s:,.0f}/s at C={top.concurrency}, p99 {top.p99_ms:.1f} ms")
        line.append(f"  {point.label()}", style="dim")
        lines.append(line)
    return Group(*lines)


def svg(measurements: Sequence[Measurement], budget_ms: float | None, title: str) -> str:
    """Throughput against p99, one line per config through its concurrencies (Model Analyzer's
    throughput-vs-latency plot), the budget as a vertical line."""
    w, h, left, bottom, top, right = 760, 460, 70, 50, 40, 230
    xs = [m.p99_ms for m in measurements] + ([budget_ms] if budget_ms else [])
    ys = [m.infer_s for m in measurements]
    xmax, ymax = (max(xs) if xs else 1.0) * 1.1 or 1.0, (max(ys) if ys else 1.0) * 1.1 or 1.0

    def x(v: float) -> float:
        return left + (w - left - right) * v / xmax

    def y(v: float) -> float:
        return h - bottom - (h - top - bottom) * v / ymax

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
              "#17becf"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{escape(title)}</text>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
           f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">p99 latency (ms)</text>',
           f'<text x="16" y="{(top + h - bottom) / 2}" transform="rotate(-90 16 {(top + h - bottom) / 2})" '
           'text-anchor="middle">throughput (infer/s)</text>']
    for i in range(6):
        xv, yv = xmax * i / 5, ymax * i / 5
        out.append(f'<text x="{x(xv):.1f}" y="{h - bottom + 16}" text-anchor="middle">{xv:.1f}</text>')
        out.append(f'<text x="{left - 6}" y="{y(yv) + 4:.1f}" text-anchor="end">{yv:,.0f}</text>')
    if budget_ms:
        out.append(f'<line x1="{x(budget_ms):.1f}" y1="{top}" x2="{x(budget_ms):.1f}" y2="{h - bottom}" '
                   'stroke="red" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x(budget_ms) + 4:.1f}" y="{top + 12}" fill="red">budget {budget_ms:g} ms</text>')
    for i, point in enumerate(points_of(measurements)):
        color = colors[i % len(colors)]
        rows = sorted((m for m in measurements if m.point == point), key=lambda m: m.concurrency)
        path = " ".join(f"{x(m.p99_ms):.1f},{y(m.infer_s):.1f}" for m in rows)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for m in rows:
            out.append(f'<circle cx="{x(m.p99_ms):.1f}" cy="{y(m.infer_s):.1f}" r="3" fill="{color}">'
                       f'<title>C={m.concurrency}: {m.infer_s:,.0f}/s, p99 {m.p99_ms:.2f} ms</title></circle>')
        ly = top + 16 * i
        out.append(f'<rect x="{w - right + 10}" y="{ly}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{w - right + 26}" y="{ly + 9}">{i + 1}: {escape(point.label())}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
