"""The pure parts of bench/bench_redis_ceiling.py: commandstats parsing, per-sample costs, the ramp's
stop rule, the fleet arithmetic and the SLOWLOG attribution."""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_redis_ceiling import (  # noqa: E402
    CommandStat,
    attribute,
    core_share,
    fleet,
    parse_commandstats,
    parse_engine_rate,
    parse_proc_cpu,
    parse_steps,
    per_sample_costs,
    projected,
    script_names,
    slowlog_entry,
    stop_reason,
)

INFO_TEXT = """# Commandstats
cmdstat_evalsha:calls=300,usec=6000,usec_per_call=20.00,rejected_calls=0,failed_calls=0
cmdstat_xinfo|stream:calls=2,usec=10,usec_per_call=5.00,rejected_calls=0,failed_calls=0
cmdstat_HSET:calls=1500,usec=2250,usec_per_call=1.50,rejected_calls=0,failed_calls=0
cmdstat_config|resetstat:calls=1,usec=40,usec_per_call=40.00,rejected_calls=0,failed_calls=0
cmdstat_broken:calls=x,usec=1
not a stat line
"""


def test_commandstats_text_gives_calls_and_usec_per_command_subcommands_included() -> None:
    stats = parse_commandstats(INFO_TEXT)
    assert stats == {"evalsha": CommandStat(300, 6000), "xinfo|stream": CommandStat(2, 10),
                     "hset": CommandStat(1500, 2250), "config|resetstat": CommandStat(1, 40)}


def test_commandstats_as_redis_py_parses_it_reads_the_same() -> None:
    parsed = {"cmdstat_evalsha": {"calls": 300, "usec": 6000, "usec_per_call": 20.0},
              "cmdstat_xinfo|stream": {"calls": 2, "usec": 10, "usec_per_call": 5.0},
              "cmdstat_HSET": {"calls": 1500, "usec": 2250, "usec_per_call": 1.5},
              "cmdstat_config|resetstat": {"calls": 1, "usec": 40, "usec_per_call": 40.0}}
    assert parse_commandstats(parsed) == parse_commandstats(INFO_TEXT)


def test_usec_per_sample_is_usec_per_call_times_calls_per_sample_costliest_first() -> None:
    costs = per_sample_costs(parse_commandstats(INFO_TEXT), samples=100)
    assert [c.command for c in costs] == ["evalsha", "hset", "xinfo|stream"]  # the bench's own left out
    evalsha, hset = costs[0], costs[1]
    assert evalsha.calls_per_sample == 3.0 and evalsha.usec_per_call == 20.0 and evalsha.usec_per_sample == 60.0
    assert hset.usec_per_sample == pytest.approx(hset.usec_per_call * hset.calls_per_sample) == 22.5
    assert per_sample_costs(parse_commandstats(INFO_TEXT), samples=0) == []
    assert per_sample_costs({"get": CommandStat(0, 0)}, samples=10) == []


def test_steps_parse_and_never_shrink() -> None:
    assert parse_steps("1:1, 2:1,4:2") == [(1, 1), (2, 1), (4, 2)]
    for bad in ("2", "0:1", "1:0", "2:2,1:2", "2:2,2:1"):
        with pytest.raises(ValueError):
            parse_steps(bad)


def test_the_ramp_stops_when_redis_saturates_or_the_rate_stops_growing() -> None:
    assert stop_reason([100.0], 0.95) is not None and "saturated" in str(stop_reason([100.0], 0.95))
    assert stop_reason([100.0, 180.0, 250.0], 0.3) is None  # still growing
    assert stop_reason([100.0, 180.0, 185.0], 0.3) is None  # one flat step is not yet a plateau
    why = stop_reason([100.0, 180.0, 185.0, 183.0], 0.3)
    assert why is not None and why.startswith("plateau")
    assert stop_reason([100.0, 180.0, 185.0, 200.0], 0.3) is None  # 200 > 180 * 1.05


def test_shares_and_the_projection_to_one_core() -> None:
    assert core_share(ticks=150, hz=100, wall_s=10.0) == 0.15
    assert core_share(ticks=150, hz=100, wall_s=0.0) == 0.0
    assert projected(1500.0, 0.15) == pytest.approx(10_000.0)
    assert projected(1500.0, 0.0) == float("inf")


def test_fleet_arithmetic_is_the_ceiling_over_one_engines_rate_rounded_down_and_shown() -> None:
    lines = fleet(10_000.0, 16, [("cpu", 5.6), ("gpu", 20.0), ("none", 0.0)], "projected")
    assert [ln.engines for ln in lines] == [1785, 500, 0]
    assert lines[1].text == ("projected 10,000 samples/s (625.0 requests/s x 16 samples) / 20.00 samples/s per "
                             "engine = 500 engines  [gpu]")


def test_engine_rate_argument() -> None:
    assert parse_engine_rate("SmolLM2 = CPU=5.6") == ("SmolLM2 = CPU", 5.6)
    for bad in ("5.6", "=5.6"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_engine_rate(bad)


def test_slowlog_time_is_split_by_command_and_by_the_script_each_evalsha_runs() -> None:
    body = "return redis.call('GET', KEYS[1])"
    sha = hashlib.sha1(body.encode()).hexdigest()
    entries = [(10, [b"EVALSHA", sha.encode(), b"1", b"k"]), (30, [b"evalsha", sha.encode(), b"1", b"k"]),
               (5, [b"EVALSHA", b"f" * 40, b"0"]), (2, [b"HSET", b"h", b"f", b"v"]), (3, ["hset", "h", "g", "w"]),
               (7, [b"EVAL", body.encode(), b"1", b"k"]), (99, [b"SLOWLOG", b"GET"]), (1, [])]
    got = attribute(entries, {sha: "mod.SCRIPT"})
    assert got == {"evalsha mod.SCRIPT": (2, 40), "evalsha ffffffff": (1, 5), "hset": (2, 5),
                   "eval mod.SCRIPT": (1, 7)}


def test_slowlog_entries_raw_or_parsed() -> None:
    assert slowlog_entry([1, 1700000000, 12, [b"GET", b"k"], b"127.0.0.1:1", b""]) == (12, [b"GET", b"k"])
    assert slowlog_entry({"id": 1, "duration": 12, "command": b"GET k"}) == (12, [b"GET", b"k"])
    assert slowlog_entry({"id": 1, "duration": 12, "command": "GET k"}) == (12, ["GET", "k"])


def test_proc_stat_busy_and_total_ticks() -> None:
    text = "cpu  100 5 50 800 20 1 2 3 7 0\ncpu0 50 2 25 400 10 0 1 1 3 0\n"
    assert parse_proc_cpu(text) == (100 + 5 + 50 + 1 + 2 + 3, 100 + 5 + 50 + 800 + 20 + 1 + 2 + 3)
    with pytest.raises(ValueError):
        parse_proc_cpu("intr 1 2 3\n")


def test_the_projects_scripts_are_named_by_their_sha_as_redis_sees_them() -> None:
    from rollout_bus.events.batches import _PUBLISH as BATCH_PUBLISH
    from rollout_bus.events.leased import leased
    from rollout_bus.events.publish import _PUBLISH

    names = script_names()
    assert names[hashlib.sha1(_PUBLISH.encode()).hexdigest()] == "publish._PUBLISH"
    assert names[hashlib.sha1(leased(_PUBLISH).encode()).hexdigest()] == "leased(publish._PUBLISH)"
    assert names[hashlib.sha1(BATCH_PUBLISH.encode()).hexdigest()] == "batches._PUBLISH"
