"""An executor that takes one job the way every executor does and then stops short of starting it, until it is
killed: ``taker_proc.py REDIS_URL NAMESPACE INDEX``. Prints ``taken <job id>`` once the job is in its hands."""

from __future__ import annotations

import sys

from rollout_bus.executor.config import ExecutorConfig
from rollout_bus.executor.service import ExecutorService


def main() -> None:
    url, namespace, index = sys.argv[1], sys.argv[2], int(sys.argv[3])
    service = ExecutorService(ExecutorConfig(redis_url=url, namespace=namespace, index=index)).start()
    assert service.worker is not None and service._reaper is not None
    service._reaper.stop()  # only the test's reaper runs
    service.worker.register_birth()
    taken = service.worker.dequeue_job_and_maintain_ttl(timeout=30)
    assert taken is not None
    print("taken", taken[0].id, flush=True)
    sys.stdin.read()  # holds the job, never starts it, until killed


if __name__ == "__main__":
    main()
