"""Queue one rollout request and optionally wait for its outcome.

    rollout-bus request --policy p --rollout-id 0 --groups 4 --samples 8 [--wait]

Prints the request id; with ``--wait``, the job's result (batch id, samples, metrics) or
its failure, as JSON. Exit status: 0 done, 1 failed, 2 invalid request, 3 timed out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rollout_bus.events.names import name_arg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-bus request", description="Queue a rollout request.")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--namespace", default=None, type=name_arg("namespace"))
    p.add_argument("--policy", required=True, type=name_arg("policy"))
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

    from rollout_bus.events.connection import connect
    from rollout_bus.events.errors import InvalidRequest
    from rollout_bus.events.names import Keys
    from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
    from rollout_bus.events.submit import RolloutSubmitter, wait_outcome

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
        RolloutSubmitter(client, keys).submit(request)
    except InvalidRequest as exc:
        print(f"invalid request: {exc}", file=sys.stderr)
        return 2
    print(request.request_id)
    if not ns.wait:
        return 0
    result = wait_outcome(client, request.request_id, ns.timeout_s + 60)
    if result.state == "finished":
        print(json.dumps(result.result, indent=2))
        return 0
    if result.state == "failed":
        print(json.dumps({"status": "failed", "error": result.error}), file=sys.stderr)
        return 1
    print(f"timed out waiting for the request (still {result.state})", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
