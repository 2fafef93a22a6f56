"""Hostile log files: records are read with bounded cost, malformed ones are one-line errors (exit 2),
and imported ids that would break later publishes get new ids."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import fakeredis
import msgpack
import pytest

from rollout_bus.events.errors import DecodeError
from rollout_bus.events.names import Keys, stream_key
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineServing, Producer, encode
from rollout_bus.lm.model import ModelConfig, build_model, save_weights
from rollout_bus.replay import cli as replay_cli
from rollout_bus.replay.importer import import_log
from rollout_bus.replay.logfile import FORMAT, LogReader
from rollout_bus.replay.records import ReadLimits

PRODUCER = Producer("controller", "c-0")
HEADER: dict[str, Any] = {"kind": "header", "format": FORMAT, "format_version": 1, "namespace": "n", "created_ms": 0,
                          "ranges": [{"stream": "engines", "start": "-", "end": "+", "length": 1, "groups": []}]}


def event_fields(n: int = 0) -> dict[bytes, bytes]:
    return encode(EngineServing(producer=PRODUCER, engine_id=f"e{n}", url="http://e", versions={"p": 0}))


def entry(entry_id: Any = "1000-0", **over: Any) -> dict[str, Any]:
    return {"kind": "entry", "stream": "engines", "id": entry_id, "fields": event_fields(), **over}


END = {"kind": "end", "entries": {}, "payloads": 0}


def write(path: Path, *records: Any, raw: bytes = b"") -> Path:
    with path.open("wb") as fh:
        for record in records:
            fh.write(msgpack.packb(record, use_bin_type=True))
        fh.write(raw)
    return path


def read_all(path: Path, **kw: Any) -> list[Any]:
    with LogReader(path, **kw) as reader:
        return list(reader)


# --- bounded reads -------------------------------------------------------------------------

def test_a_crafted_8_mib_record_is_refused_without_unpacking_it(tmp_path: Path) -> None:
    path = tmp_path / "bomb.rblog"
    n = 8 << 20  # an entry whose fields hold 8 Mi empty maps: 8 MiB on disk, over 500 MiB once unpacked
    bomb = b"\x84" + msgpack.packb("kind") + msgpack.packb("entry") + msgpack.packb("stream") + \
        msgpack.packb("engines") + msgpack.packb("id") + msgpack.packb("1000-0") + msgpack.packb("fields") + \
        b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    write(path, HEADER, raw=bomb)
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="objects"):
            read_all(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 48 << 20, f"reading the record cost {peak >> 20} MiB"


@pytest.mark.parametrize(("raw", "match"), [
    (b"\x91" * 5000 + b"\xc0", "nested deeper"),
    (b"\xdd\xff\xff\xff\xff", "truncated|objects"),
    (b"\xc6\xff\xff\xff\xff", "bytes"),
    (b"\xd4\x01\x00", "extension"),
    (b"\xc1", "extension type, or none"),
])
def test_hostile_msgpack_is_a_decode_error_naming_the_limit(tmp_path: Path, raw: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        read_all(write(tmp_path / "x.rblog", HEADER, raw=raw))


def test_the_record_limit_is_configurable_and_well_below_128_mib(tmp_path: Path) -> None:
    assert ReadLimits().max_record_bytes <= 17 << 20
    big = entry(fields={b"e": b"x" * (2 << 20)})
    path = write(tmp_path / "big.rblog", HEADER, big, END)
    assert len(read_all(path)) == 1
    with pytest.raises(DecodeError, match="record of more than 1048576 bytes"):
        read_all(path, limits=ReadLimits(max_record_bytes=1 << 20))
    with pytest.raises(DecodeError, match="record of more than 65536 bytes"):  # one already read ahead, too
        read_all(write(tmp_path / "mid.rblog", HEADER, entry(fields={b"e": b"x" * (200 << 10)}), END),
                 limits=ReadLimits(max_record_bytes=64 << 10))


# --- malformed logs ------------------------------------------------------------------------

MALFORMED = {
    "header without ranges": [{k: v for k, v in HEADER.items() if k != "ranges"}, END],
    "range without stream": [{**HEADER, "ranges": [{"start": "-", "end": "+", "length": 0}]}, END],
    "range that is a number": [{**HEADER, "ranges": [7]}, END],
    "entry without an id": [HEADER, {k: v for k, v in entry().items() if k != "id"}, END],
    "entry with a bad id": [HEADER, entry("12-ab"), END],
    "entry with id 0-0": [HEADER, entry("0-0"), END],
    "entry with an id past 2**64": [HEADER, entry(f"{1 << 64}-0"), END],
    "entry without fields": [HEADER, {k: v for k, v in entry().items() if k != "fields"}, END],
    "payload part without its size": [HEADER, {"kind": "payload", "stream": "batches/p", "entry_id": "1-0",
                                               "batch_id": "b", "ref": {}, "sha256": "", "part": 0, "parts": 1,
                                               "data": b""}, END],
    "payload claiming a billion parts": [HEADER, {"kind": "payload", "stream": "batches/p", "entry_id": "1-0",
                                                  "batch_id": "b", "ref": {}, "size": 4, "sha256": "", "part": 0,
                                                  "parts": 10**9, "data": b"abcd"}, END],
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("command", ["timeline", "verify", "feed", "offline", "timeline-json"])
def test_every_replay_subcommand_exits_2_with_one_line_on_a_malformed_log(
        tmp_path: Path, case: str, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(write(tmp_path / "bad.rblog", *MALFORMED[case]))
    if command == "offline":
        save_weights(build_model(ModelConfig(d_model=8, n_layers=1, n_heads=2, d_ff=16, max_seq_len=16)),
                     tmp_path / "init")
    argv = {"timeline": ["timeline", path], "timeline-json": ["timeline", path, "--json"],
            "verify": ["verify", path], "feed": ["feed", path],
            "offline": ["offline", "--log", path, "--policy", "p", "--model-path", str(tmp_path / "init")]}[command]
    assert replay_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "damaged" in err and "Traceback" not in err, err


def test_a_well_formed_log_still_reads(tmp_path: Path) -> None:
    records = read_all(write(tmp_path / "ok.rblog", HEADER, entry("1000-0"), entry("1000-1"), END))
    assert [r.id for r in records] == ["1000-0", "1000-1"]


# --- imported ids ------------------------------------------------------------------------------

def test_an_imported_id_ahead_of_the_servers_clock_is_remapped_so_later_publishes_work(tmp_path: Path) -> None:
    client = fakeredis.FakeRedis()
    keys = Keys("hostile-import")
    top = "18446744073709551615-18446744073709551615"
    path = write(tmp_path / "ids.rblog", HEADER, entry("1000-0"), entry(top, fields=event_fields(1)), END)
    stats = import_log(client, keys, path)
    assert stats.entries == {"engines": 2} and stats.ids_preserved == {"engines": False}
    target = stream_key(keys, "engines")
    ids = [i.decode() for i, _ in client.xrange(target)]
    assert ids[0] == "1000-0" and ids[1] != top and int(ids[1].split("-")[0]) < 1 << 63
    Publisher(client, keys, PRODUCER).publish(target, EngineServing(  # a later publish on the stream works
        producer=PRODUCER, engine_id="e9", url="http://e", versions={"p": 1}))
    assert client.xlen(target) == 3
