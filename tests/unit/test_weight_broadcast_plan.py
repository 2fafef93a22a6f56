"""The pieces of weights by collective that need no second process: the bucket plan, the controller's check of
an offer, and the engine's check of a bucket before it receives anything."""

from __future__ import annotations

import pytest
import torch

from rollout_bus.controller.broadcast import offer_problem, split_address
from rollout_bus.controller.versions import Target
from rollout_bus.engine.errors import BadRequest
from rollout_bus.engine.weight_sync import WeightGroups, parse_dtype
from rollout_bus.lm.buckets import bucket_plan, plan_problems

SHAPES = {"a": ("F32", (4, 4)), "b": ("F32", (8,)), "c": ("BF16", (16, 16)), "d": ("F32", (2,))}


def test_buckets_close_at_the_size_and_a_larger_tensor_travels_alone() -> None:
    # a 64 B, b 32 B, c 512 B, d 8 B: sorted by name, closed once the next one would pass 100 B
    assert bucket_plan(SHAPES, 100) == [["a", "b"], ["c"], ["d"]]
    assert bucket_plan(SHAPES, 10_000) == [["a", "b", "c", "d"]]
    assert plan_problems(bucket_plan(SHAPES, 1), SHAPES) == []
    with pytest.raises(ValueError):
        bucket_plan(SHAPES, 0)


def test_a_plan_that_leaves_out_repeats_or_invents_a_tensor_is_named() -> None:
    problems = plan_problems([["a", "a"], [], ["x"]], SHAPES)
    assert any("twice" in p and "'a'" in p for p in problems)
    assert any("left out" in p and "'b'" in p for p in problems)
    assert any("not in the version" in p and "'x'" in p for p in problems)
    assert any("empty" in p for p in problems)


def test_the_controller_uses_an_offer_only_with_an_address_a_backend_and_a_whole_plan() -> None:
    plan = tuple(tuple(b) for b in bucket_plan(SHAPES, 100))
    good = Target("p", 1, "/w", "0" * 64, "/w", group_address="10.0.0.2:29500", group_backend="gloo", buckets=plan)
    assert offer_problem(good, SHAPES) is None
    assert split_address("[::1]:7") == ("[::1]", 7) and split_address("host") is None
    for bad, word in ((Target("p", 1, "/w", "", "/w", group_address="host", group_backend="gloo", buckets=plan),
                       "host:port"),
                      (Target("p", 1, "/w", "", "/w", group_address="h:1", group_backend="mpi", buckets=plan),
                       "backend"),
                      (Target("p", 1, "/w", "", "/w", group_address="h:1", group_backend="gloo", buckets=plan[:1]),
                       "left out")):
        problem = offer_problem(bad, SHAPES)
        assert problem is not None and word in problem


def test_an_engine_checks_every_name_dtype_and_shape_before_receiving() -> None:
    groups = WeightGroups(SHAPES, torch.device("cpu"), timeout_s=1.0)
    buffers = groups._buffers(["a", "c"], ["float32", "torch.bfloat16"], [[4, 4], [16, 16]], "gloo")
    assert {n: (t.dtype, tuple(t.shape)) for n, t in buffers.items()} == {
        "a": (torch.float32, (4, 4)), "c": (torch.bfloat16, (16, 16))}
    for names, dtypes, shapes, word in ((["z"], ["float32"], [[1]], "not a tensor"),
                                        (["a"], ["float16"], [[4, 4]], "dtype"),
                                        (["a"], ["float32"], [[4, 5]], "shape"),
                                        (["a", "a"], ["float32"] * 2, [[4, 4]] * 2, "twice"),
                                        (["a"], ["float32", "float32"], [[4, 4]], "one entry per tensor"),
                                        (["a"], ["floaty"], [[4, 4]], "not a torch dtype"),
                                        ([], [], [], "at least one")):
        with pytest.raises(BadRequest, match=word):
            groups._buffers(names, dtypes, shapes, "gloo")
    with pytest.raises(BadRequest, match="no weight update group"):
        groups.receive("none", ["a"], ["float32"], [[4, 4]], "1")
    assert parse_dtype("bfloat16") is torch.bfloat16


def test_an_engine_refuses_a_group_it_cannot_join_before_trying() -> None:
    groups = WeightGroups(SHAPES, torch.device("cpu"), timeout_s=1.0)
    for args, word in ((("127.0.0.1", 1, 1, 2, "g", "nccl"), "needs an engine on CUDA"),
                       (("127.0.0.1", 1, 0, 2, "g", "gloo"), "rank_offset"),
                       (("127.0.0.1", 1, 2, 2, "g", "gloo"), "rank_offset"),
                       (("127.0.0.1", 0, 1, 2, "g", "gloo"), "not a port"),
                       (("127.0.0.1", 1, 1, 2, "", "gloo"), "must not be empty"),
                       (("127.0.0.1", 1, 1, 2, "g", "mpi"), "backend")):
        with pytest.raises(BadRequest, match=word):
            groups.open(*args)
    with pytest.raises(BadRequest, match="no weight update group"):
        groups.destroy("g")
