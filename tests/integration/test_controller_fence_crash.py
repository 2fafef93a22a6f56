"""Fencing when Redis loses its last writes (a host crash with AOF ``everysec``): a real redis-server with
``appendonly yes``, its append-only directory copied while it is quiet, more writes (a takeover hands out a
token), then the server stopped and started again from the copy: the takeover is lost, as a power loss loses
it. The next takeover must get a larger token than the lost one, and the lost leader's writes are refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rollout_bus.controller.lease import CLOCK_FLOOR, Lease
from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import Fenced
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineRecord, EngineState, Registry

pytestmark = pytest.mark.integration


def record(engine_id: str, writer: str) -> EngineRecord:
    return EngineRecord(engine_id=engine_id, url=f"http://127.0.0.1:1/{writer}", state=EngineState.SERVING)


def test_a_takeover_redis_lost_in_a_crash_never_hands_its_token_out_again(tmp_path: Path) -> None:
    keys = Keys("crash")
    data = tmp_path / "redis"
    data.mkdir()
    server = RedisServer(data_dir=data, appendonly=True, appendfsync="everysec").start()
    try:
        client = connect(server.url)
        first = Lease(client, keys.controller_lease, "first", ttl_s=30)
        assert first.try_acquire() and first.token is not None
        Registry(client, keys, fence=first.token, holder=first.owner).put_engine(record("e0", "first"))
        # quiet: every reply is in, so the file holds every write so far; this is what the disk keeps
        saved = tmp_path / "saved"
        shutil.copytree(data / "appendonlydir", saved / "appendonlydir")

        assert first.release()
        lost = Lease(client, keys.controller_lease, "lost", ttl_s=30)
        assert lost.try_acquire() and lost.token is not None and lost.token > first.token
        Registry(client, keys, fence=lost.token, holder=lost.owner).put_engine(record("e0", "lost"))
        client.close()

        server.kill()  # the host went down before the last second reached the disk
        shutil.rmtree(data / "appendonlydir")
        shutil.copytree(saved / "appendonlydir", data / "appendonlydir")
        server.restart()
        client = connect(server.url)
        registry = Registry(client, keys)
        assert registry.engines()["e0"].url.endswith("/first")  # the takeover is gone, as in a power loss
        assert int(client.get(keys.controller_fence) or 0) == first.token  # the counter went back with it

        assert first.release()  # the restored lease is the first's again; it lapses
        standby = Lease(client, keys.controller_lease, "standby", ttl_s=30)
        assert standby.try_acquire() and standby.token is not None
        assert standby.token > lost.token, f"token {lost.token} was handed out twice"
        assert standby.token >= CLOCK_FLOOR  # folded with the restarted server's clock
        Registry(client, keys, fence=standby.token, holder=standby.owner).put_engine(record("e0", "standby"))
        with pytest.raises(Fenced):  # the lost leader still believes it leads: its writes are refused
            Registry(client, keys, fence=lost.token, holder=lost.owner).put_engine(record("e0", "lost"))
        with pytest.raises(Fenced):  # also without its owner: the number alone is older now
            Registry(client, keys, fence=lost.token).put_engine(record("e0", "lost"))
        assert registry.engines()["e0"].url.endswith("/standby")

        again = Lease(client, keys.controller_lease, "again", ttl_s=30)  # tokens go on rising on this run
        assert standby.release() and again.try_acquire() and again.token is not None and again.token > standby.token
        client.close()
    finally:
        server.stop()
