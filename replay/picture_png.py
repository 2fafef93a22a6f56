"""A ``Picture`` as a PNG (matplotlib, Agg): the same rows, colours and marks as ``picture_html``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_bus.replay.picture import BatchMark, Picture, Span
from rollout_bus.replay.picture_html import (
    MARK_COLOUR,
    STALENESS_COLOURS,
    STATE_COLOURS,
    UNKNOWN_COLOUR,
    staleness_colour,
)

Draw = Callable[[Any, float], None]


def _rows(pic: Picture, sec: Callable[[int], float]) -> list[tuple[str, Draw]]:
    """(label, draw(ax, y)) per row, top to bottom."""
    width = max(sec(pic.end_ms), 1e-3)

    def spans(items: list[Span], colours: dict[str, str] | None) -> Draw:
        def draw(ax: Any, y: float) -> None:
            for i, s in enumerate(items):
                x0, dx = sec(s.start_ms), max(sec(s.end_ms) - sec(s.start_ms), width / 2000)
                colour = colours.get(s.value, "#ffffff") if colours else ("#dadaeb" if i % 2 else "#efedf5")
                ax.broken_barh([(x0, dx)], (y - 0.35, 0.7), facecolors=colour)
                if colours is None and dx > width * 0.012 * len(s.value):
                    ax.text(x0 + dx / 2, y, s.value, ha="center", va="center", fontsize=7)
        return draw

    def marks(xs: list[float], marker: str, dy: float = 0.0) -> Draw:
        def draw(ax: Any, y: float) -> None:
            if xs:
                ax.scatter(xs, [y + dy] * len(xs), marker=marker, color=MARK_COLOUR, s=45, zorder=3, linewidths=2)
        return draw

    def both(*draws: Draw) -> Draw:
        def draw(ax: Any, y: float) -> None:
            for d in draws:
                d(ax, y)
        return draw

    def ticks(xs: list[float]) -> Draw:
        return lambda ax, y: ax.vlines(xs, y - 0.25, y + 0.25, color="#525252", linewidth=0.8)

    def dots(batches: list[BatchMark]) -> Draw:
        def draw(ax: Any, y: float) -> None:
            if batches:
                edge = [staleness_colour(b.staleness) for b in batches]
                face = ["#ffffff" if b.trained is False else c for b, c in zip(batches, edge, strict=True)]
                ax.scatter([sec(b.ms) for b in batches], [y] * len(batches), c=face, edgecolors=edge, s=30,
                           linewidths=1.2, zorder=3)
        return draw

    rows: list[tuple[str, Draw]] = []
    for lane in pic.lanes:
        restarts = [sec(m.ms) for m in pic.restarts if (m.kind, m.subject) == ("engine", lane.engine_id)]
        rows.append((lane.engine_id, both(spans(lane.states, STATE_COLOURS), marks(restarts, "v", 0.45))))
        rows += [(f"  {policy} version", spans(items, None)) for policy, items in lane.versions.items()]
    for policy in pic.policies:
        serving = pic.serving.get(policy, [])
        items = [Span(ms, serving[i + 1][0] if i + 1 < len(serving) else pic.end_ms, str(v))
                 for i, (ms, v) in enumerate(serving)]
        rows.append((f"{policy} serving", spans(items, None)))
        rows.append((f"{policy} batches", dots([b for b in pic.batches if b.policy == policy])))
    for trainer, steps in sorted(pic.steps.items()):
        restarts = [sec(m.ms) for m in pic.restarts if (m.kind, m.subject) == ("trainer", trainer)]
        rows.append((trainer, both(ticks([sec(ms) for ms, _ in steps]), marks(restarts, "v", 0.45))))
    if pic.turns:
        rows.append((f"session turns ({len(pic.turns)})",
                     both(marks([sec(m.ms) for m in pic.turns if m.kind == "engine"], "o"),
                          marks([sec(m.ms) for m in pic.turns if m.kind == "journal"], "s"))))
    if pic.scalings:
        rows.append((f"scaling ({len(pic.scalings)})", marks([sec(m.ms) for m in pic.scalings], "D")))
    rows.append((f"dead letters ({len(pic.dead_letters)})", marks([sec(m.ms) for m in pic.dead_letters], "x")))
    return rows


def write_png(pic: Picture, path: str | Path, *, title: str = "rollout-bus timeline") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def sec(ms: int) -> float:
        return (ms - pic.start_ms) / 1000

    rows = _rows(pic, sec)
    height = 1.7 + 0.38 * len(rows)  # inches: title and axis, the rows, the legend
    fig, ax = plt.subplots(figsize=(14, height))
    fig.subplots_adjust(left=0.11, right=0.98, top=1 - 0.45 / height, bottom=1.15 / height)
    for i, (_, draw) in enumerate(rows):
        draw(ax, float(len(rows) - i))
    ax.set_yticks([len(rows) - i for i in range(len(rows))], [label for label, _ in rows], fontsize=8)
    ax.set_ylim(0.3, len(rows) + 0.9)
    ax.set_xlim(0, max(sec(pic.end_ms), 1e-3) * 1.01)
    ax.set_xlabel("seconds since the first event")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{title}: {pic.counts()}", fontsize=10)
    handles: list[Any] = [Patch(color=c, label=s) for s, c in STATE_COLOURS.items() if s != "unknown"]
    handles += [Line2D([], [], marker="o", linestyle="", color=c, label=f"staleness {k}{'+' if k == len(STALENESS_COLOURS) - 1 else ''}")
                for k, c in enumerate(STALENESS_COLOURS)]
    handles += [Line2D([], [], marker="o", linestyle="", color=UNKNOWN_COLOUR, label="staleness unknown"),
                Line2D([], [], marker="o", linestyle="", markerfacecolor="#ffffff",
                       markeredgecolor=STALENESS_COLOURS[1], label="not trained"),
                Line2D([], [], marker="v", linestyle="", color=MARK_COLOUR, label="restart"),
                Line2D([], [], marker="x", linestyle="", color=MARK_COLOUR, label="dead letter")]
    fig.legend(handles=handles, loc="lower center", ncol=8, fontsize=7, frameon=False)
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
