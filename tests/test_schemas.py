"""The one request validation (HTTP bodies and gRPC messages) and the API-key check. Pure logic, fast.

Run alone:  .venv/bin/python -m pytest tests/test_schemas.py -q
"""

from __future__ import annotations

import json

import pytest

from rankserve.deployments.auth import ApiKeys
from rankserve.deployments.schemas import (ChatRequest, CompletionRequest, FamilyLimits, RequestError, check_request,
                                           from_proto, parse_request)

FAMILIES = {"svd-llm": FamilyLimits(max_tokens=256), "basis-sharing": FamilyLimits(max_tokens=256)}
OK = {"model": "svd-llm", "prompt": "Once upon a time"}


def test_defaults_are_openai_s():
    r = parse_request(json.dumps(OK).encode())
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed, r.stop, r.stream) == (16, 1.0, 1.0, 0, None, [], False)
    check_request(r, FAMILIES)
    assert r.sampling() == dict(max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=(),
                               ignore_eos=False, logprobs=None)


def test_choices_of_prompts_and_n():
    r = parse_request({**OK, "prompt": ["a", "b"], "n": 3, "seed": 7})
    cs = r.choices()
    assert [(c.prompt, c.seed, c.n) for c in cs] == [("a", 7, 1), ("a", 8, 1), ("a", 9, 1),
                                                    ("b", 7, 1), ("b", 8, 1), ("b", 9, 1)]
    assert [c.seed for c in parse_request({**OK, "n": 2}).choices()] == [None, None]  # unseeded stays unseeded
    top = 2**63 - 1
    assert [c.seed for c in parse_request({**OK, "n": 2, "seed": top}).choices()] == [top, top - 1]
    assert parse_request(OK).choices()[0].prompt == OK["prompt"]


def test_token_id_prompts():
    """OpenAI's token-id shapes: [id, ...] is one prompt, [[id, ...], ...] several; each choice carries its ids."""
    r = parse_request({**OK, "prompt": [1, 2, 3], "n": 2})
    assert r.prompts == [[1, 2, 3]] and [c.prompt for c in r.choices()] == [[1, 2, 3], [1, 2, 3]]
    assert [c.prompts for c in r.choices()] == [[[1, 2, 3]], [[1, 2, 3]]]  # a choice is one prompt of ids
    r = parse_request({**OK, "prompt": [[5], [0, 7]], "echo": True, "max_tokens": 0})
    assert r.prompts == [[5], [0, 7]] and [c.prompt for c in r.choices()] == [[5], [0, 7]]
    assert parse_request({**OK, "prompt": ["a", "b"]}).prompts == ["a", "b"]  # texts stay texts


def test_stop_string_or_list():
    assert parse_request({**OK, "stop": "\n"}).stop == ["\n"]
    assert parse_request({**OK, "stop": ["a", "b"]}).stop == ["a", "b"]
    assert parse_request({**OK, "stop": None}).stop == []


@pytest.mark.parametrize("body, param, words", [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    (b"\xff\xfe", None, "not valid JSON"),
    ({"prompt": "x"}, "model", "field required"),
    ({"model": "svd-llm"}, "prompt", "field required"),
    ({**OK, "prompt": ""}, "prompt", "must not be empty"),
    ({**OK, "prompt": ["a", ""]}, "prompt", "must not be empty"),
    ({**OK, "prompt": []}, "prompt", "empty list"),
    ({**OK, "prompt": [1, -2, 3]}, "prompt", "holds -2: token ids are integers"),
    ({**OK, "prompt": [1, 2.5]}, "prompt", "holds 2.5"),
    ({**OK, "prompt": [True, 1]}, "prompt", "holds True"),
    ({**OK, "prompt": [[1, 2], [3, "x"]]}, "prompt", "holds 'x'"),
    ({**OK, "prompt": [[1, 2], []]}, "prompt", "must not be empty"),
    ({**OK, "prompt": [2**31]}, "prompt", "holds 2147483648"),
    ({**OK, "prompt": ["a", [1, 2]]}, "prompt", "mix text and token ids"),
    ({**OK, "prompt": [[1], "a"]}, "prompt", "mix text and token ids"),
    ({**OK, "prompt": 7}, "prompt", "a string (text) or a list of token ids"),
    ({**OK, "prompt": [[1]] * 5, "n": 2}, None, "more than 8 choices"),
    ({**OK, "prompt": ["a"] * 5, "n": 2}, None, "more than 8 choices"),
    ({**OK, "max_tokens": 0}, "max_tokens", "0 is only allowed with echo"),
    ({**OK, "max_tokens": -5}, "max_tokens", "greater than or equal to 0"),
    ({**OK, "max_tokens": 1.5}, "max_tokens", "integer"),
    ({**OK, "max_tokens": "many"}, "max_tokens", "integer"),
    ({**OK, "temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({**OK, "temperature": float("nan")}, "temperature", "finite"),
    ({**OK, "top_p": 0}, "top_p", "greater than 0"),
    ({**OK, "top_p": 1.01}, "top_p", "less than or equal to 1"),
    ({**OK, "top_k": -1}, "top_k", "greater than or equal to 0"),
    ({**OK, "stop": ["a", ""]}, "stop", "non-empty"),
    ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({**OK, "stop": ["\n", "a" * 257]}, "stop", "a stop string is 257 characters; each may have at most 256"),
    ({**OK, "stop": "z" + "a" * 1_000_000}, "stop", "each may have at most 256"),  # every token rescans it
    ({**OK, "n": 0}, "n", "greater than or equal to 1"),
    ({**OK, "n": 9}, "n", "less than or equal to 8"),
    ({**OK, "n": 1.5}, "n", "integer"),
    ({**OK, "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({**OK, "best_of": 2}, "best_of", "unknown field"),
    ({**OK, "stream": "maybe"}, "stream", "boolean"),
])
def test_bad_bodies(body, param, words):
    with pytest.raises(RequestError) as e:
        parse_request(body)
    assert e.value.param == param
    assert words.lower() in e.value.message.lower(), e.value.message


CHAT = {"model": "svd-llm", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body, chat, param", [
    (b'{"model": "svd-llm", "prompt": "Once upon a time \\ud800"}', False, "prompt"),  # valid JSON, no valid text
    ({**OK, "prompt": ["fine", "x \udc00 y"]}, False, "prompt"),
    ({**OK, "stop": "\ud800"}, False, "stop"),
    ({**OK, "stop": ["\n", "a\udfff"]}, False, "stop"),
    ({**OK, "user": "\ud800"}, False, "user"),
    ({**OK, "model": "svd\ud800"}, False, "model"),
    (b'{"model": "svd-llm", "messages": [{"role": "user", "content": "hi \\udc00"}]}', True, "messages.0.content"),
    ({**CHAT, "messages": [CHAT["messages"][0], {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "\ud83d"}]}]},
     True, "messages.1.content"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, True, "messages.0.name"),
    ({**CHAT, "stop": ["\udbff"]}, True, "stop"),
], ids=["prompt-bytes", "prompt-list", "stop", "stop-list", "user", "model", "chat-content", "chat-part", "chat-name",
        "chat-stop"])
def test_lone_surrogates_are_refused(body, chat, param):
    """JSON's "\\ud800" alone is valid JSON but no text: no tokenizer or embedder reads it (MiniLM's raised inside the
    router's batched embedding, failing every request batched with it). Refused at the boundary, naming the field;
    the message itself must encode as UTF-8 (it goes out in the 400's JSON body)."""
    with pytest.raises(RequestError) as e:
        parse_request(body, ChatRequest if chat else CompletionRequest)
    assert e.value.param == param, e.value.message
    assert param == "model" or "lone surrogate" in e.value.message
    e.value.message.encode("utf-8")


def test_surrogate_pairs_and_long_enough_stops_pass():
    assert parse_request(b'{"model": "svd-llm", "prompt": "hi \\ud83d\\ude00"}').prompt == "hi \U0001F600"  # a pair
    assert parse_request({**OK, "stop": ["a" * 256, "\U0001F600"]}).stop == ["a" * 256, "\U0001F600"]
    parts = [{"type": "text", "text": "caf\u00e9 "}, {"type": "text", "text": "\U0001F600"}]
    assert parse_request({**CHAT, "messages": [{"role": "user", "content": parts}]}, ChatRequest).messages[0].text == \
        "caf\u00e9 \U0001F600"


def test_family_checks():
    with pytest.raises(RequestError, match="unknown model 'dense'.*served: basis-sharing, svd-llm"):
        check_request(parse_request({**OK, "model": "dense"}), FAMILIES)
    with pytest.raises(RequestError, match="max_tokens: 257 is above this model's limit of 256"):
        check_request(parse_request({**OK, "max_tokens": 257}), FAMILIES)


def test_proto_goes_through_the_same_validation():
    from rankserve.proto import rankserve_pb2 as pb

    d = from_proto(pb.GenerateRequest(model="svd-llm", prompt="hi"))
    assert d == {"model": "svd-llm", "prompt": "hi"}  # unset optionals take the HTTP defaults
    d = from_proto(pb.GenerateRequest(model="svd-llm", prompt="hi", max_tokens=0, temperature=0.0, stop=["."]))
    assert d["temperature"] == 0.0 and d["stop"] == ["."]
    with pytest.raises(RequestError, match="max_tokens"):
        parse_request(d)  # max_tokens=0 was set explicitly, so it is refused rather than defaulted
    with pytest.raises(RequestError, match="prompt"):
        parse_request(from_proto(pb.GenerateRequest(model="svd-llm")))
    assert parse_request(from_proto(pb.GenerateRequest(model="svd-llm", prompt="hi", logprobs=0))).logprobs == 0
    with pytest.raises(RequestError, match="logprobs"):
        parse_request(from_proto(pb.GenerateRequest(model="svd-llm", prompt="hi", logprobs=21)))
    req = parse_request(from_proto(pb.GenerateRequest(model="svd-llm", prompt="hi", n=3, echo=True, max_tokens=0)))
    assert req.n == 3 and req.echo and req.max_tokens == 0 and len(req.choices()) == 3
    req = parse_request(from_proto(pb.GenerateRequest(model="svd-llm", prompt="hi", echo=True), stream=True))
    assert req.stream and req.echo  # the streaming RPC is HTTP's stream: true, echo streams too
    with pytest.raises(RequestError, match="^n: "):
        parse_request(from_proto(pb.GenerateRequest(model="svd-llm", prompt="hi", n=0)))
    d = from_proto(pb.GenerateRequest(model="svd-llm", prompt_ids=[1, 2, 3]))
    assert d == {"model": "svd-llm", "prompt": [1, 2, 3]} and parse_request(d).prompts == [[1, 2, 3]]
    with pytest.raises(RequestError, match="holds -4"):
        parse_request(from_proto(pb.GenerateRequest(model="svd-llm", prompt_ids=[1, -4])))
    with pytest.raises(RequestError, match="both set") as e:
        from_proto(pb.GenerateRequest(model="svd-llm", prompt="hi", prompt_ids=[1]))
    assert e.value.param == "prompt_ids"


def test_proto_chat_is_the_http_chat_body():
    from rankserve.deployments.schemas import ChatRequest
    from rankserve.proto import rankserve_pb2 as pb

    msgs = [pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="hi")]
    d = from_proto(pb.ChatRequest(model="svd-llm", messages=msgs, temperature=0.0, logprobs=3))
    assert d == {"model": "svd-llm", "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "hi"}],
                 "temperature": 0.0, "logprobs": True, "top_logprobs": 3}
    req = parse_request(d, ChatRequest)
    assert req.max_tokens is None and req.logprobs and req.top_logprobs == 3  # max_tokens: the family's limit
    assert "logprobs" not in from_proto(pb.ChatRequest(model="svd-llm", messages=msgs))
    assert parse_request(from_proto(pb.ChatRequest(model="svd-llm", messages=msgs, ignore_eos=True)),
                         ChatRequest).ignore_eos
    assert parse_request(from_proto(pb.GenerateRequest(model="svd-llm", prompt="hi", ignore_eos=True))).sampling()[
        "ignore_eos"]
    with pytest.raises(RequestError, match="messages.0.role"):
        parse_request(from_proto(pb.ChatRequest(model="svd-llm", messages=[pb.ChatMessage(role="tool")])),
                      ChatRequest)
    with pytest.raises(RequestError, match="messages"):
        parse_request(from_proto(pb.ChatRequest(model="svd-llm")), ChatRequest)


def test_api_keys(monkeypatch):
    assert ApiKeys.from_env(None).allows({})  # off
    monkeypatch.setenv("RS_KEYS", "k1, k2")
    keys = ApiKeys.from_env("RS_KEYS")
    assert keys.enabled
    assert keys.allows({"authorization": "Bearer k1"})
    assert keys.allows([("authorization", "bearer k2")])
    assert keys.allows([("x-api-key", "k2")])
    assert not keys.allows({})
    assert not keys.allows({"authorization": "Bearer nope"})
    assert not keys.allows({"authorization": "k1"})  # scheme required
    monkeypatch.setenv("RS_EMPTY", "")
    assert not ApiKeys.from_env("RS_EMPTY").enabled
