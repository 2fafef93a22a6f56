"""The timeline picture: its data from a log with planted restarts and dead letters, and its HTML and PNG.

The log is ``test_timeline``'s scenario (two engines, one relaunched, three versions, four
rollouts) plus a trainer that joins again and two dead letters, one with markup in its reason.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.image
import pytest

from rollout_bus.events import schema as s
from rollout_bus.events.consume import dead_letter_fields
from rollout_bus.replay.logfile import LogEntry
from rollout_bus.replay.picture import Picture, picture
from rollout_bus.replay.picture_html import render_html, staleness_colour
from rollout_bus.replay.picture_png import write_png
from tests.unit.test_timeline import CTRL, POLICY, TRAIN, WEIGHTS, Step, scenario

HOSTILE = '<script>alert("x")</script> & more'


def entries_of(steps: list[Step], dead_after: int, start_ms: int = 1_000) -> list[LogEntry]:
    """One entry per millisecond; two dead letters after the first ``dead_after`` steps."""
    out = [LogEntry(stream, f"{start_ms + i}-0", s.encode(ev)) for i, (stream, ev) in enumerate(steps[:dead_after])]
    ms = start_ms + dead_after
    for n, reason in enumerate(("not msgpack: boom", HOSTILE)):
        fields = dead_letter_fields("rb:{t}:stream:rollouts", "executors", "x-0", f"{ms - 5}-{n}",
                                    {b"e": b"\xff"}, reason, 1)
        out.append(LogEntry("dead-letters", f"{ms + n}-0", fields))
    ms += 2
    out += [LogEntry(stream, f"{ms + i}-0", s.encode(ev)) for i, (stream, ev) in enumerate(steps[dead_after:])]
    return out


def planted() -> list[LogEntry]:
    steps = scenario()
    rejoin = ("trainers", s.TrainerJoined(producer=TRAIN, policy=POLICY, trainer_id="t0", group="trainer-p0"))
    steps.insert(len(steps) - 3, rejoin)  # the trainer restarts late in the run
    # the controller names no engine when a newer version supersedes an update: no lane for it
    steps.append((WEIGHTS, s.WeightUpdateFailed(producer=CTRL, policy=POLICY, version=3, engine_id="",
                                                  reason="superseded by version 4")))
    return entries_of(steps, dead_after=len(steps) // 2)


def embedded(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="timeline-data">(.*?)</script>', page, re.S)
    assert found is not None
    return json.loads(found.group(1))


def test_the_picture_has_engine_lanes_versions_batches_restarts_and_dead_letters() -> None:
    log = planted()
    pic = picture(log)
    assert (pic.start_ms, pic.end_ms) == (1_000, 1_000 + len(log) - 1)
    assert [lane.engine_id for lane in pic.lanes] == ["e0", "e1"]
    e1 = pic.lanes[1]
    assert [span.value for span in e1.states] == ["launching", "pending_weights", "serving", "unhealthy",
                                                  "restarting", "launching", "pending_weights", "serving"]
    assert all(a.end_ms == b.start_ms for a, b in zip(e1.states, e1.states[1:], strict=False))
    # v1 until the relaunch, nothing while it launches, v1 again once it has weights, then v2
    versions = e1.versions[POLICY]
    assert [span.value for span in versions] == ["0", "1", "1", "2"]
    relaunch = next(span for span in e1.states[5:] if span.value == "launching")
    assert versions[1].end_ms == relaunch.start_ms < versions[2].start_ms
    assert [(m.kind, m.subject) for m in pic.restarts] == [("engine", "e1"), ("trainer", "t0")]
    assert [m.detail.split(" (")[0] for m in pic.dead_letters] == ["not msgpack: boom", HOSTILE]
    assert all(m.kind == "rb:{t}:stream:rollouts" and "group executors" in m.detail for m in pic.dead_letters)
    assert [(b.batch_id, b.staleness, b.trained) for b in pic.batches] == [
        ("batch-0", 0, True), ("batch-1", 1, True), ("batch-2", 1, None)]
    assert [v for _, v in pic.serving[POLICY]] == [0, 1, 2] and [v for _, v in pic.published[POLICY]] == [1, 2]
    assert [step for _, step in pic.steps["t0"]] == [0, 1]
    assert json.loads(json.dumps(pic.to_dict())) == pic.to_dict()


def test_the_html_page_is_self_contained_escapes_the_log_and_embeds_the_picture_data() -> None:
    pic = picture(planted())
    page = render_html(pic, title="run <1>")
    assert embedded(page) == pic.to_dict()
    assert "<script>alert" not in page and "&lt;script&gt;alert" in page  # the reason is shown, as text
    assert page.count("</script>") == 1  # the data block's own end
    assert "run &lt;1&gt;" in page
    assert not re.search(r'(src|href)=["\']?(https?:)?//', page)  # nothing to fetch
    svg = page[page.index("<svg"):page.index("</svg>")]
    assert svg.count('class="restart"') == 2 and svg.count('class="dead-letter"') == 2
    assert svg.count('class="batch"') == 3 and svg.count('class="step"') == 2
    assert svg.count('class="state"') == sum(len(lane.states) for lane in pic.lanes)
    assert f'fill="{staleness_colour(1)}"' in svg and f'fill="{staleness_colour(0)}"' in svg


def test_the_png_draws_the_same_picture(tmp_path: Path) -> None:
    path = write_png(picture(planted()), tmp_path / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[1] == 1400 and image.shape[0] > 300


@pytest.mark.parametrize("render", ["html", "png"])
def test_an_empty_log_still_draws(render: str, tmp_path: Path) -> None:
    pic = picture([])
    assert pic == Picture()
    if render == "html":
        assert embedded(render_html(pic))["batches"] == []
    else:
        assert write_png(pic, tmp_path / "empty.png").stat().st_size > 0
