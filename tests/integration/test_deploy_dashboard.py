"""rq-dashboard shows the rollout queues' JSON jobs through the read-only status user.

Skipped unless rq-dashboard (and ``six``, which it needs but does not declare) is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from rollout_bus.events.names import Keys
from tests.integration.test_deploy_acl import AclServer
from tests.integration.test_deploy_compose import compose, resolve

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def acl_server() -> Iterator[AclServer]:
    server = AclServer()
    yield server
    server.stop()


def test_the_dashboard_lists_json_jobs_of_the_rollout_queue_as_the_status_user(acl_server: AclServer) -> None:
    pytest.importorskip("six")
    pytest.importorskip("rq_dashboard")
    from rq_dashboard import web
    from rq_dashboard.cli import make_flask_app

    keys = Keys("dash")
    Queue(keys.rollout_queue, connection=acl_server.client("trainer"), serializer=JSONSerializer).enqueue_call(
        "rollout_bus.executor.jobs.run_rollout", kwargs={"request": {"policy": "p0"}}, job_id="req-1")
    app: Any = make_flask_app(None, None, None, "")
    app.config["RQ_DASHBOARD_REDIS_URL"] = acl_server.url("status")
    web.config.serializer = JSONSerializer
    web.setup_rq_connection(app)
    client = app.test_client()
    queues = client.get("/0/data/queues.json").get_json()["queues"]
    assert {q["name"]: q["count"] for q in queues}[keys.rollout_queue] == 1
    jobs = client.get(f"/0/data/jobs/{keys.rollout_queue}/queued/8/asc/1.json").get_json()["jobs"]
    assert [j["id"] for j in jobs] == ["req-1"]


def test_the_compose_dashboard_flags_are_ones_rq_dashboard_knows() -> None:
    pytest.importorskip("six")
    pytest.importorskip("rq_dashboard")
    from click.testing import CliRunner
    from rq_dashboard.cli import run

    service = compose()["services"]["rq-dashboard"]
    args = [resolve(str(a)) for a in service["command"]]
    assert args[0] == "rq-dashboard"
    help_text = CliRunner().invoke(run, ["--help"]).output
    for flag in (a for a in args[1:] if a.startswith("--")):
        assert flag in help_text, flag
