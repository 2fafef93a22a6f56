"""Where a run's processes may run: ``--placement shared|disaggregated``.

``shared`` (the default) leaves every process where the run was started: the engines and the
trainer share every CPU the run may use. ``disaggregated`` stands in for the separate inference
and training pools of a real deployment: the engines and the trainer get disjoint CPU sets.

- **Which side**: the trainers (``trainer-<policy>``) are the trainer side. Everything else the run
  starts is light beside them and goes with the engines: the controller (its engines inherit its
  set), the executors (tokenising, rewards, HTTP to the engines), the eval executor, a recorder,
  the bus exporter and the run's private redis-server. The launcher itself stays where it was
  started (it mostly waits on the trainer stream), and so does the warm start it runs first.
- **How**: a child's set is applied in the child between fork and exec (``child_setup``, the
  ``preexec_fn`` of its ``Popen``), so the role starts on it and every thread and child it makes
  inherits it; a restarted child gets the same set. The private redis-server, started before the
  roles, is pinned thread by thread (``pin_process``).
- **Threads**: ``OMP_NUM_THREADS`` of each side is its CPUs over the processes that compute on it
  (the engines, the trainers); the launcher passes the same count as ``--torch-threads``.
- **The split**: ``--engine-cpus`` and ``--trainer-cpus`` (``0-3,6``; one given, the other is the
  rest), else half and half of the CPUs the launcher may use, rounded toward the engines (2 CPUs:
  engines ``{0}``, trainer ``{1}``). A launcher on one CPU refuses ``disaggregated``.
- **The light roles' own set**: ``--light-cpus`` moves the bus's CPU work off the engines' set: the
  executors, the eval executor, a recorder, the exporter and the private redis-server (the ``light``
  side) go there, the controller and its engines stay. In a real deployment that work runs on the
  hosts' CPUs, not on the inference GPUs; on a CPU machine the engines' set stands in for those GPUs,
  and the executors' tokenising, HTTP and payload work would otherwise compete with generation. It may
  overlap either side (on 2 CPUs: ``--light-cpus 1``, beside the trainer).
- **GPUs**, where there are any (``CUDA_VISIBLE_DEVICES``, else what torch counts): split the same
  way into disjoint ``CUDA_VISIBLE_DEVICES``; a single GPU goes to the trainer (the CPU engines need
  none).
- **Read back**: ``observe`` records each running process's CPUs as the kernel reports them
  (``os.sched_getaffinity(pid)``) and its ``CUDA_VISIBLE_DEVICES`` (``/proc/<pid>/environ``), for
  ``summary.json`` and the run's log: what the processes got, not what was asked.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

PlacementMode = Literal["shared", "disaggregated"]
PLACEMENTS: tuple[str, ...] = get_args(PlacementMode)
ENGINES, TRAINER, LIGHT = "engines", "trainer", "light"
HEAVY_ENGINE_SIDE = ("controller", "engine")
"""Name prefixes that stay on the engines' set when the light roles have a set of their own."""


class PlacementError(ValueError):
    """A placement that cannot be made; the message says why and what to give instead."""


def parse_cpus(spec: str) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``; ``PlacementError`` naming the bad part."""
    cpus: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise PlacementError(f"CPU list {spec!r}: {part!r} is not a CPU number or a range N-M") from None
        if first < 0 or last < first:
            raise PlacementError(f"CPU list {spec!r}: {part!r} is not a CPU number or a range N-M with N <= M")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def side_of(name: str) -> str:
    """The side of a run's process, by its name: the trainers, or the engines' side for everything else."""
    return TRAINER if name.startswith("trainer-") else ENGINES


@dataclass(frozen=True)
class Placement:
    mode: str = "shared"
    engine_cpus: tuple[int, ...] = ()
    trainer_cpus: tuple[int, ...] = ()
    engine_gpus: tuple[str, ...] | None = None
    """``CUDA_VISIBLE_DEVICES`` of the engines' side (empty: none); None: no GPUs, the variable is left alone."""
    trainer_gpus: tuple[str, ...] | None = None
    engine_threads: int = 1
    """Torch threads of each engine (its side's CPUs over the engines)."""
    trainer_threads: int = 1
    light_cpus: tuple[int, ...] | None = None
    """``--light-cpus``: the light roles' set (None: they go with the engines)."""

    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregated"

    def side(self, name: str) -> str:
        """``side_of``, with the light roles apart when they have a set of their own."""
        side = side_of(name)
        if side == ENGINES and self.light_cpus is not None and not name.startswith(HEAVY_ENGINE_SIDE):
            return LIGHT
        return side

    def cpus(self, name: str) -> tuple[int, ...] | None:
        """The CPU set of process ``name``; None: where the launcher runs (shared)."""
        if not self.disaggregated:
            return None
        side = self.side(name)
        if side == LIGHT and self.light_cpus is not None:
            return self.light_cpus
        return self.trainer_cpus if side == TRAINER else self.engine_cpus

    def env(self, name: str) -> dict[str, str]:
        """The environment process ``name`` gets on top of the run's (thread counts, GPUs)."""
        if not self.disaggregated:
            return {}
        trainer = self.side(name) == TRAINER
        out = {"OMP_NUM_THREADS": str(self.trainer_threads if trainer else self.engine_threads)}
        gpus = self.trainer_gpus if trainer else self.engine_gpus
        if gpus is not None:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        return out

    def planned(self) -> dict[str, Any]:
        return {"mode": self.mode, "engine_cpus": list(self.engine_cpus), "trainer_cpus": list(self.trainer_cpus),
                "engine_gpus": None if self.engine_gpus is None else list(self.engine_gpus),
                "trainer_gpus": None if self.trainer_gpus is None else list(self.trainer_gpus),
                "engine_threads": self.engine_threads, "trainer_threads": self.trainer_threads,
                "light_cpus": None if self.light_cpus is None else list(self.light_cpus)}


def available_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def visible_gpus() -> tuple[str, ...]:
    """The GPUs this process sees: ``CUDA_VISIBLE_DEVICES`` when set, else the devices torch counts."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return tuple(g.strip() for g in env.split(",") if g.strip())
    try:
        import torch
    except ImportError:
        return ()
    return tuple(str(i) for i in range(torch.cuda.device_count()))


def halves(items: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The engines' half (rounded up) and the trainer's."""
    k = math.ceil(len(items) / 2)
    return tuple(items[:k]), tuple(items[k:])


def plan(mode: str, *, engine_cpus: str | None = None, trainer_cpus: str | None = None, engines: int = 1,
         trainers: int = 1, available: Sequence[int] | None = None,
         gpus: Sequence[str] | None = None, light_cpus: str | None = None) -> Placement:
    """The run's placement; ``PlacementError`` when ``disaggregated`` cannot be made here."""
    if mode not in PLACEMENTS:
        raise PlacementError(f"placement {mode!r} is not one of {list(PLACEMENTS)}")
    if mode == "shared":
        if engine_cpus is not None or trainer_cpus is not None or light_cpus is not None:
            raise PlacementError("--engine-cpus, --trainer-cpus and --light-cpus need --placement disaggregated")
        return Placement()
    mine = tuple(sorted(available if available is not None else available_cpus()))
    if len(mine) < 2:
        raise PlacementError(f"--placement disaggregated needs at least 2 CPUs to split between the engines and the "
                             f"trainer, and this process may run on {len(mine)} (CPU {', '.join(map(str, mine))}): "
                             "run with --placement shared, or give the run more CPUs")
    eng = _cpus_arg("--engine-cpus", engine_cpus, mine)
    tr = _cpus_arg("--trainer-cpus", trainer_cpus, mine)
    if eng is None and tr is None:
        eng, tr = halves(mine)
    elif eng is None:
        eng = tuple(c for c in mine if c not in set(tr or ()))
    elif tr is None:
        tr = tuple(c for c in mine if c not in set(eng))
    assert eng is not None and tr is not None
    if not eng or not tr:
        raise PlacementError(f"--placement disaggregated: the engines would get CPUs {list(eng)} and the trainer "
                             f"{list(tr)}; each side needs at least one of the CPUs {list(mine)}")
    if set(eng) & set(tr):
        raise PlacementError(f"--engine-cpus {list(eng)} and --trainer-cpus {list(tr)} overlap on "
                             f"{sorted(set(eng) & set(tr))}: disaggregated sides must be disjoint")
    seen = tuple(gpus) if gpus is not None else visible_gpus()
    engine_gpus: tuple[str, ...] | None = None
    trainer_gpus: tuple[str, ...] | None = None
    if len(seen) == 1:
        engine_gpus, trainer_gpus = (), seen
    elif seen:
        engine_gpus, trainer_gpus = halves(seen)
    light = _cpus_arg("--light-cpus", light_cpus, mine)
    return Placement("disaggregated", eng, tr, engine_gpus, trainer_gpus,
                     engine_threads=max(1, len(eng) // max(1, engines)),
                     trainer_threads=max(1, len(tr) // max(1, trainers)), light_cpus=light)


def _cpus_arg(flag: str, spec: str | None, mine: Sequence[int]) -> tuple[int, ...] | None:
    if spec is None:
        return None
    cpus = parse_cpus(spec)
    outside = sorted(set(cpus) - set(mine))
    if outside:
        raise PlacementError(f"{flag} {spec}: CPU {', '.join(map(str, outside))} is not among the CPUs this process "
                             f"may run on ({', '.join(map(str, mine))})")
    return cpus


def child_setup(cpus: Iterable[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that pins the child to ``cpus`` before it execs (None: nothing to do)."""
    if cpus is None:
        return None
    chosen = frozenset(cpus)

    def setup() -> None:
        os.sched_setaffinity(0, chosen)

    return setup


def pin_process(pid: int, cpus: Iterable[int]) -> None:
    """Pin every thread of a running process (one started before its set was known)."""
    chosen = frozenset(cpus)
    tasks = Path(f"/proc/{pid}/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [pid]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, chosen)


def read_affinity(pid: int) -> dict[str, Any] | None:
    """A running process's CPUs (as the kernel has them) and ``CUDA_VISIBLE_DEVICES``; None if it is gone."""
    try:
        cpus = sorted(os.sched_getaffinity(pid))
    except (ProcessLookupError, PermissionError):
        return None
    gpus: list[str] | None = None
    try:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"CUDA_VISIBLE_DEVICES="):
                gpus = [g for g in item.split(b"=", 1)[1].decode().split(",") if g]
    except OSError:
        pass
    return {"pid": pid, "cpus": cpus, "gpus": gpus}


@dataclass
class PlacementRecord:
    """Each process of the run as first seen running: its side, CPUs and GPUs, read back from the kernel."""

    placement: Placement
    processes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def observe(self, name: str, pid: int, side: str | None = None) -> None:
        """Read ``pid``'s placement, once per name (a later pid of the same name, a restart, is read again)."""
        seen = self.processes.get(name)
        if seen is not None and seen["pid"] == pid:
            return
        got = read_affinity(pid)
        if got is not None:
            self.processes[name] = {**got, "side": side or self.placement.side(name)}

    def sides(self) -> dict[str, list[int]]:
        """The CPUs each side's processes got, together (the light side only when it has a set of its own)."""
        out: dict[str, set[int]] = {ENGINES: set(), TRAINER: set()}
        for p in self.processes.values():
            out.setdefault(p["side"], set()).update(p["cpus"])
        return {side: sorted(cpus) for side, cpus in out.items()}

    def to_dict(self) -> dict[str, Any]:
        sides = self.sides()
        return {**self.placement.planned(), "observed": sides,
                "disjoint": not set(sides[ENGINES]) & set(sides[TRAINER]), "processes": dict(sorted(self.processes.items()))}

    def text(self) -> str:
        sides = self.sides()
        names = {side: sorted(n for n, p in self.processes.items() if p["side"] == side) for side in sides}
        gpus = {side: sorted({g for p in self.processes.values() if p["side"] == side for g in (p["gpus"] or [])})
                for side in sides}
        parts = [f"{side} on CPUs {sides[side]}" + (f", GPUs {gpus[side]}" if gpus[side] else "")
                 + f" ({', '.join(names[side])})" for side in (ENGINES, LIGHT, TRAINER) if names.get(side)]
        return f"placement {self.placement.mode} (read back from the running processes): " + "; ".join(parts)
