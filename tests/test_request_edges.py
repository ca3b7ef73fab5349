"""Edges of the request validation and the API-key check that once gave a 500, a dead replica or the wrong answer:
a temperature too small to sample with, bodies json can't parse (too deep, too long a number), a seed past int64,
JSON null meaning the default (as OpenAI does), both credential headers sent, auth off without a warning. Pure logic.

Run alone:  .venv/bin/python -m pytest tests/test_request_edges.py -q
"""

from __future__ import annotations

import logging

import pytest

from rankserve.deployments.auth import ApiKeys
from rankserve.deployments.schemas import RequestError, from_proto, parse_request

OK = {"model": "svd-llm", "prompt": "Once upon a time"}


@pytest.mark.parametrize("t", [1e-40, 5e-324, 9.9e-6])
def test_tiny_temperature_is_refused(t):
    with pytest.raises(RequestError) as e:
        parse_request({**OK, "temperature": t})
    assert e.value.param == "temperature" and "must be 0 (greedy" in e.value.message
    assert "\n" not in e.value.message and not e.value.message.startswith("temperature: Value error")


def test_temperature_floor_and_zero_are_accepted():
    assert parse_request({**OK, "temperature": 0}).temperature == 0
    assert parse_request({**OK, "temperature": 1e-5}).temperature == 1e-5


def test_grpc_temperature_follows_the_same_rule():
    """The proto's float32 can't hold 1e-5 exactly (9.99999975e-06): the value the client wrote is what counts."""
    from rankserve.proto import rankserve_pb2 as pb

    msg = lambda **kw: from_proto(pb.GenerateRequest(model="svd-llm", prompt="hi", **kw))
    with pytest.raises(RequestError, match="must be 0"):
        parse_request(msg(temperature=1e-40))
    assert parse_request(msg(temperature=1e-5)).temperature == 1e-5
    assert parse_request(msg(top_p=0.9)).top_p == 0.9


@pytest.mark.parametrize("body, words", [
    (b"[" * 100_000, "nested too deeply"),
    (b'{"model": "svd-llm", "prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}", "digits"),
    (b'{"model": "svd-llm", "prompt": "hi", "seed": 18446744073709551616}', "less than or equal to"),
    (b'{"model": "svd-llm", "prompt": "hi", "seed": -9223372036854775809}', "greater than or equal to"),
])
def test_unparseable_bodies_are_request_errors(body, words):
    with pytest.raises(RequestError) as e:
        parse_request(body)
    assert words in e.value.message and "\n" not in e.value.message


def test_seed_takes_the_whole_int64_range():
    assert parse_request({**OK, "seed": 2**63 - 1}).seed == 2**63 - 1
    assert parse_request({**OK, "seed": -2**63}).seed == -2**63


def test_null_means_the_default():
    nulls = dict.fromkeys(["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n", "user"])
    r = parse_request({**OK, **nulls})
    assert r == parse_request(OK)
    with pytest.raises(RequestError, match="model"):  # a required field is still required
        parse_request({**OK, "model": None})


def test_any_valid_credential_is_accepted(monkeypatch):
    monkeypatch.setenv("RS_KEYS", "k1")
    keys = ApiKeys.from_env("RS_KEYS")
    for headers in ([("authorization", "Bearer wrong"), ("x-api-key", "k1")],
                    [("x-api-key", "k1"), ("authorization", "Bearer wrong")],
                    [("x-api-key", "wrong"), ("authorization", "Bearer k1")],
                    [("authorization", "Bearer k1"), ("x-api-key", "")]):
        assert keys.allows(headers), headers
    assert not keys.allows([("authorization", "Bearer wrong"), ("x-api-key", "also wrong")])


@pytest.mark.parametrize("value", [None, "", " , "])
def test_unset_key_variable_is_warned_about(monkeypatch, caplog, value):
    log = logging.getLogger("ray.serve")  # Serve's logger: it doesn't propagate to the root, where caplog listens
    monkeypatch.setattr(log, "handlers", [*log.handlers, caplog.handler])
    if value is None:
        monkeypatch.delenv("RS_UNSET", raising=False)
    else:
        monkeypatch.setenv("RS_UNSET", value)
    assert not ApiKeys.from_env("RS_UNSET").enabled
    assert any("RS_UNSET" in m and "auth is OFF" in m for m in caplog.messages), caplog.messages
    caplog.clear()
    ApiKeys.from_env(None)  # no api_key_env: auth off on purpose, nothing to warn about
    assert not caplog.messages
