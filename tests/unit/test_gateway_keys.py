"""The gateway's client keys: both file forms, the environment and a file together, refusals that name the
tenant or the line and never the key, and the match."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_bus.engine.http_client import parse_version
from rollout_bus.gateway.engines import known_versions, read_reply
from rollout_bus.gateway.keys import GATEWAY_API_KEY_ENV, ClientKey, ClientKeys, KeysError, load_client_keys
from rollout_bus.gateway.server import check_keys, is_loopback
from rollout_bus.tasks.verifiers_env import API_KEY_ENV

A = "a" * 16 + "-key-of-a"
B = "b" * 16 + "-key-of-b"


def test_the_line_form_and_the_json_form_give_the_same_keys(tmp_path: Path) -> None:
    lines = ClientKeys.parse(f"# tenants\nalpha {A} default p2\n\nbeta {B}  # every policy\n", source="x")
    json_ = ClientKeys.parse(f'[{{"tenant": "alpha", "key": "{A}", "policies": ["default", "p2"]}},'
                             f' {{"tenant": "beta", "key": "{B}"}}]', source="x")
    for keys in (lines, json_):
        assert keys.tenants == ["alpha", "beta"]
        alpha, beta = keys.keys
        assert alpha.allows("default") and alpha.allows("p2") and not alpha.allows("p3")
        assert beta.policies is None and beta.allows("anything")
    assert ClientKeys.parse(f"alpha {A} default; beta {B} *", source="x").tenants == ["alpha", "beta"]


def test_the_environment_and_the_file_are_merged(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"beta {B}\n")
    keys = load_client_keys({"ROLLOUT_BUS_GATEWAY_API_KEYS": f"alpha {A}"}, str(path))
    assert keys.tenants == ["alpha", "beta"]
    assert not load_client_keys({}, None)
    with pytest.raises(KeysError, match="cannot read the key file"):
        load_client_keys({}, str(tmp_path / "missing"))


def test_match_finds_the_tenant_of_a_key_and_nothing_else() -> None:
    keys = ClientKeys([ClientKey("alpha", A), ClientKey("beta", B)])
    assert keys.match(A) is keys.keys[0] and keys.match(B.encode()) is keys.keys[1]
    for wrong in ("", A[:-1], A + "x", A.upper(), "Bearer " + A):
        assert keys.match(wrong) is None
    assert A not in repr(keys.keys[0])


@pytest.mark.parametrize(("text", "fragment"), [
    (f"a.b {A}", "character '.' at position 2"),
    (f"_executor {A}", "kept for the executor"),
    ("alpha short", "16-256 printable characters"),
    ("alpha", "TENANT KEY"),
    (f"alpha {A} bad.policy", "policy 'bad.policy'"),
    (f"alpha {A} * p", "stands alone"),
    (f"alpha {A}\nalpha {B}", "two keys"),
    (f"alpha {A}\nbeta {A}", "the same key"),
    ('[{"tenant": "a", "key": 3}]', "16-256 printable"),
    ('[{"tenant": "a", "secret": "x"}]', "unknown fields"),
    ('{"a": 1}', "a list of"),
    ("[1,", "not JSON"),
])
def test_bad_keys_are_refused_naming_the_problem_never_the_key(text: str, fragment: str) -> None:
    with pytest.raises(KeysError) as caught:
        ClientKeys.parse(text, source="keys.txt")
    message = str(caught.value)
    assert fragment in message and "keys.txt" in message and A not in message and B not in message


def test_a_client_key_equal_to_the_engines_key_and_an_open_address_without_keys_are_refused() -> None:
    keys = ClientKeys([ClientKey("alpha", A)])
    with pytest.raises(KeysError, match="engines' key") as caught:
        check_keys("127.0.0.1", keys, A)
    assert A not in str(caught.value)
    check_keys("127.0.0.1", keys, B)
    check_keys("0.0.0.0", keys, B)
    check_keys("127.0.0.1", ClientKeys([]), A)  # loopback without keys: this machine's callers only
    for host in ("0.0.0.0", "", "10.1.2.3", "::", "gateway.example"):
        with pytest.raises(KeysError, match="without client keys"):
            check_keys(host, None, A)
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.0.1", "::1", "[::1]", "localhost"))


def test_an_executors_key_is_random_and_of_its_own_tenant() -> None:
    one, two = ClientKeys.executor(), ClientKeys.executor()
    assert one.tenants == ["_executor"] and one.keys[0].key != two.keys[0].key and len(one.keys[0].key) >= 32


def test_verifiers_reads_the_gateway_key_a_client_holds() -> None:
    assert API_KEY_ENV == GATEWAY_API_KEY_ENV == "ROLLOUT_BUS_GATEWAY_API_KEY"


def reply(version: object, spans: list[dict] | None = None) -> dict:
    meta = {"output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
            "finish_reason": {"type": "length"}, "weight_version": version}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"output_ids": [5, 6, 7], "meta_info": meta}


@pytest.mark.parametrize("version", ["default", "", "v3", None, "-1", "3.5"])
def test_a_version_that_is_no_number_is_the_registrys_or_unknown(version: object) -> None:
    _, _, versions, _, _ = read_reply(reply(version))
    assert versions == [-1, -1, -1]
    assert known_versions(versions, 4) == [4, 4, 4]
    assert known_versions(versions, None) == [-1, -1, -1]


def test_numeric_versions_and_spans_are_read_as_the_engine_reports_them() -> None:
    _, _, versions, _, _ = read_reply(reply("2", [{"start": 1, "end": 3, "version": "3"},
                                                  {"start": 0, "end": 1, "version": "default"}]))
    assert versions == [2, 3, 3] and known_versions(versions, 9) == [2, 3, 3]
    assert parse_version("default") is None
