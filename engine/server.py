"""Entrypoint: ``python -m engine.server --model-path DIR [--port P] ...`` (see ``--help``)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from rollout_bus.engine.args import parse_args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from rollout_bus.events.processes import watch_run

    watch_run()  # launched by a run's controller: gone with the run, though it outlives the controller
    from aiohttp import web

    from rollout_bus.engine.errors import EngineError
    from rollout_bus.engine.routes import build_app, health_timeout_s
    from rollout_bus.engine.runtime import Engine
    from rollout_bus.events.errors import InvalidRequest
    from rollout_bus.lm.files import WeightsError

    try:
        health_timeout_s()  # a bad SGLANG_HEALTH_CHECK_TIMEOUT stops the engine here, before the weights load
        engine = Engine(args)
    except (EngineError, WeightsError, OSError, ValueError, InvalidRequest) as exc:
        logging.getLogger("rollout_bus.engine.server").error("cannot start: %s", exc)
        return 2
    web.run_app(
        build_app(engine),
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        access_log=logging.getLogger("aiohttp.access") if args.log_level == "debug" else None,
        print=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
