"""Queue one rollout request and optionally wait for its outcome.

    python scripts/request_rollout.py --policy p --rollout-id 0 --groups 4 --samples 8 [--wait]

Prints the request id; with ``--wait``, the job's result (batch id, samples, metrics) or
its failure, as JSON. Exit status: 0 done, 1 failed, 2 invalid request, 3 timed out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/request_rollout.py", description="Queue a rollout request.")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--namespace", default=None)
    p.add_argument("--policy", required=True)
    p.add_argument("--rollout-id", type=int, required=True)
    p.add_argument("--groups", type=int, required=True, help="prompt groups")
    p.add_argument("--samples", type=int, required=True, help="samples per group")
    p.add_argument("--request-id", default=None, help="default: a fresh uuid; reuse one to deduplicate")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stop-token-ids", default="", help="comma-separated")
    p.add_argument("--data", default="{}", help="JSON options for the data source")
    p.add_argument("--over-sample-groups", type=int, default=None)
    p.add_argument("--std-normalise", action="store_true")
    p.add_argument("--eval", action="store_true", help="an eval request: metrics only, no batch")
    p.add_argument("--timeout-s", type=float, default=600.0, help="the request's deadline, from now")
    p.add_argument("--wait", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)

    from rq.job import JobStatus

    from events.connection import connect
    from events.errors import InvalidRequest
    from events.names import Keys
    from executor.request import RolloutRequest, SamplingParams
    from executor.submit import RolloutSubmitter

    keys = Keys(ns.namespace) if ns.namespace else Keys.from_env()
    client = connect(ns.redis_url)
    stops = tuple(int(t) for t in ns.stop_token_ids.split(",") if t.strip())
    extra = {"request_id": ns.request_id} if ns.request_id else {}
    try:
        request = RolloutRequest.create(
            ns.policy, ns.rollout_id, ns.groups, ns.samples, timeout_s=ns.timeout_s, data=json.loads(ns.data),
            eval=ns.eval, over_sample_groups=ns.over_sample_groups, std_normalise=ns.std_normalise,
            sampling=SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                                    max_new_tokens=ns.max_new_tokens, stop_token_ids=stops), **extra)
        job = RolloutSubmitter(client, keys).submit(request)
    except InvalidRequest as exc:
        print(f"invalid request: {exc}", file=sys.stderr)
        return 2
    print(request.request_id)
    if not ns.wait:
        return 0
    deadline = time.monotonic() + ns.timeout_s + 60
    while time.monotonic() < deadline:
        status = job.get_status(refresh=True)
        if status == JobStatus.FINISHED:
            print(json.dumps(job.return_value(), indent=2))
            return 0
        if status == JobStatus.FAILED:
            result = job.latest_result()
            print(json.dumps({"status": "failed", "error": result.exc_string if result else None}), file=sys.stderr)
            return 1
        time.sleep(0.2)
    print("timed out waiting for the request", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
