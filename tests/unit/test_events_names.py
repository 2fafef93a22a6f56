"""Key names: one module, one namespace, one Redis Cluster hash tag."""

from __future__ import annotations

import inspect
import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from rollout_bus.events.errors import DecodeError
from rollout_bus.events.names import DEFAULT_NAMESPACE, NAME_PATTERN, Keys, check_name, name_problem
from rollout_bus.events.schema import FIELD, Producer, WeightsPublished, decode


def every_key(keys: Keys) -> dict[str, str]:
    """Every stream and key name ``Keys`` can produce (rq queues excepted: rq adds its own prefix)."""
    out: dict[str, str] = {}
    for name, member in inspect.getmembers(type(keys)):
        if name.startswith("_") or name in ("namespace", "prefix", "rollout_queue", "eval_queue"):
            continue
        if isinstance(member, property):
            out[name] = getattr(keys, name)
        elif inspect.isfunction(member):
            params = [p for p in inspect.signature(member).parameters if p != "self"]
            if name == "event_streams":
                out |= {f"event_streams[{i}]": s for i, s in enumerate(keys.event_streams())}
            elif params in (["stream"], ["stream", "key"]):
                args = [keys.rollout_stream, "req-1"][: len(params)]
                out[name] = getattr(keys, name)(*args)
            else:
                out[name] = getattr(keys, name)(*["p-" + p for p in params])
    return out


def test_every_key_name_carries_the_namespace_hash_tag() -> None:
    keys = Keys("ns-1")
    names = every_key(keys)
    assert len(names) >= 15
    for what, name in names.items():
        assert name.startswith("rb:{ns-1}:"), what
        assert name.index("{") == 3 and name.count("{") == 1, what  # the first {...} is the hash tag


def test_all_keys_of_a_namespace_hash_to_one_cluster_slot() -> None:
    keys = Keys("ns-1")
    slots = {key_slot(name.encode()) for name in every_key(keys).values()}
    assert slots == {key_slot(b"ns-1")}
    assert key_slot(Keys("ns-2").rollout_stream.encode()) == key_slot(b"ns-2")


def test_key_names_are_distinct() -> None:
    names = {k: v for k, v in every_key(Keys("n")).items() if not k.startswith("event_streams")}
    assert len(set(names.values())) == len(names)
    assert set(Keys("n").event_streams()) <= set(names.values())


def test_dedupe_keys_of_a_policy_named_like_a_stream_do_not_collide() -> None:
    keys = Keys("n")
    assert keys.dedupe(keys.rollout_stream, "k") != keys.dedupe(keys.batch_stream("rollouts"), "k")
    assert keys.dedupe(keys.batch_stream("a"), "k") != keys.dedupe(keys.batch_stream("b"), "k")


def test_rq_queue_names_carry_the_namespace() -> None:
    keys = Keys("ns-1")
    assert keys.rollout_queue == "rb.ns-1.rollouts"
    assert keys.eval_queue == "rb.ns-1.eval"


def test_the_namespace_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_BUS_NAMESPACE", "from-env")
    assert Keys.from_env().namespace == "from-env"
    monkeypatch.delenv("ROLLOUT_BUS_NAMESPACE")
    assert Keys.from_env().namespace == DEFAULT_NAMESPACE


@pytest.mark.parametrize("good", ["a", "policy_1", "policy_v2", "v1-2-beta", "_x", "A" * 64])
def test_check_name_accepts_plain_names(good: str) -> None:
    assert check_name("policy", good) == good


@pytest.mark.parametrize("bad", ["", "a:b", "a{b}", "a b", "a/b", "é", "a\n", "*", "A" * 65, "policy.v2", "-x", ".x"])
def test_check_name_rejects_names_that_could_break_a_key(bad: str) -> None:
    with pytest.raises(ValueError, match="policy"):
        check_name("policy", bad)


def test_keys_reject_a_bad_namespace_policy_and_source() -> None:
    with pytest.raises(ValueError, match="namespace"):
        Keys("a}b")
    with pytest.raises(ValueError, match="policy"):
        Keys("n").batch_stream("x:y")
    with pytest.raises(ValueError, match="policy"):
        Keys("n").data_cursor("", "src")


def test_a_policy_name_with_a_dot_is_refused_at_the_command_line_and_at_decode_naming_the_character(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A '.' breaks peft's adapter names (``policy.v2@v1`` is a KeyError inside the engine): such a name
    never gets past the command line, and an event carrying one is refused where it is read."""
    from rollout_bus.controller.cli import build_parser as controller_parser
    from rollout_bus.trainer.cli import build_parser as trainer_parser

    for parser, argv in ((trainer_parser(), ["train", "--policy", "policy.v2"]),
                         (controller_parser(), ["--base-policy", "policy.v2"])):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "'policy.v2': character '.' at position 7 is not allowed" in err and "peft" in err
    assert trainer_parser().parse_args(["train", "--policy", "policy_v2", "--weights-root", "w"]).policy == "policy_v2"

    good = WeightsPublished(producer=Producer("trainer", "host.example.com-t0"), policy="policy_v2", version=1,
                            uri="/w/policy_v2/v000001", sha256="ab" * 32)
    assert decode({FIELD: msgpack.packb(good.to_dict())}) == good
    bad = {**good.to_dict(), "policy": "policy.v2"}
    with pytest.raises(DecodeError, match=r"field 'policy' is 'policy.v2': character '.' at position 7 is not allowed"):
        decode({FIELD: msgpack.packb(bad)})
    with pytest.raises(DecodeError, match=r"producer instance 'h:1': character ':' at position 2"):
        decode({FIELD: msgpack.packb({**good.to_dict(), "producer": {"role": "trainer", "instance": "h:1"}})})


@given(st.text(max_size=80))
@settings(max_examples=300, deadline=None)
def test_any_string_is_a_name_exactly_when_the_grammar_says_so_and_a_refusal_points_at_a_wrong_character(
        value: str) -> None:
    problem = name_problem("policy", value)
    assert (problem is None) == bool(NAME_PATTERN.fullmatch(value))
    if problem is None or not value or len(value) > 64 and NAME_PATTERN.fullmatch(value[:64]):
        return
    match = re.search(r"character (.+) at position (\d+) is not allowed", problem)
    assert match is not None, problem
    position = int(match.group(2))
    assert repr(value[position - 1]) == match.group(1)
    assert position == 1 or NAME_PATTERN.fullmatch(value[:min(position - 1, 64)])  # every character before is fine
    assert not NAME_PATTERN.fullmatch(value[position - 1:position] if position > 1 else value[:1])
