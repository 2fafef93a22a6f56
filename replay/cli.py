"""Event logs of a rollout-bus namespace: export, import, timeline, verify, feed.

    rollout-bus replay export run.rblog [--stream weights --stream batches/p0] [--since-ms MS] [--until-ms MS]
    rollout-bus replay import run.rblog --namespace copy [--restore-groups]
    rollout-bus replay timeline run.rblog [--at-ms MS] [--json]      # or --live instead of a file
    rollout-bus replay timeline run.rblog --html run.html --png run.png   # one picture of the run
    rollout-bus replay verify run.rblog [--base-version 0 | --strict] [--json]
    rollout-bus replay feed run.rblog [--policy p0] [--limit N]
    rollout-bus replay hold --policy p0 [--release]   # before a run: keep its batch payloads for export

    rollout-bus replay offline --log run.rblog --policy p0 --model-path INIT [--steps N] [--out DIR]

``offline`` retrains from the batches of an exported log, without engines or Redis,
deterministically (``replay.offline``); it prints one JSON line (batch ids in training
order, final metrics, the weights' sha256) and, with ``--out``, writes ``batch_ids.txt``,
``result.json`` and ``model/``.

``--redis-url`` (default ``$REDIS_URL``) and ``--namespace`` (default
``$ROLLOUT_BUS_NAMESPACE`` or ``default``) name the live side. ``verify`` exits 1 when it
finds a violation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from rollout_bus.events.names import name_arg

log = logging.getLogger(__name__)


def _live_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="default $REDIS_URL")
    p.add_argument("--namespace", default=os.environ.get("ROLLOUT_BUS_NAMESPACE", "default"), type=name_arg("namespace"),
                   help="default $ROLLOUT_BUS_NAMESPACE or 'default'")


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--payload-store", default="redis", metavar="SPEC",
                   help="payload store for references it cannot open otherwise: redis, shm[:/dir], file:/dir")


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", nargs="?", help="a log file (or --live)")
    p.add_argument("--live", action="store_true", help="read the namespace's streams instead of a file")
    p.add_argument("--allow-truncated", action="store_true", help="read a log without its end record")
    _live_args(p)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-bus replay", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    ex = sub.add_parser("export", help="write a namespace's streams (and batch payloads) to a log file")
    ex.add_argument("out", help="log file to write")
    ex.add_argument("--stream", action="append", metavar="NAME",
                    help="logical stream (engines, weights, commands, rollouts, trainers, dead-letters, "
                         "batches/<policy>); repeat; default all")
    ex.add_argument("--start", default="-", help="first entry id (inclusive)")
    ex.add_argument("--end", default="+", help="last entry id (inclusive)")
    ex.add_argument("--since-ms", type=int, help="from this wall-clock time (ms), instead of --start")
    ex.add_argument("--until-ms", type=int, help="up to this wall-clock time (ms), instead of --end")
    ex.add_argument("--no-payloads", action="store_true", help="leave batch payload bytes out")
    _store_args(ex)
    _live_args(ex)

    im = sub.add_parser("import", help="write a log file into a namespace (ids kept where the streams allow)")
    im.add_argument("log")
    im.add_argument("--stream", action="append", metavar="NAME", help="only these logical streams")
    im.add_argument("--restore-groups", action="store_true",
                    help="recreate consumer groups at their first unacknowledged entry")
    im.add_argument("--no-payloads", action="store_true", help="do not restore batch payloads")
    im.add_argument("--payload-ttl-s", type=int, default=24 * 3600, help="TTL of restored payloads (default 1 day)")
    im.add_argument("--allow-truncated", action="store_true")
    _store_args(im)
    _live_args(im)

    tl = sub.add_parser("timeline", help="rebuild engine, policy, batch and trainer state at a moment")
    _source_args(tl)
    tl.add_argument("--at-ms", type=int, help="state as of this entry-id time (default: end of log)")
    tl.add_argument("--batches", type=int, default=20, metavar="N", help="show the newest N batches (0: all)")
    tl.add_argument("--json", action="store_true")
    tl.add_argument("--html", metavar="FILE", help="write one picture of the run over time as a self-contained page: "
                                                   "engine lanes, versions, batches by staleness, restarts, dead letters")
    tl.add_argument("--png", metavar="FILE", help="the same picture as a PNG")

    ve = sub.add_parser("verify", help="check a log's invariants; exit 1 on any violation")
    _source_args(ve)
    group = ve.add_mutually_exclusive_group()
    group.add_argument("--base-version", type=int, default=0,
                       help="version engines launch with before any publish (default 0)")
    group.add_argument("--strict", action="store_true", help="every version must be published")
    ve.add_argument("--no-samples", action="store_true",
                    help="check batches' versions from their events only, not every sample's from the payloads")
    ve.add_argument("--json", action="store_true")

    fe = sub.add_parser("feed", help="list the recorded batches, in the order a trainer would get them")
    fe.add_argument("log")
    fe.add_argument("--policy", type=name_arg("policy"), help="only this policy's batches")
    fe.add_argument("--limit", type=int, default=0, help="stop after N batches (0: all)")

    ho = sub.add_parser("hold", help="keep the policies' batch payloads after the trainers release them, "
                                     "so that an export can include them (before the run)")
    ho.add_argument("--policy", action="append", required=True, type=name_arg("policy"), help="repeat for several policies")
    ho.add_argument("--group", default=None, type=name_arg("group"), help="the holding group (default log-export)")
    ho.add_argument("--release", action="store_true", help="let go of what the group holds and drop it")
    _live_args(ho)

    o = sub.add_parser("offline", help="retrain from an exported log's batches (no engines, no Redis)")
    o.add_argument("--log", required=True, help="a log file written by rollout-bus replay export (with payloads)")
    o.add_argument("--policy", required=True, type=name_arg("policy"), help="train on this policy's batches")
    o.add_argument("--model-path", required=True,
                   help="initial weights: the tiny LM's (config.json + model.safetensors) or a HF model directory")
    o.add_argument("--steps", type=int, default=0, help="stop after N steps (0: every batch of the log)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--out", default=None, help="write batch_ids.txt, result.json and model/ here")
    o.add_argument("--initial-version", type=int, default=0)
    o.add_argument("--max-staleness", type=int, default=None,
                   help="leave out groups more than this many versions behind (default: train every sample)")
    o.add_argument("--trained-only", action="store_true",
                   help="only the batches a trainer of the log accepted (its BatchConsumed events)")
    o.add_argument("--lr", type=float, default=5e-4)
    o.add_argument("--epochs", type=int, default=1)
    o.add_argument("--minibatches", type=int, default=1)
    o.add_argument("--tis-cap", type=float, default=2.0)
    o.add_argument("--ppo-clip", type=float, default=0.2, help="<= 0 turns the PPO clip off")
    o.add_argument("--torch-threads", type=int, default=1, help="more than 1 may cost bit-exact reproducibility")
    o.add_argument("--temperature", type=float, default=1.0,
                   help="the rollouts' sampling temperature (log-probs are recomputed at it)")
    o.add_argument("--lora", default=None, metavar="R,ALPHA", help="a HF model: train a LoRA adapter (as the "
                                                                   "live trainer's --lora)")
    o.add_argument("--micro-batch-size", type=int, default=4, help="a HF model: sequences per forward/backward")
    o.add_argument("--allow-truncated", action="store_true", help="read a log without its end record")
    o.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _entries(args: argparse.Namespace) -> Iterator[Any]:
    """The raw entries of the log file, or of the live namespace (``--live``), in log order."""
    from rollout_bus.replay.exporter import read_live
    from rollout_bus.replay.logfile import LogReader

    if args.live:
        from rollout_bus.events.connection import connect
        from rollout_bus.events.names import Keys

        client = connect(args.redis_url)
        try:
            yield from read_live(client, Keys(args.namespace))
        finally:
            client.close()
        return
    with LogReader(args.log, allow_truncated=args.allow_truncated) as reader:
        yield from reader.entries()


def _events(args: argparse.Namespace) -> Iterator[Any]:
    from rollout_bus.replay.logfile import decode_entries

    yield from decode_entries(_entries(args))


def _check_source(args: argparse.Namespace) -> None:
    if args.live == bool(args.log):
        raise SystemExit("give either a log file or --live")


def cmd_export(args: argparse.Namespace) -> int:
    from rollout_bus.events.connection import connect
    from rollout_bus.events.names import Keys
    from rollout_bus.replay.exporter import Range, export_log, resolve_streams
    from rollout_bus.replay.payloads import payload_store

    keys = Keys(args.namespace)
    client = connect(args.redis_url)
    rng = Range(args.start, args.end)
    if args.since_ms is not None or args.until_ms is not None:
        rng = Range.by_time(args.since_ms, args.until_ms)
    streams = resolve_streams(keys, args.stream) if args.stream else None
    payloads = None if args.no_payloads else payload_store(client, keys, store=args.payload_store)
    try:
        stats = export_log(client, keys, args.out, streams=streams, rng=rng, payloads=payloads)
    finally:
        if payloads is not None:
            payloads.close()
        client.close()
    print(json.dumps({"out": args.out, "entries": stats.entries, "payloads": stats.payloads,
                      "payload_bytes": stats.payload_bytes, "missing_payloads": stats.missing_payloads}))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from rollout_bus.events.connection import connect
    from rollout_bus.events.names import Keys
    from rollout_bus.replay.importer import import_log
    from rollout_bus.replay.payloads import payload_store

    keys = Keys(args.namespace)
    client = connect(args.redis_url)
    payloads = None if args.no_payloads else payload_store(client, keys, store=args.payload_store,
                                                           ttl_s=args.payload_ttl_s)
    try:
        stats = import_log(client, keys, args.log, payloads=payloads, streams=args.stream,
                           restore_groups=args.restore_groups, allow_truncated=args.allow_truncated)
    finally:
        if payloads is not None:
            payloads.close()
        client.close()
    print(json.dumps({"namespace": keys.namespace, "entries": stats.entries, "ids_preserved": stats.ids_preserved,
                      "skipped": stats.skipped, "payloads": stats.payloads, "rewritten_refs": stats.rewritten_refs,
                      "groups": stats.groups}))
    return 0


def cmd_timeline(args: argparse.Namespace) -> int:
    from rollout_bus.replay.timeline import render, timeline

    _check_source(args)
    if args.html or args.png:
        return _draw_timeline(args)
    t = timeline(_events(args), at_ms=args.at_ms)
    print(json.dumps(t.to_dict(), sort_keys=True) if args.json else render(t, max_batches=args.batches))
    return 0


def _draw_timeline(args: argparse.Namespace) -> int:
    from rollout_bus.replay.picture import picture

    if args.at_ms is not None:
        raise SystemExit("--at-ms applies to the text timeline; a picture shows the whole log")
    pic = picture(_entries(args))
    title = f"rollout-bus timeline: namespace {args.namespace} (live)" if args.live else \
        f"rollout-bus timeline: {os.path.basename(args.log)}"
    written: dict[str, Any] = {}
    if args.html:
        from rollout_bus.replay.picture_html import write_html

        written["html"] = str(write_html(pic, args.html, title=title))
    if args.png:
        from rollout_bus.replay.picture_png import write_png

        written["png"] = str(write_png(pic, args.png, title=title))
    print(json.dumps({**written, "events": pic.events, "engines": len(pic.lanes), "batches": len(pic.batches),
                      "restarts": len(pic.restarts), "dead_letters": len(pic.dead_letters)}))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from rollout_bus.replay.verify import VerifyConfig, verify, verify_log

    _check_source(args)
    config = VerifyConfig(base_version=None if args.strict else args.base_version)
    if args.live:
        found = verify(_events(args), config)
    else:
        found = verify_log(args.log, config, samples=not args.no_samples, allow_truncated=args.allow_truncated)
    if args.json:
        print(json.dumps([v.to_dict() for v in found], sort_keys=True))
    else:
        for v in found:
            print(v)
        print(f"{len(found)} violation(s)" if found else "ok: no violations")
    return 1 if found else 0


def cmd_feed(args: argparse.Namespace) -> int:
    from rollout_bus.events.batch import Ragged
    from rollout_bus.replay.feed import feed_batches

    for n, (batch_id, tensors, meta) in enumerate(feed_batches(args.log, policy=args.policy), 1):
        shapes = {name: [len(t)] if isinstance(t, Ragged) else list(t.shape) for name, t in sorted(tensors.items())}
        ready = meta["batch_ready"]
        print(json.dumps({"batch_id": batch_id, "policy": ready["policy"], "rollout_id": ready["rollout_id"],
                          "n_samples": ready["n_samples"], "entry_id": ready["entry_id"], "fields": shapes},
                         sort_keys=True))
        if args.limit and n >= args.limit:
            break
    return 0


def cmd_hold(args: argparse.Namespace) -> int:
    from rollout_bus.events.connection import connect
    from rollout_bus.events.names import Keys
    from rollout_bus.replay.exporter import HOLD_GROUP, hold_payloads, release_payloads

    keys = Keys(args.namespace)
    group = args.group or HOLD_GROUP
    client = connect(args.redis_url)
    try:
        if args.release:
            deleted = release_payloads(client, keys, args.policy, group=group)
            print(json.dumps({"released": args.policy, "group": group, "deleted_payloads": deleted}))
        else:
            hold_payloads(client, keys, args.policy, group=group)
            print(json.dumps({"held": args.policy, "group": group}))
    finally:
        client.close()
    return 0


def offline_config(ns: argparse.Namespace) -> Any:
    from rollout_bus.replay.offline import OfflineConfig
    from rollout_bus.trainer.cli import parse_lora
    from rollout_bus.trainer.config import LossSettings, OptimConfig
    from rollout_bus.trainer.hf_config import HFSettings

    return OfflineConfig(
        log=ns.log, model_path=ns.model_path, policy=ns.policy, steps=ns.steps, seed=ns.seed,
        initial_version=ns.initial_version, max_staleness=ns.max_staleness, trained_only=ns.trained_only,
        torch_threads=ns.torch_threads, allow_truncated=ns.allow_truncated,
        optim=OptimConfig(lr=ns.lr, epochs=ns.epochs, minibatches=ns.minibatches),
        loss=LossSettings(tis_cap=ns.tis_cap, ppo_clip=ns.ppo_clip if ns.ppo_clip > 0 else None),
        temperature=ns.temperature,
        hf=HFSettings(micro_batch_size=ns.micro_batch_size, device="cpu",
                      lora=parse_lora(ns.lora) if ns.lora else None),
    ).validate()


def cmd_offline(ns: argparse.Namespace) -> int:
    from rollout_bus.trainer.config import ConfigError

    try:
        config = offline_config(ns)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None

    from rollout_bus.lm.hf import is_hf_dir
    from rollout_bus.replay.offline import run_offline as train_offline
    from rollout_bus.replay.offline import write_outputs
    from rollout_bus.trainer.finite import NonFiniteStep

    try:
        result, model = train_offline(config)
    except NonFiniteStep as exc:  # nothing is written: the weights would not be finite
        print(f"rollout-bus replay offline: {exc}", file=sys.stderr)
        return 1
    tokenizer = None
    if ns.out and not ns.lora and is_hf_dir(config.model_path):  # a whole model directory: its tokenizer too
        from rollout_bus.lm.hf import load_tokenizer

        tokenizer = load_tokenizer(config.model_path)
    out = str(write_outputs(result, model, ns.out, tokenizer=tokenizer)) if ns.out else None
    print(json.dumps({"log": result.log, "policy": result.policy, "steps": len(result.batch_ids),
                      "batch_ids": result.batch_ids, "skipped": result.skipped, "version": result.version,
                      "weights_sha256": result.weights_sha256,
                      "final_metrics": result.to_dict()["final_metrics"], "out": out}, sort_keys=True))
    return 0


COMMANDS = {"export": cmd_export, "import": cmd_import, "timeline": cmd_timeline, "verify": cmd_verify,
            "feed": cmd_feed, "hold": cmd_hold, "offline": cmd_offline}


def main(argv: list[str] | None = None) -> int:
    from rollout_bus.events.errors import DecodeError

    args = parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except OSError as exc:  # a log file that cannot be read (or written)
        if exc.filename is None:
            raise
        print(f"rollout-bus replay {args.command}: cannot use {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except DecodeError as exc:
        print(f"rollout-bus replay {args.command}: not a rollout-bus event log, or a damaged one: {exc}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
