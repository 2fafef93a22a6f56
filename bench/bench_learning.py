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

Accuracy at equal samples, paired: each mode's final eval against sync's final eval of the same seed,
problem by problem (the eval log's ``[index, correct, samples]`` rows), as the mean difference with a
95% paired-bootstrap interval (``tasks.stats.paired_difference``), per seed and pooled over the seeds
(every seed's problems together). ``--eval-groups`` sets the problems per eval: the pooled interval's
half-width is printed, to show whether the comparison can tell the modes apart at +-5 points.

Where the trainer's time goes, per mode (medians over seeds, as shares of the training time): its
updates (``time/update_s``), waiting for batches (``time/batch_wait_s``), writing and announcing
weights (``time/weight_publish_s``), waiting until the engines serve them (``time/serving_wait_s``) and
checkpointing (``time/checkpoint_s``).
The rest (``other``) is the trainer's own bookkeeping between those: taking and decoding the batch, the
staleness split, requests for the next rollouts. A trainer that mostly waits for batches has little
for an overlapping mode to hide.

Exact evaluation (``--exact``, the default for the tiny LM, whose task allows it: ``tasks.exact``): every
run keeps each weight version it trains, and after it the bench scores the initial weights and the
version of every ``--eval-every``-th step on the whole task (the 100 one-digit sums), as the exact
probability that a sample at the rollouts' temperature is right. No eval runs on the engines during
training (the run's own evals are only the small ones before and after, which mark where training
starts), so no mode's timing carries eval work, and the accuracies carry no sampling noise: two modes
of one seed differ only by their training. The paired comparison is then exact per seed, and pooled
over seeds as the mean of the per-seed differences with a t interval (seed-to-seed variation is all
the uncertainty left).

``--png`` (default ``learning.png`` when seeds are run) draws accuracy against time, one line per mode
and seed, with the intervals.

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
from rollout_bus.lm.files import version_dir  # noqa: E402
from rollout_bus.tasks.stats import Interval, counts_of, paired_difference  # noqa: E402

MODES = ("sync", "one-step", "async")
TRAINER_TIMES = {"update": "time/update_s", "batch wait": "time/batch_wait_s", "publish": "time/weight_publish_s",
                 "serving wait": "time/serving_wait_s", "checkpoint": "time/checkpoint_s"}
"""Where the trainer's time goes: the step log's ``time/*`` scalars, summed over the run."""


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
    final_problems: list[list[int]] = field(default_factory=list)
    """The final eval's ``[index, correct, samples]`` rows (empty in files from before they were logged)."""
    trainer_s: dict[str, float] = field(default_factory=dict)
    """Seconds the trainer spent per ``TRAINER_TIMES`` part, summed over its steps."""
    final_exact: list[float] = field(default_factory=list)
    """With ``--exact``: the final weights' probability of a right answer, per problem of the whole task."""

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
        if e["phase"] == "after":
            curve.final_problems = [list(map(int, row)) for row in e.get("problems") or []]
    curve.trainer_s = {part: float(sum(s["metrics"].get(key, 0.0) for s in steps))
                       for part, key in TRAINER_TIMES.items()}
    return curve


def exact_points(out: Path, curve: Curve, steps: list[int], *, digits: int, temperature: float,
                 policy: str = "p0") -> None:
    """Replace ``curve``'s points by exact evaluations (``tasks.exact``) of the initial weights and the versions
    of ``steps``, each placed when its trainer step finished; the last one's per-problem values are kept."""
    from rollout_bus.lm.model import load_model
    from rollout_bus.tasks.exact import exact_accuracy

    metrics = out / "metrics"
    logged = [json.loads(line) for f in sorted(metrics.glob("*.jsonl")) if not f.name.endswith("-eval.jsonl")
              for line in f.read_text().splitlines()]
    evals = [json.loads(line) for f in sorted(metrics.glob("*-eval.jsonl")) for line in f.read_text().splitlines()]
    t0 = next(e["time"] for e in evals if e["phase"] == "before")
    step_time = {int(s["step"]): float(s["time"]) - t0 for s in logged}
    step_version = {int(s["step"]): int(s["weight_version"]) for s in logged}  # a step with no signal makes none
    inits = sorted((out / "init").glob("warm-*"))
    points: list[Point] = []
    for step in [0, *steps]:
        version = step_version.get(step, 0)
        directory = inits[0] if version == 0 and inits else version_dir(out / "weights", policy, version)
        values = exact_accuracy(load_model(directory), digits=digits, temperature=temperature)
        accuracy = sum(values) / len(values)
        points.append(Point(step, 0.0 if step == 0 else step_time[step], accuracy, accuracy, accuracy))
        curve.final_exact = values
    curve.points = points


def exact_against_sync(curves: list[Curve], mode: str) -> tuple[dict[int, Interval], Interval]:
    """``mode``'s exact final accuracy minus sync's per seed (exact: no interval), and their mean over the seeds
    with a 95% t interval."""
    sync = {c.seed: c for c in curves if c.mode == "sync" and c.final_exact}
    per_seed: dict[int, Interval] = {}
    for c in curves:
        if c.mode == mode and c.final_exact and c.seed in sync and len(c.final_exact) == len(sync[c.seed].final_exact):
            diff = statistics.fmean(a - b for a, b in zip(c.final_exact, sync[c.seed].final_exact, strict=True))
            per_seed[c.seed] = Interval(diff, diff, diff, len(c.final_exact))
    diffs = [d.value for d in per_seed.values()]
    if not diffs:
        return per_seed, Interval(float("nan"), float("nan"), float("nan"), 0)
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return per_seed, Interval(mean, float("nan"), float("nan"), 1)
    half = T975[min(len(diffs) - 1, len(T975) - 1)] * statistics.stdev(diffs) / len(diffs) ** 0.5
    return per_seed, Interval(mean, mean - half, mean + half, len(diffs))


T975 = [float("nan"), 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086]
"""Student's t, two-sided 95%, by degrees of freedom (the last for 20 and more: slightly wide beyond)."""


def paired_final(curve: Curve, sync: Curve, *, key_offset: int = 0) -> dict[int, tuple[tuple[int, int],
                                                                                     tuple[int, int]]]:
    """The problems both final evals scored: key -> (sync's (correct, samples), ``curve``'s)."""
    mine, base = counts_of(curve.final_problems), counts_of(sync.final_problems)
    return {key_offset + i: (base[i], mine[i]) for i in sorted(set(mine) & set(base))}


def paired_against_sync(curves: list[Curve], mode: str) -> tuple[dict[int, Interval], Interval]:
    """``mode``'s final accuracy minus sync's, paired by problem: per seed, and pooled over the seeds."""
    sync = {c.seed: c for c in curves if c.mode == "sync"}
    per_seed: dict[int, Interval] = {}
    pooled: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}
    for c in curves:
        if c.mode != mode or c.seed not in sync:
            continue
        pairs = paired_final(c, sync[c.seed])
        if not pairs:
            continue
        per_seed[c.seed] = paired_difference({k: b for k, (b, _) in pairs.items()},
                                             {k: m for k, (_, m) in pairs.items()})
        pooled.update(paired_final(c, sync[c.seed], key_offset=(c.seed + 1) * 10_000_000))
    together = paired_difference({k: b for k, (b, _) in pooled.items()}, {k: m for k, (_, m) in pooled.items()})
    return per_seed, together


def signed(interval: Interval) -> str:
    if interval.n == 0:
        return "-"
    return f"{interval.value:+.3f} [{interval.lo:+.3f}, {interval.hi:+.3f}] on {interval.n}"


def save_curves(curves: list[Curve], path: Path) -> None:
    path.write_text(json.dumps([{"mode": c.mode, "seed": c.seed, "wall_s": c.wall_s, "train_s": c.train_s,
                                 "samples": c.samples, "placement": c.placement, "off_policy": c.off_policy,
                                 "cpus": c.cpus, "points": [vars(p) for p in c.points],
                                 "final_problems": c.final_problems, "trainer_s": c.trainer_s,
                                 "final_exact": c.final_exact}
                                for c in curves], indent=1))


def load_curves(path: Path) -> list[Curve]:
    """Curves written by ``--json`` (a file from before ``--placement`` and ``--off-policy``: shared, tis)."""
    return [Curve(str(d["mode"]), int(d["seed"]), float(d["wall_s"]), float(d["train_s"]),
                  [Point(**p) for p in d["points"]], int(d["samples"]), str(d.get("placement", "shared")),
                  str(d.get("off_policy", "tis")), dict(d.get("cpus") or {}),
                  [list(map(int, r)) for r in d.get("final_problems") or []],
                  {str(k): float(v) for k, v in (d.get("trainer_s") or {}).items()},
                  [float(v) for v in d.get("final_exact") or []])
            for d in json.loads(path.read_text())]


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
    """Accuracy against time, one thin line per mode and seed; with exact evaluations (no interval per point),
    each mode's mean over the seeds at each evaluated step too, at the median time, with a 95% t interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"sync": "tab:blue", "one-step": "tab:orange", "async": "tab:green"}
    exact = bool(curves) and all(p.lo == p.hi == p.accuracy for c in curves for p in c.points)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    seen: set[str] = set()
    for c in curves:
        xs = [p.t_s for p in c.points]
        ys = [p.accuracy for p in c.points]
        colour = colours.get(c.mode, "grey")
        if exact:
            ax.plot(xs, ys, color=colour, lw=0.8, alpha=0.3)
            continue
        err = [[p.accuracy - p.lo for p in c.points], [p.hi - p.accuracy for p in c.points]]
        ax.errorbar(xs, ys, yerr=err, color=colour, marker="o", ms=3, lw=1.2, capsize=2,
                    alpha=0.8, label=None if c.mode in seen else c.mode)
        seen.add(c.mode)
    if exact:
        for mode in dict.fromkeys(c.mode for c in curves):
            by_step: dict[int, list[Point]] = {}
            for c in curves:
                if c.mode == mode:
                    for p in c.points:
                        by_step.setdefault(p.step, []).append(p)
            steps = sorted(by_step)
            xs = [statistics.median(p.t_s for p in by_step[s]) for s in steps]
            ys = [statistics.fmean(p.accuracy for p in by_step[s]) for s in steps]
            err = [T975[min(len(by_step[s]) - 1, len(T975) - 1)] * statistics.stdev(p.accuracy for p in by_step[s])
                   / len(by_step[s]) ** 0.5 if len(by_step[s]) > 1 else 0.0 for s in steps]
            ax.errorbar(xs, ys, yerr=err, color=colours.get(mode, "grey"), marker="o", ms=4, lw=2, capsize=3,
                        label=f"{mode} (mean of {len(by_step[steps[0]])} seeds, 95% t interval)")
    ax.set_xlabel("wall-clock seconds since training started")
    ax.set_ylabel("exact accuracy on the whole task" if exact else "held-out accuracy (95% Wilson interval)")
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
    p.add_argument("--lr", type=float, default=None, help="the trainer's learning rate (default: the job's)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="score the whole task exactly from the saved versions (default: on for the tiny LM)")
    p.add_argument("--placement", choices=PLACEMENTS, default="shared",
                   help="rollout-bus run's --placement for every run (disaggregated: engines and trainer on "
                        "disjoint CPUs)")
    p.add_argument("--engine-cpus", default=None, metavar="LIST", help="disaggregated: the engines' side's CPUs")
    p.add_argument("--trainer-cpus", default=None, metavar="LIST", help="disaggregated: the trainer's CPUs")
    p.add_argument("--light-cpus", default=None, metavar="LIST",
                   help="disaggregated: the executors' and redis' CPUs (default: with the engines)")
    p.add_argument("--off-policy", choices=OFF_POLICIES, default="tis", help="the trainer's off-policy correction")
    p.add_argument("--weight-sync", choices=("disk", "broadcast"), default="disk",
                   help="how full weights reach the engines (rollout-bus run's --weight-sync)")
    p.add_argument("--png", type=Path, default=None,
                   help="draw accuracy against time here (default: learning.png when seeds are run)")
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
    for name in ("steps", "eval_groups", "n_groups", "n_samples", "lr"):
        if getattr(ns, name) is not None:
            settings[name] = getattr(ns, name)
    steps = int(settings.setdefault("steps", RunConfig().steps))
    eval_every = ns.eval_every or max(1, steps // 4)
    exact = ns.model is None if ns.exact is None else ns.exact
    if exact and ns.model is not None:
        raise SystemExit("--exact needs the tiny LM's task (one-digit sums); a HF model is evaluated by sampling")
    exact_steps = [*range(eval_every, steps, eval_every), steps]
    run_settings = dict(settings)
    if exact:  # only the small evals before and after on the engines; every version kept for the exact ones
        run_settings.setdefault("eval_groups", 16)
    try:
        placement = plan(ns.placement, engine_cpus=ns.engine_cpus, trainer_cpus=ns.trainer_cpus, gpus=(),
                         light_cpus=ns.light_cpus)
    except PlacementError as exc:
        raise SystemExit(str(exc)) from None
    load_before = os.getloadavg()
    print(f"modes {', '.join(modes)}; seeds {seeds}; {steps} steps, eval every {eval_every}; model "
          f"{ns.model or 'tiny LM'}; placement {ns.placement}, off-policy {ns.off_policy}, weights by {ns.weight_sync}; "
          f"{os.cpu_count()} CPUs, "
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
        pin_process(server.proc.pid, placement.cpus("redis-server") or placement.engine_cpus)  # type: ignore[union-attr]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
            for i, seed in enumerate(seeds):
                order = modes[i % len(modes):] + modes[:i % len(modes)]
                for mode in order:
                    out = Path(tmp) / f"{mode}-{seed}"
                    config = RunConfig(mode=mode, seed=seed, model=ns.model, eval_every=0 if exact else eval_every,
                                       out=str(out), redis_url=server.url,
                                       namespace=f"learn-{mode}-{seed}-{int(time.time())}",
                                       progress=False, plot=False, placement=ns.placement,
                                       engine_cpus=ns.engine_cpus, trainer_cpus=ns.trainer_cpus,
                                       light_cpus=ns.light_cpus,
                                       off_policy=ns.off_policy, weight_sync=ns.weight_sync,
                                       trainer_args=["--keep-versions", "0"] if exact else [], **run_settings)
                    result = run_job(config)
                    curve = read_curve(out, mode, seed, result.wall_s)
                    if exact:
                        exact_points(out, curve, exact_steps, digits=config.digits, temperature=config.temperature)
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
        summary[mode] = {"train_s": [c.train_s for c in mine], "final": [c.final for c in mine], "reach_s": reach,
                         "x_sync": ratios}
    print()
    print("where the trainer's time goes, share of the training time (median over seeds):")
    for mode in modes:
        mine = [c for c in curves if c.mode == mode and c.trainer_s and c.train_s > 0]
        if mine:
            shares = {part: statistics.median(c.trainer_s.get(part, 0.0) / c.train_s for c in mine)
                      for part in TRAINER_TIMES}
            shares["other"] = statistics.median(1 - sum(c.trainer_s.values()) / c.train_s for c in mine)
            print(f"{mode:>8}  " + "  ".join(f"{part} {share:.2f}" for part, share in shares.items()))
            summary[mode]["trainer_share"] = shares
    print()
    exactly = any(c.final_exact for c in curves)
    print("final accuracy at equal samples minus sync's, " + (
        "exact per seed (the whole task); over the seeds, their mean with a 95% t interval:" if exactly else
        "paired by problem (95% paired bootstrap):"))
    for mode in modes:
        if mode == "sync":
            continue
        per_seed, pooled = exact_against_sync(curves, mode) if exactly else paired_against_sync(curves, mode)
        if not per_seed:
            print(f"{mode:>8}  no per-problem rows (curves from before they were logged)")
            continue
        half = (pooled.hi - pooled.lo) / 2
        seeds_text = "; ".join(f"seed {seed} {d.value:+.3f}" if exactly else f"seed {seed} {signed(d)}"
                               for seed, d in sorted(per_seed.items()))
        together = (f"mean over {pooled.n} seeds {pooled.value:+.3f} [{pooled.lo:+.3f}, {pooled.hi:+.3f}]" if exactly
                    else f"pooled {signed(pooled)}")
        print(f"{mode:>8}  {seeds_text}; {together} (half-width {half:.3f})")
        summary[mode]["paired_vs_sync"] = {"per_seed": {s: vars(d) for s, d in per_seed.items()},
                                           "pooled": vars(pooled)}
    load_after = os.getloadavg()
    print(f"load average {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} after")
    png = ns.png if ns.png is not None or not seeds else Path("learning.png")
    if png is not None:
        seed_list = ",".join(map(str, all_seeds))
        when = f"load {load_before[0]:.2f} before" if seeds else "curves of earlier runs"
        draw(curves, png, f"{ns.model or 'tiny LM'}: {steps} steps x equal samples, seeds {seed_list}; "
                             f"{kind[0]}, {kind[1]}; {when}")
        print(f"plot: {png}")
    return summary


if __name__ == "__main__":
    main()
