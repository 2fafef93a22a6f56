"""Sync, one-step and async at equal samples: held-out accuracy against wall-clock time.

Each mode runs the main job (``launch.job.run_job``: controller, engine, executors and trainer
processes on a private redis-server) with the same settings and the same number of trained samples
(``--steps`` x ``--n-groups`` x ``--n-samples``), once per seed, modes interleaved within a seed
(the order rotates, so no mode always runs first after a quiet spell). Every run evaluates on the
held-out split before training, every ``--eval-every`` steps during it and after it (the run's own
evals: ``EvalCompleted`` events, accuracy with its 95% Wilson interval).

Time is measured from the end of the eval before training (training starts right after it, in
every mode); an eval that followed step ``s`` is placed at the time the trainer finished step ``s``
(its metric log), that is when the weights it scores existed, not when the eval itself finished.

``--placement disaggregated`` puts the engines' side (controller, executors, redis) and the trainer on
disjoint CPU sets and ``--off-policy`` picks the trainer's correction (``rollout-bus run``'s flags,
``launch.placement``, ``trainer.grpo``); both go to every run and into each curve of ``--json``, with
the CPUs each side's processes got (read back by the run from the live processes). The bench's own
redis-server goes with the engines.

Printed per mode, medians over seeds with the range: the time to train every step, the final
held-out accuracy, and the time each mode first reached the final accuracy of sync *with the same
seed* (seeds share their eval problems and the initial weights, so the comparison is paired).
``--png`` draws accuracy against time, one line per mode and seed, with the intervals.

    python bench/bench_learning.py [--model smollm2] [--seeds 0,1,2] [--steps 12] [--eval-every 3] [--png FILE]
        [--placement shared|disaggregated] [--off-policy tis|mis|decoupled]

The tiny LM (default) shows the comparison in a few minutes; ``--model smollm2`` runs the real
model with the main job's HF defaults (each run several minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bus.events.embedded import private_redis  # noqa: E402
from rollout_bus.launch.config import MODEL_DEFAULTS, OFF_POLICIES, PLACEMENTS, RunConfig  # noqa: E402
from rollout_bus.launch.job import run_job  # noqa: E402
from rollout_bus.launch.placement import PlacementError, pin_process, plan  # noqa: E402

MODES = ("sync", "one-step", "async")


@dataclass
class Point:
    step: int
    t_s: float
    accuracy: float
    lo: float
    hi: float


@dataclass
class Curve:
    mode: str
    seed: int
    wall_s: float
    """The whole run, processes' start and the evals included."""
    train_s: float = float("nan")
    """From the end of the eval before training to the trainer's last step."""
    points: list[Point] = field(default_factory=list)
    samples: int = 0
    """Samples the trainer trained on."""
    placement: str = "shared"
    off_policy: str = "tis"
    cpus: dict[str, list[int]] = field(default_factory=dict)
    """The CPUs each side's processes got (``summary.json``'s ``placement.observed``)."""

    @property
    def final(self) -> float:
        return self.points[-1].accuracy if self.points else float("nan")

    def time_to(self, accuracy: float) -> float | None:
        """When this run first reached ``accuracy`` (None: never)."""
        return next((p.t_s for p in self.points if p.accuracy >= accuracy - 1e-12), None)


def read_curve(out: Path, mode: str, seed: int, wall_s: float) -> Curve:
    """The held-out points of one finished run, from its metric logs."""
    metrics = out / "metrics"
    evals = [json.loads(line) for f in sorted(metrics.glob("*-eval.jsonl")) for line in f.read_text().splitlines()]
    steps = [json.loads(line) for f in sorted(metrics.glob("*.jsonl")) if not f.name.endswith("-eval.jsonl")
             for line in f.read_text().splitlines()]
    before = [e for e in evals if e["phase"] == "before"]
    if not before or not steps:
        raise RuntimeError(f"{mode} seed {seed}: the run left no eval before training or no steps in {metrics}")
    t0 = before[0]["time"]
    step_time = {int(s["step"]): float(s["time"]) for s in steps}
    curve = Curve(mode, seed, wall_s)
    curve.train_s = max(step_time.values()) - t0
    curve.samples = int(sum(s["metrics"].get("batch/samples", 0) for s in steps))
    for e in sorted(evals, key=lambda e: (e["step"], e["phase"] != "after")):
        m = e.get("metrics") or {}
        if "accuracy" not in m:
            continue
        at = 0.0 if e["step"] == 0 else step_time.get(int(e["step"]), float("nan")) - t0
        curve.points.append(Point(int(e["step"]), at, float(m["accuracy"]), float(m["accuracy_lo"]),
                                  float(m["accuracy_hi"])))
    return curve


def save_curves(curves: list[Curve], path: Path) -> None:
    path.write_text(json.dumps([{"mode": c.mode, "seed": c.seed, "wall_s": c.wall_s, "train_s": c.train_s,
                                 "samples": c.samples, "placement": c.placement, "off_policy": c.off_policy,
                                 "cpus": c.cpus, "points": [vars(p) for p in c.points]}
                                for c in curves], indent=1))


def load_curves(path: Path) -> list[Curve]:
    """Curves written by ``--json`` (a file from before ``--placement`` and ``--off-policy``: shared, tis)."""
    return [Curve(str(d["mode"]), int(d["seed"]), float(d["wall_s"]), float(d["train_s"]),
                  [Point(**p) for p in d["points"]], int(d["samples"]), str(d.get("placement", "shared")),
                  str(d.get("off_policy", "tis")), dict(d.get("cpus") or {})) for d in json.loads(path.read_text())]


def settings_of(curves: list[Curve]) -> tuple[str, str]:
    """The one placement and correction of ``curves``; ``SystemExit`` when they mix (no fair comparison)."""
    kinds = sorted({(c.placement, c.off_policy) for c in curves})
    if len(kinds) > 1:
        raise SystemExit("the curves mix placements or corrections (placement, off-policy): "
                         + ", ".join(map(str, kinds)) + "; compare runs of one kind at a time")
    return kinds[0] if kinds else ("shared", "tis")


def med_range(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def draw(curves: list[Curve], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"sync": "tab:blue", "one-step": "tab:orange", "async": "tab:green"}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    seen: set[str] = set()
    for c in curves:
        xs = [p.t_s for p in c.points]
        ys = [p.accuracy for p in c.points]
        err = [[p.accuracy - p.lo for p in c.points], [p.hi - p.accuracy for p in c.points]]
        ax.errorbar(xs, ys, yerr=err, color=colours.get(c.mode, "grey"), marker="o", ms=3, lw=1.2, capsize=2,
                    alpha=0.8, label=None if c.mode in seen else c.mode)
        seen.add(c.mode)
    ax.set_xlabel("wall-clock seconds since training started")
    ax.set_ylabel("held-out accuracy (95% Wilson interval)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="smollm2 or a HF directory (default: the tiny LM)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seeds", default="0,1,2", help="seeds to run (empty: none, only the --with curves)")
    p.add_argument("--steps", type=int, default=None, help="default: the main job's (40 tiny, 12 with --model)")
    p.add_argument("--eval-every", type=int, default=None, help="default: steps / 4")
    p.add_argument("--eval-groups", type=int, default=None, help="held-out problems per eval (default: the job's)")
    p.add_argument("--n-groups", type=int, default=None)
    p.add_argument("--n-samples", type=int, default=None)
    p.add_argument("--placement", choices=PLACEMENTS, default="shared",
                   help="rollout-bus run's --placement for every run (disaggregated: engines and trainer on "
                        "disjoint CPUs)")
    p.add_argument("--engine-cpus", default=None, metavar="LIST", help="disaggregated: the engines' side's CPUs")
    p.add_argument("--trainer-cpus", default=None, metavar="LIST", help="disaggregated: the trainer's CPUs")
    p.add_argument("--off-policy", choices=OFF_POLICIES, default="tis", help="the trainer's off-policy correction")
    p.add_argument("--png", type=Path, default=None, help="draw accuracy against time here")
    p.add_argument("--json", type=Path, default=None,
                   help="write every curve here, the --with ones too (rewritten after each run, so a stopped "
                        "bench keeps its runs)")
    p.add_argument("--with", dest="with_json", type=Path, action="append", default=[],
                   help="add the curves of an earlier --json file (other seeds) to the summary and the plot")
    ns = p.parse_args(argv)
    modes = ns.modes.split(",")
    if "sync" not in modes:
        raise SystemExit("--modes must include sync (the baseline each mode is timed against)")
    seeds = [int(s) for s in ns.seeds.split(",") if s.strip()]  # none: only summarise the --with curves
    if not seeds and not ns.with_json:
        raise SystemExit("--seeds is empty and no --with file gives curves: nothing to run or summarise")
    # the main job's settings (``rollout-bus run``'s, with ``--model`` its HF-model defaults), the same for every mode
    settings: dict[str, Any] = dict(MODEL_DEFAULTS) if ns.model else {}
    for name in ("steps", "eval_groups", "n_groups", "n_samples"):
        if getattr(ns, name) is not None:
            settings[name] = getattr(ns, name)
    steps = int(settings.setdefault("steps", RunConfig().steps))
    eval_every = ns.eval_every or max(1, steps // 4)
    try:
        placement = plan(ns.placement, engine_cpus=ns.engine_cpus, trainer_cpus=ns.trainer_cpus, gpus=())
    except PlacementError as exc:
        raise SystemExit(str(exc)) from None
    load_before = os.getloadavg()
    print(f"modes {', '.join(modes)}; seeds {seeds}; {steps} steps, eval every {eval_every}; model "
          f"{ns.model or 'tiny LM'}; placement {ns.placement}, off-policy {ns.off_policy}; {os.cpu_count()} CPUs, "
          f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} before", flush=True)
    curves: list[Curve] = []
    for earlier in ns.with_json:
        for c in load_curves(earlier):
            if c.seed in seeds:
                raise SystemExit(f"--with {earlier}: seed {c.seed} is also run now; give each seed once")
            if any((c.mode, c.seed) == (d.mode, d.seed) for d in curves):
                raise SystemExit(f"--with {earlier}: {c.mode} seed {c.seed} is in an earlier --with file too")
            curves.append(c)
    server = private_redis() if seeds else None
    if server is not None and placement.disaggregated and getattr(server, "proc", None) is not None:
        pin_process(server.proc.pid, placement.engine_cpus)  # type: ignore[union-attr]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
            for i, seed in enumerate(seeds):
                order = modes[i % len(modes):] + modes[:i % len(modes)]
                for mode in order:
                    out = Path(tmp) / f"{mode}-{seed}"
                    config = RunConfig(mode=mode, seed=seed, model=ns.model, eval_every=eval_every,
                                       out=str(out), redis_url=server.url,
                                       namespace=f"learn-{mode}-{seed}-{int(time.time())}",
                                       progress=False, plot=False, placement=ns.placement,
                                       engine_cpus=ns.engine_cpus, trainer_cpus=ns.trainer_cpus,
                                       off_policy=ns.off_policy, **settings)
                    result = run_job(config)
                    curve = read_curve(out, mode, seed, result.wall_s)
                    curve.placement, curve.off_policy = ns.placement, ns.off_policy
                    placed = json.loads((out / "summary.json").read_text()).get("placement") or {}
                    curve.cpus = placed.get("observed") or {}
                    curves.append(curve)
                    pts = " ".join(f"{p.step}:{p.accuracy:.2f}@{p.t_s:.0f}s" for p in curve.points)
                    print(f"  seed {seed} {mode:>8}: train {curve.train_s:.1f} s, run {curve.wall_s:.1f} s, "
                          f"{curve.samples} samples; accuracy step:acc@time {pts}; load average "
                          f"{os.getloadavg()[0]:.2f}; CPUs {curve.cpus}", flush=True)
                    if ns.json is not None:
                        save_curves(curves, ns.json)
    finally:
        if server is not None:
            server.stop()
    if ns.json is not None:
        save_curves(curves, ns.json)  # every curve, the --with ones too
    kind = settings_of(curves)
    sync_final = {c.seed: c.final for c in curves if c.mode == "sync"}
    unpaired = sorted({c.seed for c in curves} - set(sync_final))
    if unpaired:  # e.g. a stopped bench's file: no sync run to time the other modes against
        print(f"seeds without a sync run, left out of the comparison: {unpaired}")
        curves = [c for c in curves if c.seed in sync_final]
    all_seeds = sorted({c.seed for c in curves})
    print()
    print(f"medians over {len(all_seeds)} seeds (min-max); time from the end of the eval before training")
    print(f"{'mode':>8}  {'train s':>22}  {'final accuracy':>22}  {'s to sync final acc':>22}  {'reached':>7}  "
          f"{'x sync time':>18}")
    summary: dict[str, Any] = {"load_before": load_before[0], "placement": kind[0], "off_policy": kind[1]}
    sync_times = {c.seed: c.time_to(sync_final[c.seed]) for c in curves if c.mode == "sync"}
    for mode in modes:
        mine = [c for c in curves if c.mode == mode]
        reach = [c.time_to(sync_final[c.seed]) for c in mine]
        got = [t for t in reach if t is not None]
        ratios = [t / base for c, t in zip(mine, reach, strict=True)
                  if t is not None and (base := sync_times.get(c.seed))]
        print(f"{mode:>8}  {med_range([c.train_s for c in mine], '{:.1f}'):>22}  "
              f"{med_range([c.final for c in mine]):>22}  {med_range(got, '{:.1f}'):>22}  "
              f"{len(got)}/{len(mine):<5}  {med_range(ratios, '{:.2f}'):>18}")
        summary[mode] = {"train_s": [c.train_s for c in mine], "final": [c.final for c in mine], "reach_s": reach}
    load_after = os.getloadavg()
    print(f"load average {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} after")
    if ns.png is not None:
        seed_list = ",".join(map(str, all_seeds))
        when = f"load {load_before[0]:.2f} before" if seeds else "curves of earlier runs"
        draw(curves, ns.png, f"{ns.model or 'tiny LM'}: {steps} steps x equal samples, seeds {seed_list}; "
                             f"{kind[0]}, {kind[1]}; {when}")
        print(f"plot: {ns.png}")
    return summary


if __name__ == "__main__":
    main()
