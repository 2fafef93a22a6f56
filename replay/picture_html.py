"""A ``Picture`` as one self-contained HTML page: an inline SVG, hover titles, the data as JSON.

No script, stylesheet or font is fetched: the page opens anywhere, offline. Rows, top to
bottom: each engine's lane (states as coloured spans, under them the weight version it
had of each policy, restarts as red triangles), each policy's serving version and its
batches (dots at the time each was ready, coloured by staleness; hollow when a trainer
took it and did not train it), each trainer's steps (ticks; restarts as red triangles),
the dead letters (red crosses) and the pools' scale commands (diamonds; their outcome on hover). Every mark has a ``<title>`` (shown on hover) and the
page embeds ``Picture.to_dict()`` in ``<script type="application/json" id="timeline-data">``.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

from rollout_bus.replay.picture import Mark, Picture, Span

STATE_COLOURS = {
    "launching": "#9ecae1", "pending_weights": "#c6dbef", "serving": "#31a354", "unhealthy": "#e6550d",
    "restarting": "#fd8d3c", "offloaded": "#bcbddc", "draining": "#fdd0a2", "stopped": "#bdbdbd", "unknown": "#f0f0f0",
}
STALENESS_COLOURS = ["#1a9850", "#f0a30a", "#d7301f", "#67000d"]
"""0, 1, 2 and 3 or more versions behind."""
UNKNOWN_COLOUR = "#969696"
MARK_COLOUR = "#cb181d"
LEFT, PLOT_W, ROW_H, TOP = 190, 1100, 30, 40


def staleness_colour(staleness: int | None) -> str:
    return UNKNOWN_COLOUR if staleness is None else STALENESS_COLOURS[min(staleness, len(STALENESS_COLOURS) - 1)]


class _Canvas:
    def __init__(self, pic: Picture) -> None:
        self.pic = pic
        self.span_ms = max(pic.end_ms - pic.start_ms, 1)
        self.parts: list[str] = []
        self.y = TOP

    def x(self, ms: int) -> float:
        return LEFT + PLOT_W * (ms - self.pic.start_ms) / self.span_ms

    def label(self, text: str, y: float, *, bold: bool = False) -> None:
        weight = ' font-weight="bold"' if bold else ""
        self.parts.append(f'<text x="{LEFT - 8}" y="{y:.1f}" text-anchor="end" class="label"{weight}>'
                          f"{escape(text)}</text>")

    def spans(self, spans: list[Span], y: float, h: float, cls: str, *, colours: dict[str, str] | None = None,
              prefix: str = "") -> None:
        for i, span in enumerate(spans):
            x0, x1 = self.x(span.start_ms), self.x(span.end_ms)
            fill = colours.get(span.value, "#ffffff") if colours else ("#dadaeb" if i % 2 else "#efedf5")
            title = f"{prefix}{span.value}: {self.t(span.start_ms)} to {self.t(span.end_ms)}"
            self.parts.append(f'<rect class="{cls}" x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0, 0.8):.1f}" '
                              f'height="{h}" fill="{fill}"><title>{escape(title)}</title></rect>')
            if colours is None and x1 - x0 > 7 * len(span.value) + 6:
                self.parts.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y + h - 3:.1f}" text-anchor="middle" '
                                  f'class="small">{escape(span.value)}</text>')

    def triangle(self, mark: Mark, y: float, cls: str) -> None:
        x = self.x(mark.ms)
        title = f"{mark.kind} restart of {mark.subject} at {self.t(mark.ms)}: {mark.detail}"
        self.parts.append(f'<path class="{cls}" d="M{x - 5:.1f},{y:.1f} L{x + 5:.1f},{y:.1f} L{x:.1f},{y + 8:.1f} Z" '
                          f'fill="{MARK_COLOUR}"><title>{escape(title)}</title></path>')

    def t(self, ms: int) -> str:
        return f"{(ms - self.pic.start_ms) / 1000:.3f}s"


def _axis(c: _Canvas) -> None:
    seconds = c.span_ms / 1000
    step = 10 ** math.floor(math.log10(max(seconds, 1e-3))) / 10
    for nice in (1, 2, 5, 10):  # the finest of these steps that gives at most 12 ticks
        if seconds / (step * nice) <= 12:
            step *= nice
            break
    tick = 0.0
    while tick <= seconds + 1e-9:
        x = c.x(c.pic.start_ms + round(tick * 1000))
        c.parts.append(f'<line x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{c.y}" class="grid"/>')
        c.parts.append(f'<text x="{x:.1f}" y="{TOP - 10}" text-anchor="middle" class="small">{tick:g}s</text>')
        tick += step


def _rows(c: _Canvas) -> None:
    pic = c.pic
    restarts: dict[tuple[str, str], list[Mark]] = {}
    for mark in pic.restarts:
        restarts.setdefault((mark.kind, mark.subject), []).append(mark)
    for lane in pic.lanes:
        c.label(lane.engine_id, c.y + 13, bold=True)
        c.spans(lane.states, c.y, 16, "state", colours=STATE_COLOURS)
        for mark in restarts.get(("engine", lane.engine_id), []):
            c.triangle(mark, c.y - 4, "restart")
        c.y += 18
        for policy, spans in lane.versions.items():
            c.label(f"{policy} version", c.y + 11)
            c.spans(spans, c.y, 13, "version", prefix=f"{lane.engine_id} has {policy} v")
            c.y += 15
        c.y += 10
    for policy in pic.policies:
        c.label(f"{policy} serving", c.y + 11, bold=True)
        serving = [Span(ms, pic.serving[policy][i + 1][0] if i + 1 < len(pic.serving[policy]) else pic.end_ms,
                        str(v)) for i, (ms, v) in enumerate(pic.serving.get(policy, []))]
        c.spans(serving, c.y, 13, "serving", prefix=f"{policy} serving v")
        c.y += 32
        c.label(f"{policy} batches", c.y + 4, bold=True)
        for b in (b for b in pic.batches if b.policy == policy):
            colour = staleness_colour(b.staleness)
            fill = "#ffffff" if b.trained is False else colour
            outcome = {True: "trained", False: "not trained", None: "not taken"}[b.trained]
            title = (f"batch {b.batch_id} (rollout {b.rollout_id}, {b.n_samples} samples) ready at {c.t(b.ms)}: "
                     f"staleness {b.staleness if b.staleness is not None else '?'} ({b.staleness_source}), {outcome}")
            c.parts.append(f'<circle class="batch" cx="{c.x(b.ms):.1f}" cy="{c.y:.1f}" r="4.5" fill="{fill}" '
                           f'stroke="{colour}" stroke-width="1.5"><title>{escape(title)}</title></circle>')
        c.y += ROW_H
    for trainer, steps in sorted(pic.steps.items()):
        c.label(trainer, c.y + 4, bold=True)
        for ms, step in steps:
            c.parts.append(f'<line class="step" x1="{c.x(ms):.1f}" y1="{c.y - 6:.1f}" x2="{c.x(ms):.1f}" '
                           f'y2="{c.y + 6:.1f}"><title>step {step} at {c.t(ms)}</title></line>')
        for mark in restarts.get(("trainer", trainer), []):
            c.triangle(mark, c.y - 14, "restart")
        c.y += ROW_H
    if pic.turns:
        c.label(f"session turns ({len(pic.turns)})", c.y + 4, bold=True)
        for mark in pic.turns:  # hollow: answered from the journal (a retried episode)
            title = f"session {mark.subject} at {c.t(mark.ms)}: {mark.detail}" + (
                " (from the journal)" if mark.kind == "journal" else "")
            fill = "#ffffff" if mark.kind == "journal" else "#6a51a3"
            c.parts.append(f'<circle class="turn" cx="{c.x(mark.ms):.1f}" cy="{c.y:.1f}" r="3" fill="{fill}" '
                           f'stroke="#6a51a3"><title>{escape(title)}</title></circle>')
        for mark in pic.sessions_closed:
            title = f"session {mark.subject} at {c.t(mark.ms)}: {mark.detail}"
            colour = "#6a51a3" if mark.kind == "closed" else MARK_COLOUR
            c.parts.append(f'<line class="session-end" x1="{c.x(mark.ms):.1f}" y1="{c.y - 7:.1f}" '
                           f'x2="{c.x(mark.ms):.1f}" y2="{c.y + 7:.1f}" stroke="{colour}">'
                           f'<title>{escape(title)}</title></line>')
        c.y += ROW_H
    if pic.scalings:
        c.label(f"scaling ({len(pic.scalings)})", c.y + 4, bold=True)
        for mark in pic.scalings:
            x, y = c.x(mark.ms), c.y
            title = f"scale {mark.subject} at {c.t(mark.ms)}: {mark.detail}"
            c.parts.append(f'<path class="scale" d="M{x:.1f},{y - 6:.1f} L{x + 6:.1f},{y:.1f} L{x:.1f},{y + 6:.1f} '
                           f'L{x - 6:.1f},{y:.1f} Z" fill="#3182bd"><title>{escape(title)}</title></path>')
        c.y += ROW_H
    c.label(f"dead letters ({len(pic.dead_letters)})", c.y + 4, bold=True)
    for mark in pic.dead_letters:
        x, y = c.x(mark.ms), c.y
        title = f"dead letter at {c.t(mark.ms)} from {mark.kind} entry {mark.subject}: {mark.detail}"
        c.parts.append(f'<path class="dead-letter" d="M{x - 5:.1f},{y - 5:.1f} L{x + 5:.1f},{y + 5:.1f} '
                       f'M{x - 5:.1f},{y + 5:.1f} L{x + 5:.1f},{y - 5:.1f}" stroke="{MARK_COLOUR}" '
                       f'stroke-width="2.5"><title>{escape(title)}</title></path>')
    c.y += ROW_H


def _swatch(kind: str, colour: str, x: float, y: float) -> str:
    """A legend symbol whose baseline is ``y``."""
    if kind == "rect":
        return f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colour}"/>'
    if kind == "dot":
        return f'<circle cx="{x + 6}" cy="{y - 4}" r="5" fill="{colour}"/>'
    if kind == "hollow":
        return f'<circle cx="{x + 6}" cy="{y - 4}" r="5" fill="#ffffff" stroke="{colour}" stroke-width="1.5"/>'
    if kind == "triangle":
        return f'<path d="M{x + 1},{y - 9} L{x + 11},{y - 9} L{x + 6},{y - 1} Z" fill="{colour}"/>'
    return (f'<path d="M{x + 1},{y - 9} L{x + 11},{y + 1} M{x + 1},{y + 1} L{x + 11},{y - 9}" stroke="{colour}" '
            f'stroke-width="2.5"/>')


def _legend(c: _Canvas) -> None:
    items = [("rect", colour, state) for state, colour in STATE_COLOURS.items() if state != "unknown"]
    items += [("dot", colour, f"staleness {k}{'+' if k == len(STALENESS_COLOURS) - 1 else ''}")
              for k, colour in enumerate(STALENESS_COLOURS)]
    items += [("dot", UNKNOWN_COLOUR, "staleness unknown"), ("hollow", STALENESS_COLOURS[1], "not trained"),
              ("triangle", MARK_COLOUR, "restart"), ("cross", MARK_COLOUR, "dead letter")]
    x, y = LEFT, c.y + 14
    for kind, colour, text in items:
        width = 24 + 6 * len(text)
        if x + width > LEFT + PLOT_W:
            x, y = LEFT, y + 18
        c.parts.append(_swatch(kind, colour, x, y))
        c.parts.append(f'<text x="{x + 16}" y="{y}" class="small">{escape(text)}</text>')
        x += width
    c.y = y + 8


def render_html(pic: Picture, *, title: str = "rollout-bus timeline") -> str:
    """The page (a string); see the module docstring for what it shows."""
    c = _Canvas(pic)
    body_parts: list[str] = []
    c.parts = body_parts
    _rows(c)
    rows_bottom = c.y
    grid: list[str] = []
    c.parts = grid
    c.y = rows_bottom
    _axis(c)
    legend: list[str] = []
    c.parts = legend
    c.y = rows_bottom
    _legend(c)
    height = c.y + 10
    data = json.dumps(pic.to_dict(), sort_keys=True).replace("<", "\\u003c")  # no markup in the data block
    summary = f"{pic.events} events over {(pic.end_ms - pic.start_ms) / 1000:.3g}s: {pic.counts()}"
    svg = "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + PLOT_W + 20}" height="{height}" '
        f'viewBox="0 0 {LEFT + PLOT_W + 20} {height}" role="img" aria-label="{escape(title)}">',
        "<style>.label{font:12px sans-serif;fill:#222}.small{font:10px sans-serif;fill:#333}"
        ".grid{stroke:#e0e0e0;stroke-width:1}.step{stroke:#525252;stroke-width:1}</style>",
        *grid, *body_parts, *legend, "</svg>"])
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:16px;color:#222}p{margin:4px 0 12px}</style></head><body>",
        f"<h2>{escape(title)}</h2>", f"<p>{escape(summary)}. Hover any mark for its details.</p>", svg,
        f'<script type="application/json" id="timeline-data">{data}</script>', "</body></html>", ""])


def write_html(pic: Picture, path: str | Path, *, title: str = "rollout-bus timeline") -> Path:
    path = Path(path)
    path.write_text(render_html(pic, title=title), encoding="utf-8")
    return path
