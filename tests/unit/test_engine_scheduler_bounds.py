"""The scheduler on the real tiny LM, in process: a sequence whose sampling fails ends alone, the queue
of waiting sequences is bounded (429), and aborting by rid costs O(1) per sequence."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from rollout_bus.engine.errors import Overloaded
from rollout_bus.engine.protocol import SamplingParams, SequenceSpec
from rollout_bus.engine.scheduler import Scheduler, SchedulerConfig
from rollout_bus.engine.sequence import Progress, Seq
from rollout_bus.engine.served import LoraLimits
from rollout_bus.engine.tiny_model import TinyServed
from rollout_bus.engine.waiting import WaitQueue
from rollout_bus.lm.tokenizer import encode
from tests.engine_proc import make_weights_dir

PROMPT = tuple(encode("7+8=", add_bos=True))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyServed:
    path = make_weights_dir(tmp_path_factory.mktemp("tiny") / "m", seed=0)
    return TinyServed(str(path), torch.device("cpu"), "0", LoraLimits(enabled=False))


@pytest.fixture()
def scheduler(model: TinyServed) -> Iterator[Scheduler]:
    sched = Scheduler(model, SchedulerConfig(max_queued_seqs=100, idle_poll_s=0.05))
    sched.start()
    yield sched
    sched.stop()


class Finals:
    """Collects the final progress of each sequence, by rid."""

    def __init__(self) -> None:
        self.done: dict[str, Progress] = {}
        self.changed = threading.Condition()

    def sink(self, progress: Progress) -> None:
        if progress.finish is not None:
            with self.changed:
                self.done[progress.spec.rid] = progress
                self.changed.notify_all()

    def wait(self, count: int, timeout_s: float = 30.0) -> dict[str, Progress]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.done) >= count, timeout_s), self.done
        return self.done


def seq(rid: str, finals: Finals, **params: object) -> Seq:
    spec = SequenceSpec(rid=rid, input_ids=PROMPT, params=SamplingParams(**params),  # type: ignore[arg-type]
                        lora=None, seed=1, return_logprob=True, return_text_in_logprobs=False)
    return Seq(spec, finals.sink)


def test_a_sequence_whose_sampling_fails_ends_alone_and_the_others_of_its_step_complete(scheduler: Scheduler) -> None:
    finals = Finals()
    # 1e-300 is 0 in float32: this row's distribution cannot be sampled (it used to abort the whole batch)
    bad = seq("bad", finals, temperature=1e-300, max_new_tokens=6, ignore_eos=True)
    good = [seq(f"good{i}", finals, temperature=t, max_new_tokens=6, ignore_eos=True, top_k=k)
            for i, (t, k) in enumerate([(1.0, -1), (0.0, -1), (0.7, 5)])]
    scheduler.submit([bad, *good]).result(10)  # one submit: all four are prefilled in the same step
    done = finals.wait(4)
    failed = done["bad"].finish
    assert failed is not None and failed["type"] == "abort" and failed["status_code"] == 500
    assert "sampling failed" in failed["message"]
    for other in good:
        finish = done[other.rid].finish
        assert finish == {"type": "length", "length": 6}, finish
        assert len(done[other.rid].output_ids) == 6
    assert scheduler.counts == (0, 0) and scheduler.alive


def test_a_submit_past_the_queue_bound_is_refused_whole_with_the_reason(scheduler: Scheduler) -> None:
    finals = Finals()
    scheduler.pause("in_place").result(10)
    try:
        scheduler.submit([seq(f"a{i}", finals, max_new_tokens=1) for i in range(90)]).result(10)
        with pytest.raises(Overloaded, match=r"90 sequence\(s\) wait and this request adds 11, over --max-queued-seqs 100"):
            scheduler.submit([seq(f"b{i}", finals, max_new_tokens=1) for i in range(11)]).result(10)
        assert scheduler.counts == (0, 90)
        scheduler.submit([seq(f"c{i}", finals, max_new_tokens=1) for i in range(10)]).result(10)
        assert scheduler.counts == (0, 100)
    finally:
        scheduler.unpause().result(10)
    assert len(finals.wait(100)) == 100


def test_the_wait_queue_keeps_its_order_and_puts_sequences_back_at_the_head() -> None:
    finals = Finals()
    queue = WaitQueue()
    a, b, c, d = (seq(r, finals) for r in "abcd")
    for s in (a, b, c):
        queue.append(s)
    queue.remove(b)
    assert [s.rid for s in queue] == ["a", "c"] and b not in queue and a in queue
    queue.extendleft([d, b])
    assert [s.rid for s in queue] == ["d", "b", "a", "c"]
    assert queue.popleft() is d
    queue.appendleft(c)
    assert [s.rid for s in queue] == ["c", "b", "a"] and len(queue) == 3
    with pytest.raises(KeyError):
        queue.remove(seq("a", finals))  # the same rid, another sequence: not this one


def many(prefix: str, count: int, finals: Finals) -> list[Seq]:
    params = SamplingParams(max_new_tokens=1)
    return [Seq(SequenceSpec(f"{prefix}{i}", PROMPT, params, None, 1, False, False), finals.sink) for i in range(count)]


def test_removing_every_waiting_sequence_one_by_one_takes_linear_time() -> None:
    queue = WaitQueue()
    seqs = many("r", 100_000, Finals())
    for s in seqs:
        queue.append(s)
    started = time.perf_counter()
    for s in seqs[len(seqs) // 2:] + seqs[: len(seqs) // 2]:  # from the middle, as aborts arrive
        queue.remove(s)
    took = time.perf_counter() - started
    assert not queue and took < 3.0, f"{took:.2f} s"  # 0.3 s here; a deque's remove made this ~5e9 steps


def test_aborting_thousands_of_waiting_sequences_by_rid_does_not_stall_the_scheduler(model: TinyServed) -> None:
    sched = Scheduler(model, SchedulerConfig(max_queued_seqs=30_000, idle_poll_s=0.05))
    sched.start()
    try:
        finals = Finals()
        sched.pause("in_place").result(10)
        seqs = many("req_", 25_600, finals)  # the finding's request: 400 prompts times n = 64
        sched.submit(seqs).result(30)
        started = time.perf_counter()
        for s in seqs[::-1]:  # one exact abort per sequence, newest first: each used to rescan the queue
            sched.abort(s.rid, "the client went away", exact=True)
        assert sched.abort("req_0", "none left", exact=True).result(60) == 0
        took = time.perf_counter() - started
        assert sched.counts == (0, 0) and len(finals.done) == 25_600
        assert took < 20.0, f"{took:.2f} s"  # 0.5-4.5 s here on 2 busy cores; the rescanning queue took 247 s
        batch = many("batch_", 10_000, finals)
        sched.submit(batch).result(30)
        started = time.perf_counter()
        assert sched.abort_seqs([*batch, *seqs[:10]], "gone").result(30) == 10_000  # only those in flight
        assert time.perf_counter() - started < 2.0 and sched.counts == (0, 0)
    finally:
        sched.stop()
