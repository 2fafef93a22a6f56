"""Weight update over 4 real CPU engines: all engines at once against one after another.

Starts a private redis-server and a controller that launches ``--engines`` CPU engines
(``engine.server``) on a TinyLM sized by ``--d-model``/``--n-layers``/``--d-ff``. Each
trial writes a new weights version, checks it (root, sha256, shapes) and pushes it with
the controller's own per-engine step (pause with ``--pause-mode``,
``/update_weights_from_disk``, continue), over all serving engines either concurrently
(what the controller does) or sequentially. The two orders alternate within one run
(ABBA) so drift hits both equally; medians are reported.

    python bench/bench_weight_update.py [--engines 4] [--trials 6] [--d-model 256] [--n-layers 4]

``--weight-sync`` compares the two data planes instead, on full SmolLM2-135M weights (``--model DIR``, e.g.
the directory ``rollout-bus prepare-model smollm2`` prints; without it a random-weights Llama of SmolLM2's
config: 30 layers, hidden 576, 9 heads of which 3 key/value, intermediate 1536, vocabulary 49152, tied
embeddings, 135M parameters, 540 MB in float32). The controller launches ``--engines`` CPU engines with
``weight_sync="broadcast"``; a ``trainer.broadcast.WeightSender`` in this process is rank 0. Each trial writes
a new version and pushes it with the controller's own round step (after one uncounted broadcast that opens
the group, once per engine lifetime), alternately (ABBA) from disk
(``/update_weights_from_disk``) and by collective (the weight-update group, gloo, ``--bucket-mb``), the
sender's copy of the version prepared before the round, as a trainer's is. The figure is the engine's
pause: from the pause call to the engine serving the new version after ``/continue_generation``
(a disk push's ``EngineOutcome.duration_s``, ``WeightBroadcast.last_pauses`` for a broadcast). Three planes,
rotated ABC CBA: ``disk``, ``broadcast`` (paused before the first bucket, as SGLang needs) and ``swap``
(``broadcast_pause="swap"``: paused before the last bucket only, the engine staging the rest). Reported: median
and spread per plane, and the per-round ratio of each broadcast plane to disk (target <= 0.5), with the load judged from outside (``bench.verdict``).

    python bench/bench_weight_update.py --weight-sync [--engines 1] [--trials 3] [--model DIR]
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.verdict import OutsideLoad, Row, Target, paired_ratios, spread, table  # noqa: E402
from rollout_bus.controller.config import ControllerConfig  # noqa: E402
from rollout_bus.controller.service import InferenceController  # noqa: E402
from rollout_bus.controller.weights import verify  # noqa: E402
from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.embedded import RedisServer  # noqa: E402
from tests.support.controller_driver import write_version  # noqa: E402

SMOLLM2 = dict(hidden_size=576, layers=30, heads=9, kv_heads=3, intermediate_size=1536, max_positions=2048, tie=True)
SMOLLM2_VOCAB = 49152


def smollm2_like(directory: Path) -> Path:
    """A random-weights Llama of SmolLM2-135M's config (the byte tokenizer beside it), as a version directory."""
    from rollout_bus.lm.hf import byte_tokenizer, random_llama, save_version

    save_version(directory, random_llama(SMOLLM2_VOCAB, seed=0, **SMOLLM2), byte_tokenizer())  # type: ignore[arg-type]
    return directory


def _receive(port: int, shapes: list[tuple[tuple[int, ...], str]], out: Any) -> None:
    """Rank 1 of the phase profile: receive every tensor, report the seconds it took."""
    import datetime

    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("profile", store), 1, 2, timeout)
    buffers = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in shapes]
    t = time.perf_counter()
    for work in [pg.broadcast(b, 0) for b in buffers]:
        work.wait()
    out.put(time.perf_counter() - t)


def phase_profile(path: Path) -> dict[str, float]:
    """Seconds of each step an engine takes for one version of ``path``, measured alone in this process (and one
    receiver process): reading the files (page cache warm), the gloo transfer to one receiver, the finiteness and
    shape check, and the digest; both planes check and digest, only the transfer differs."""
    import datetime
    import multiprocessing

    import torch.distributed as dist

    from rollout_bus.engine.served import check_tensors
    from rollout_bus.lm.files import tensor_shapes
    from rollout_bus.lm.hf import read_state, state_digest

    reference = tensor_shapes(path)
    t = time.perf_counter()
    state = read_state(path)
    phases = {"read files": time.perf_counter() - t}
    t = time.perf_counter()
    check_tensors(reference, state)
    phases["check"] = time.perf_counter() - t
    t = time.perf_counter()
    state_digest(state)
    phases["digest"] = time.perf_counter() - t
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    names = sorted(state)
    child = ctx.Process(target=_receive, args=(store.port, [(tuple(state[n].shape), str(state[n].dtype)[6:])
                                                            for n in names], out))
    child.start()
    pg = dist.ProcessGroupGloo(dist.PrefixStore("profile", store), 0, 2, timeout)
    for work in [pg.broadcast(state[n], 0) for n in names]:
        work.wait()
    phases["gloo transfer"] = out.get(timeout=120)
    child.join(30)
    return phases


def pauses_of(outcomes: list[Any], plane: str, ctl: InferenceController) -> list[float]:
    """Each engine's pause, from the pause call to serving the new version after ``/continue_generation``: a disk
    push's duration, or what the broadcast measured (under ``swap`` the push is longer than the pause)."""
    if plane == "disk":
        return [o.duration_s for o in outcomes]
    assert ctl.updater.broadcast is not None
    return list(ctl.updater.broadcast.last_pauses.values())


async def run_sync(args: argparse.Namespace, workdir: Path) -> None:
    """Disk against broadcast: the engine's pause for full SmolLM2 weights (see the module docstring)."""
    import dataclasses

    from rollout_bus.events.names import Keys
    from rollout_bus.lm.files import tensor_shapes
    from rollout_bus.trainer.broadcast import WeightSender

    root = workdir / "weights"
    base = Path(args.model) if args.model else smollm2_like(root / "base")
    if args.model:
        root = base.parent
    size_mb = sum(f.stat().st_size for f in base.glob("*.safetensors")) / 1e6
    with RedisServer() as server:
        client = connect(server.url)
        keys = Keys("bench-sync")
        cfg = ControllerConfig(namespace=keys.namespace, redis_url=server.url, num_engines=args.engines,
                               model_path=str(base), weights_root=str(root), pause_mode=args.pause_mode,
                               health_interval_s=3600, log_dir=str(workdir / "logs"), weight_sync="broadcast",
                               group_timeout_s=120.0, update_timeout_s=600.0, startup_timeout_s=600.0)
        ctl = InferenceController(cfg, client)
        sender = WeightSender(client, keys, "default", bucket_bytes=int(args.bucket_mb * (1 << 20)), timeout_s=120.0)
        sender.start()
        started = time.perf_counter()
        await ctl.start()
        await ctl.wait_serving(timeout_s=600)
        print(f"{args.engines} engine(s) up in {time.perf_counter() - started:.1f}s; weights {size_mb:.0f} MB "
              f"({len(tensor_shapes(base))} tensors); pause mode {args.pause_mode}; bucket {args.bucket_mb:g} MB",
              flush=True)
        pauses: dict[str, list[float]] = {"disk": [], "broadcast": [], "swap": []}
        planes = list(pauses)
        order = [("broadcast", -1)] + [(plane, r) for r in range(args.trials)
                                       for plane in (planes if r % 2 == 0 else planes[::-1])]  # ABC CBA
        assert ctl.updater.broadcast is not None
        try:
            with OutsideLoad() as outside:
                for trial, (plane, round_) in enumerate(order):
                    version = trial + 1
                    path, sha = await asyncio.to_thread(write_version, base, root / "default" / f"v{version:06d}",
                                                        seed=version, scale=0.001)
                    target = await asyncio.to_thread(verify, "default", version, str(path), sha, root,
                                                     ctl.updater.reference)
                    if plane != "disk":
                        plan = await asyncio.to_thread(sender.offer, version, None, path)
                        assert plan is not None
                        last = client.xrevrange(keys.weight_stream("default"), count=1)
                        sender.published(version, last[0][0].decode() if last else "0-1")
                        target = dataclasses.replace(target, group_address=sender.address, group_backend="gloo",
                                                     buckets=tuple(tuple(b) for b in plan))
                    ctl.core.book.accept(target)
                    engines = ctl.core.serving()
                    ctl.core.config.broadcast_pause = "swap" if plane == "swap" else "before"
                    if plane != "disk":
                        outcomes = await ctl.updater.broadcast_all(target, engines)
                    else:
                        outcomes = await ctl.updater.apply_all(target, engines)
                    assert [o.status for o in outcomes] == ["applied"] * args.engines, outcomes
                    if plane != "disk":
                        assert ctl.updater.broadcast.fallbacks == 0, "a broadcast fell back to disk"
                    digests = [await h.client.weights_digest() for h in engines]
                    assert all(d["digest"] == target.digest for d in digests), "an engine's digest differs"
                    pause = statistics.median(pauses_of(outcomes, plane, ctl))
                    if round_ >= 0:
                        pauses[plane].append(pause)
                    print(f"{'round ' + str(round_ + 1) if round_ >= 0 else 'warm-up (opens the group)'}: {plane:<9} "
                          f"v{version} pause {pause * 1000:.0f} ms (load {os.getloadavg()[0]:.2f})", flush=True)
        finally:
            sender.stop()
            await ctl.stop()
            client.close()
        profile = phase_profile(path)
    print("phases alone, one version: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in profile.items()))
    for plane, values in pauses.items():
        print(f"{plane:<9} pause: {spread([v * 1000 for v in values])} ms")
    print(table([Row("bench_weight_update", f"{plane} / disk pause", paired_ratios(pauses[plane], pauses["disk"]),
                     Target("<=", 0.5), outside.load) for plane in ("broadcast", "swap")]))
    print(f"load average before {outside.load.before:.2f}, {os.getloadavg()[0]:.2f} at the end on "
          f"{os.cpu_count()} CPUs")


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
    p.add_argument("--weight-sync", action="store_true",
                   help="compare the pause of a disk update and a broadcast one on full SmolLM2 weights")
    p.add_argument("--model", default=None, help="--weight-sync: a SmolLM2 directory (default: random weights of "
                                                 "its config)")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="--weight-sync: bucket size of the broadcast")
    args = p.parse_args()
    logging.basicConfig(level=args.log_level.upper())
    with tempfile.TemporaryDirectory(prefix="bench-weight-update-") as workdir:
        if args.weight_sync:
            if args.engines == p.get_default("engines"):
                args.engines = 1
            if args.trials == p.get_default("trials"):
                args.trials = 3
            asyncio.run(run_sync(args, Path(workdir)))
        else:
            asyncio.run(run(args, Path(workdir)))


if __name__ == "__main__":
    main()
