"""Weight update over 4 real CPU engines: all engines at once against one after another.

Starts a private redis-server and a controller that launches ``--engines`` CPU engines
(``engine.server``) on a TinyLM sized by ``--d-model``/``--n-layers``/``--d-ff``. Each
trial writes a new weights version, checks it (root, sha256, shapes) and pushes it with
the controller's own per-engine step (pause with ``--pause-mode``,
``/update_weights_from_disk``, continue), over all serving engines either concurrently
(what the controller does) or sequentially. The two orders alternate within one run
(ABBA) so drift hits both equally; medians are reported.

    python bench/bench_weight_update.py [--engines 4] [--trials 6] [--d-model 256] [--n-layers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bus.controller.config import ControllerConfig  # noqa: E402
from rollout_bus.controller.service import InferenceController  # noqa: E402
from rollout_bus.controller.weights import verify  # noqa: E402
from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.embedded import RedisServer  # noqa: E402
from tests.support.controller_driver import write_version  # noqa: E402


async def run(args: argparse.Namespace, workdir: Path) -> None:
    root = workdir / "weights"
    base = root / "base"
    subprocess.run([sys.executable, "-m", "rollout_bus.engine.init_weights", str(base), "--d-model", str(args.d_model),
                    "--n-layers", str(args.n_layers), "--d-ff", str(args.d_ff)], check=True,
                   cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL)
    size_mb = (base / "model.safetensors").stat().st_size / 1e6
    with RedisServer() as server:
        client = connect(server.url)
        cfg = ControllerConfig(namespace="bench-weights", redis_url=server.url, num_engines=args.engines,
                               model_path=str(base), weights_root=str(root), pause_mode=args.pause_mode,
                               health_interval_s=3600, log_dir=str(workdir / "logs"))
        ctl = InferenceController(cfg, client)
        started = time.perf_counter()
        await ctl.start()
        await ctl.wait_serving(timeout_s=120)
        print(f"{args.engines} engines up in {time.perf_counter() - started:.1f}s; weights file {size_mb:.1f} MB; "
              f"pause mode {args.pause_mode}; load average {os.getloadavg()[0]:.2f}")
        timings: dict[str, list[float]] = {"parallel": [], "sequential": []}
        per_engine: list[float] = []
        try:
            for trial in range(2 * args.trials):
                parallel = (trial % 4) in (0, 3)  # ABBA ordering
                version = trial + 1
                path, sha = write_version(base, root / f"v{version}", seed=version)
                target = await asyncio.to_thread(verify, "default", version, str(path), sha, root,
                                                 ctl.updater.reference)
                ctl.core.book.accept(target)
                t = time.perf_counter()
                outcomes = await ctl.updater.apply_all(target, ctl.core.serving(), parallel=parallel)
                timings["parallel" if parallel else "sequential"].append(time.perf_counter() - t)
                assert [o.status for o in outcomes] == ["applied"] * args.engines, outcomes
                per_engine += [o.duration_s for o in outcomes]
        finally:
            await ctl.stop()
            client.close()
    par, seq = statistics.median(timings["parallel"]), statistics.median(timings["sequential"])
    print(f"trials per order: {args.trials}; per-engine pause+update+continue median "
          f"{statistics.median(per_engine) * 1000:.1f} ms")
    print(f"parallel   (all {args.engines} engines at once): median {par * 1000:.1f} ms  "
          f"[{', '.join(f'{x * 1000:.0f}' for x in timings['parallel'])}]")
    print(f"sequential (one engine after another): median {seq * 1000:.1f} ms  "
          f"[{', '.join(f'{x * 1000:.0f}' for x in timings['sequential'])}]")
    print(f"sequential / parallel: {seq / par:.2f}x; load average {os.getloadavg()[0]:.2f} at the end "
          f"on {os.cpu_count()} CPUs")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--trials", type=int, default=6, help="updates per order (parallel, sequential)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--pause-mode", default="retract", choices=["abort", "retract", "in_place"])
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    logging.basicConfig(level=args.log_level.upper())
    with tempfile.TemporaryDirectory(prefix="bench-weight-update-") as workdir:
        asyncio.run(run(args, Path(workdir)))


if __name__ == "__main__":
    main()
