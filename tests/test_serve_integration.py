"""The service end to end on CPU: real Ray Serve (configs/serve.local.yaml, ports moved to free ones), a real
redis-server, real HTTP and gRPC over sockets, the three families built from the bundled model (two static, one PARSE).

Checks: HTTP, SSE, gRPC Generate and GenerateStream give `rankserve generate`'s greedy text; a chat request
gives the completion of its rendered conversation; logprobs are the CLI's; a similar prompt hits
the rank cache (visible in /metrics); the PARSE family runs its routers on a miss only, with the CLI's text for both
the routed and the cached subset; a cached subset the PARSE worker refuses is a miss and leaves the cache; bad input
is 400 / INVALID_ARGUMENT with a message (a lone surrogate too, failing no request sent beside it); JSON null means
the default; /readyz says only its status without the key;
a missing or wrong key is 401 / UNAUTHENTICATED, one valid key among the headers passes; a client that goes away
cancels its generation; the request timeout answers 408 / DEADLINE_EXCEEDED; a full queue is refused with 503 /
UNAVAILABLE; with Redis stopped the service still answers (and picks Redis up again); prompts sent as token ids
get their text's replies.

Run alone:  .venv/bin/python -m pytest tests/test_serve_integration.py -q     (~2 min; needs redis-server)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from servers import RedisServer, free_port

pytestmark = [pytest.mark.serve, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-1"
AUTH = {"authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPT = "Once upon a time, there was a little girl named Lily."
SIMILAR = "Once upon a time there was a little girl called Lily."
N = 24  # tokens per greedy check


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def service(redis):
    from rankserve.deployments.local import LocalService, ensure_models

    models = ensure_models(quiet=True)
    cfg = yaml.safe_load((ROOT / "configs" / "serve.local.yaml").read_text())
    cfg["http_options"]["port"] = free_port()
    cfg["grpc_options"]["port"] = free_port()
    (app,) = cfg["applications"]
    app["args"]["redis_url"] = redis.url
    fams = app["args"]["families"]
    for name, path in models.items():
        fams[name]["model_dir"] = str(path)
    # A third family with a tiny deadline, to see the request timeout at work.
    fams["deadline"] = {**fams["svd-llm"], "request_timeout_s": 0.2}
    # ... and a queue of one, to see backpressure: past it the router answers 503 / UNAVAILABLE at once.
    app["deployments"].append({"name": "Worker-deadline", "num_replicas": 1, "max_ongoing_requests": 1,
                               "max_queued_requests": 1, "ray_actor_options": {"num_cpus": 0.5}})
    old = os.environ.get(app["args"]["api_key_env"])
    os.environ[app["args"]["api_key_env"]] = KEY  # replicas inherit the driver's environment
    svc = LocalService(cfg, start_redis=False)
    try:
        svc.start()
        yield svc
    finally:
        svc.stop()
        if old is None:
            os.environ.pop(app["args"]["api_key_env"])
        else:
            os.environ[app["args"]["api_key_env"]] = old


@pytest.fixture(scope="module")
def stub(service):
    from rankserve.proto import rankserve_pb2_grpc

    with grpc.insecure_channel(service.grpc_target) as ch:
        yield rankserve_pb2_grpc.GeneratorStub(ch)


def post(service, body, headers=AUTH, **kw):
    return httpx.post(service.http_url + "/v1/completions", json=body, headers=headers, timeout=60, **kw)


def sse(service, body) -> tuple[str, list[dict]]:
    chunks = []
    with httpx.stream("POST", service.http_url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in r.iter_lines() if l]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[len("data: "):]) for l in lines[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks


def metric(service, name: str, **labels) -> float:
    """Sum of a Prometheus sample over Ray's metrics endpoint (all replicas), filtered by labels."""
    text = httpx.get(service.metrics_url, timeout=10).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def model_version(service, family: str) -> str:
    models = httpx.get(service.http_url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    return next(m["model_version"] for m in models if m["id"] == family)


def cli_generate(model_dir: str, prompt: str, n: int, *extra: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "rankserve.cli", "generate", model_dir, "--prompt", prompt,
                          "--max-new-tokens", str(n), "--json", *extra], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


# ---- same greedy text on every path ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["svd-llm", "basis-sharing"])
def test_every_path_gives_the_cli_greedy_text(service, stub, family):
    from rankserve.proto import rankserve_pb2 as pb

    model_dir = service.app["args"]["families"][family]["model_dir"]
    ref = cli_generate(model_dir, PROMPT, N)
    body = {"model": family, "prompt": PROMPT, "max_tokens": N, "temperature": 0}

    r = post(service, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == family
    assert out["choices"][0]["text"] == ref["text"]
    assert out["usage"] == {"prompt_tokens": ref["num_prompt_tokens"], "completion_tokens": len(ref["token_ids"]),
                            "total_tokens": ref["num_prompt_tokens"] + len(ref["token_ids"])}

    text, chunks = sse(service, body)
    assert text == ref["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == ref["finish_reason"]

    req = pb.GenerateRequest(model=family, prompt=PROMPT, max_tokens=N, temperature=0.0)
    rep = stub.Generate(req, metadata=GRPC_AUTH, timeout=60)
    assert rep.text == ref["text"] and list(rep.token_ids) == ref["token_ids"]
    assert rep.finish_reason == ref["finish_reason"] and rep.usage.prompt_tokens == ref["num_prompt_tokens"]

    chunks = list(stub.GenerateStream(req, metadata=GRPC_AUTH, timeout=60))
    assert "".join(c.text for c in chunks) == ref["text"]
    assert chunks[-1].finish_reason == ref["finish_reason"]
    assert chunks[-1].usage.completion_tokens == len(ref["token_ids"])


def test_chat_completions_answer_the_rendered_conversation(service, stub):
    """A chat request is the completion of its rendered conversation (the bundled model has no template: the plain
    transcript, with the next user turn as a stop string), in chat shapes, streamed or not, and over gRPC."""
    from rankserve.proto import rankserve_pb2 as pb
    from rankserve.workers.chat import ChatTemplate

    msgs = [{"role": "system", "content": "You tell short stories."}, {"role": "user", "content": PROMPT}]
    ref = post(service, {"model": "svd-llm", "prompt": ChatTemplate().render(msgs), "max_tokens": N,
                         "temperature": 0, "stop": list(ChatTemplate().stop)}).json()
    body = {"model": "svd-llm", "messages": msgs, "max_tokens": N, "temperature": 0}
    url = service.http_url + "/v1/chat/completions"

    r = httpx.post(url, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ref["choices"][0]["text"]}
    assert out["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
    assert out["usage"] == ref["usage"]

    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      headers=AUTH, timeout=60) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in s.iter_lines() if l]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[len("data: "):]) for l in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == ref["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == ref["usage"]  # include_usage: OpenAI's last chunk

    bad = httpx.post(url, json={"model": "svd-llm", "messages": [{"role": "tool", "content": "x"}]}, headers=AUTH,
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.0.role"
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    long = httpx.post(url, json={**body, "messages": [{"role": "user", "content": "word " * 30_000}]}, headers=AUTH,
                      timeout=60)  # rendered on a thread (> 100 K characters), then too long for the context
    assert long.status_code == 400 and "context limit" in long.json()["error"]["message"]

    req = pb.ChatRequest(model="svd-llm", messages=[pb.ChatMessage(**m) for m in msgs], max_tokens=N, temperature=0)
    rep = stub.Chat(req, metadata=GRPC_AUTH, timeout=60)
    assert rep.text == ref["choices"][0]["text"] and rep.id.startswith("chatcmpl-")
    assert rep.finish_reason == ref["choices"][0]["finish_reason"]
    assert rep.usage.prompt_tokens == ref["usage"]["prompt_tokens"]
    grpc_chunks = list(stub.ChatStream(req, metadata=GRPC_AUTH, timeout=60))
    assert "".join(c.text for c in grpc_chunks) == rep.text and grpc_chunks[-1].finish_reason == rep.finish_reason
    for call in (stub.Chat, lambda *a, **k: list(stub.ChatStream(*a, **k))):
        with pytest.raises(grpc.RpcError) as e:
            call(pb.ChatRequest(model="svd-llm", messages=[pb.ChatMessage(role="tool", content="x")]),
                 metadata=GRPC_AUTH, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages.0.role" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_logprobs_are_the_clis(service, stub):
    """logprobs through HTTP and gRPC (plain, streamed, chat) are `rankserve generate --logprobs`'s for the same
    tokens."""
    from rankserve.proto import rankserve_pb2 as pb

    model_dir = service.app["args"]["families"]["svd-llm"]["model_dir"]
    ref = cli_generate(model_dir, PROMPT, 8, "--logprobs", "2")["logprobs"]
    body = {"model": "svd-llm", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}

    r = post(service, body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [e["token"] for e in ref]
    assert lp["token_logprobs"] == pytest.approx([e["logprob"] for e in ref], abs=1e-5)
    assert [list(d) for d in lp["top_logprobs"]] == [[t for t, _, _ in e["top"]] for e in ref]
    assert lp["text_offset"] == [e["offset"] for e in ref]

    # echo + max_tokens 0 scores a text (what evaluation harnesses send): prompt + the completion above gives the
    # completion's tokens the logprobs generation reported
    text = r.json()["choices"][0]["text"]
    scored = post(service, {"model": "svd-llm", "prompt": PROMPT + text, "max_tokens": 0, "echo": True,
                            "logprobs": 2})
    assert scored.status_code == 200, scored.text
    choice, n = scored.json()["choices"][0], len(lp["tokens"])
    assert choice["text"] == PROMPT + text and scored.json()["usage"]["completion_tokens"] == 0
    slp = choice["logprobs"]
    assert "".join(slp["tokens"][:-n]) == PROMPT and slp["tokens"][-n:] == lp["tokens"]
    assert slp["token_logprobs"][-n:] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert slp["text_offset"][-n:] == [o + len(PROMPT) for o in lp["text_offset"]]
    echoed = post(service, {**body, "echo": True}).json()["choices"][0]  # echo while generating
    assert echoed["text"] == PROMPT + text and echoed["logprobs"]["tokens"] == slp["tokens"]
    assert echoed["logprobs"]["text_offset"] == slp["text_offset"]
    text_e, chunks = sse(service, {**body, "echo": True})  # echo streams too: the prompt's chunk comes first
    assert chunks[0]["choices"][0]["text"] == PROMPT and text_e == echoed["text"]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert sum((s["tokens"] for s in streamed), []) == echoed["logprobs"]["tokens"]
    assert sum((s["text_offset"] for s in streamed), []) == echoed["logprobs"]["text_offset"]
    _, chunks = sse(service, {"model": "svd-llm", "prompt": PROMPT + text, "max_tokens": 0, "echo": True,
                              "logprobs": 2})  # a streamed score: the prompt's chunk, then the finish chunk
    assert sum((c["choices"][0]["logprobs"]["tokens"] for c in chunks if c["choices"]), []) == slp["tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0

    _, chunks = sse(service, body)  # each chunk carries its tokens' entries; together they are the whole list
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert sum((s["tokens"] for s in streamed), []) == lp["tokens"]
    assert sum((s["text_offset"] for s in streamed), []) == lp["text_offset"]

    msgs = [{"role": "user", "content": PROMPT}]
    c = httpx.post(service.http_url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": "svd-llm", "messages": msgs, "max_tokens": 8, "temperature": 0, "logprobs": True,
                         "top_logprobs": 2}).json()
    content = c["choices"][0]["logprobs"]["content"]
    assert len(content) <= c["usage"]["completion_tokens"]  # a stop string's tokens write no text: no entries
    assert "".join(e["token"] for e in content).startswith(c["choices"][0]["message"]["content"])
    assert all(e["bytes"] == list(e["token"].encode()) or e["token"].startswith(" ") for e in content)
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
               for e in content)

    req = pb.GenerateRequest(model="svd-llm", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    rep = stub.Generate(req, metadata=GRPC_AUTH, timeout=60)
    assert [(e.token, e.text_offset, list(e.bytes)) for e in rep.logprobs] == \
        [(e["token"], e["offset"], e["bytes"]) for e in ref]
    assert [e.logprob for e in rep.logprobs] == pytest.approx([e["logprob"] for e in ref], abs=1e-5)
    assert [[t.token for t in e.top_logprobs] for e in rep.logprobs] == [[t for t, _, _ in e["top"]] for e in ref]
    streamed = [e for c in stub.GenerateStream(req, metadata=GRPC_AUTH, timeout=60) for e in c.logprobs]
    assert streamed == list(rep.logprobs)
    assert not stub.Generate(pb.GenerateRequest(model="svd-llm", prompt=PROMPT, max_tokens=8, temperature=0),
                             metadata=GRPC_AUTH, timeout=60).logprobs  # none unless asked for
    chat = stub.Chat(pb.ChatRequest(model="svd-llm", messages=[pb.ChatMessage(**m) for m in msgs], max_tokens=8,
                                    temperature=0, logprobs=2), metadata=GRPC_AUTH, timeout=60)
    assert [(e.token, list(e.bytes)) for e in chat.logprobs] == [(e["token"], e["bytes"]) for e in content]
    assert [e.logprob for e in chat.logprobs] == pytest.approx([e["logprob"] for e in content], abs=1e-6)

    # gRPC echo: the same scoring and echoed generation as HTTP's, whole and streamed
    rep = stub.Generate(pb.GenerateRequest(model="svd-llm", prompt=PROMPT + text, max_tokens=0, echo=True,
                                           logprobs=2), metadata=GRPC_AUTH, timeout=60)
    assert rep.text == PROMPT + text and rep.usage.completion_tokens == 0 and not rep.token_ids
    assert [e.token for e in rep.logprobs] == slp["tokens"] and [e.text_offset for e in rep.logprobs] == \
        slp["text_offset"]
    assert [e.logprob if e.HasField("logprob") else None for e in rep.logprobs] == \
        pytest.approx(slp["token_logprobs"], abs=1e-5)
    rep = stub.Generate(pb.GenerateRequest(model="svd-llm", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                           echo=True), metadata=GRPC_AUTH, timeout=60)
    assert rep.text == echoed["text"] and [e.token for e in rep.logprobs] == echoed["logprobs"]["tokens"]
    chunks = list(stub.GenerateStream(pb.GenerateRequest(model="svd-llm", prompt=PROMPT, max_tokens=8, temperature=0,
                                                         logprobs=2, echo=True), metadata=GRPC_AUTH, timeout=60))
    assert chunks[0].text == PROMPT and "".join(c.text for c in chunks) == echoed["text"]
    assert [e.token for c in chunks for e in c.logprobs] == echoed["logprobs"]["tokens"]
    assert [e.text_offset for c in chunks for e in c.logprobs] == echoed["logprobs"]["text_offset"]


def test_several_prompts_and_n_choices(service, stub):
    """A list of prompts and n > 1: one choice per prompt and sample (prompt-major), each the text its own request
    gets (greedy: every sample alike; seeded: sample j is seed + j's), usage counting each prompt once; streamed,
    chunks name their choice's index and together give the same texts."""
    family = "svd-llm"
    prompts = [PROMPT, "The little dog ran to the park."]
    alone = [post(service, {"model": family, "prompt": p, "max_tokens": 8, "temperature": 0}).json() for p in prompts]
    body = {"model": family, "prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 0}
    r = post(service, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [a["choices"][0]["text"] for a in alone for _ in range(2)]
    assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert out["usage"]["completion_tokens"] == 2 * sum(a["usage"]["completion_tokens"] for a in alone)
    assert r.headers["x-rankserve-rank-cache"].count(",") == 1  # one outcome per prompt

    _, chunks = sse(service, {**body, "stream_options": {"include_usage": True}})
    texts = ["", "", "", ""]
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        texts[ch["index"]] += ch["text"]
    assert texts == [c["text"] for c in out["choices"]]
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]) \
        == [0, 1, 2, 3]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == out["usage"]

    seeded = {"model": family, "prompt": PROMPT, "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    got = [c["text"] for c in post(service, seeded).json()["choices"]]
    assert got == [post(service, {**seeded, "n": 1, "seed": 11 + j}).json()["choices"][0]["text"] for j in range(3)]
    chat = httpx.post(service.http_url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": family, "messages": [{"role": "user", "content": PROMPT}], "n": 2,
                            "max_tokens": 6, "temperature": 0}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]
    assert post(service, {**body, "n": 5}).status_code == 400  # 2 prompts x 5 > 8 choices

    # gRPC: n choices in `choices` (the top-level fields are the first's), streamed chunks naming their index
    from rankserve.proto import rankserve_pb2 as pb

    req = pb.GenerateRequest(model=family, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=11)
    rep = stub.Generate(req, metadata=GRPC_AUTH, timeout=60)
    assert [c.index for c in rep.choices] == [0, 1] and [c.text for c in rep.choices] == got[:2]
    assert rep.text == got[0] and rep.usage.completion_tokens == sum(len(c.token_ids) for c in rep.choices)
    texts, finished, usages = ["", ""], [], []
    for c in stub.GenerateStream(req, metadata=GRPC_AUTH, timeout=60):
        texts[c.index] += c.text
        if c.finish_reason:
            finished.append(c.index)
            usages.append(c.usage.total_tokens if c.HasField("usage") else None)
    assert texts == got[:2] and sorted(finished) == [0, 1] and usages[0] is None and usages[1] == rep.usage.total_tokens
    chat2 = stub.Chat(pb.ChatRequest(model=family, messages=[pb.ChatMessage(role="user", content=PROMPT)], n=2,
                                     max_tokens=6, temperature=0), metadata=GRPC_AUTH, timeout=60)
    assert [c.text for c in chat2.choices] == [chat["choices"][0]["message"]["content"]] * 2
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(model=family, prompt=PROMPT, n=9), metadata=GRPC_AUTH, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_token_id_prompts(service, stub):
    """A prompt sent as token ids (OpenAI's [id, ...] and [[id, ...], ...]; gRPC prompt_ids) gets its text's reply;
    echo returns the ids' decoded text; the rank cache embeds that text; an id outside the vocabulary is a 400 /
    INVALID_ARGUMENT naming it, as is a gRPC request with both prompt and prompt_ids."""
    from rankserve.proto import rankserve_pb2 as pb
    from rankserve.workers.tokenizer import Tokenizer

    family, other = "svd-llm", "The little dog ran to the park."
    tok = Tokenizer.load(service.app["args"]["families"][family]["model_dir"])
    ids, ids2 = tok.encode(PROMPT, bos=True), tok.encode(other, bos=True)
    body = {"model": family, "max_tokens": 8, "temperature": 0}
    by_text = post(service, {**body, "prompt": [PROMPT, other]}).json()
    r = post(service, {**body, "prompt": [ids, ids2]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["text"] for c in out["choices"]] == [c["text"] for c in by_text["choices"]]
    assert out["usage"] == by_text["usage"] and r.headers["x-rankserve-rank-cache"].count(",") == 1
    one = post(service, {**body, "prompt": ids}).json()
    assert one["choices"][0]["text"] == by_text["choices"][0]["text"]
    text, _ = sse(service, {**body, "prompt": ids})
    assert text == one["choices"][0]["text"]

    scored_text = post(service, {**body, "prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1}).json()
    scored = post(service, {**body, "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1}).json()
    assert scored["choices"][0]["text"] == PROMPT  # the ids' text (the BOS writes none)
    assert scored["choices"][0]["logprobs"] == scored_text["choices"][0]["logprobs"]
    _, chunks = sse(service, {**body, "prompt": ids, "echo": True})
    assert chunks[0]["choices"][0]["text"] == PROMPT

    for bad in ([1, tok.vocab_size + 3], [[1, 2], [-1]]):
        r = post(service, {**body, "prompt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert f"token id {tok.vocab_size + 3} at position 1" in post(
        service, {**body, "prompt": [1, tok.vocab_size + 3]}).json()["error"]["message"]

    rep = stub.Generate(pb.GenerateRequest(model=family, prompt_ids=ids, max_tokens=8, temperature=0, echo=True),
                        metadata=GRPC_AUTH, timeout=60)
    assert rep.text == PROMPT + by_text["choices"][0]["text"]
    chunks = list(stub.GenerateStream(pb.GenerateRequest(model=family, prompt_ids=ids, max_tokens=8, temperature=0),
                                      metadata=GRPC_AUTH, timeout=60))
    assert "".join(c.text for c in chunks) == by_text["choices"][0]["text"]
    for req, words in ((pb.GenerateRequest(model=family, prompt="hi", prompt_ids=ids), "both set"),
                       (pb.GenerateRequest(model=family, prompt_ids=[1, tok.vocab_size + 3]), "not a token")):
        for call in (stub.Generate, lambda *a, **k: list(stub.GenerateStream(*a, **k))):
            with pytest.raises(grpc.RpcError) as e:
                call(req, metadata=GRPC_AUTH, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


def test_models_and_health(service):
    r = httpx.get(service.http_url + "/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200
    assert {m["id"] for m in r.json()["data"]} == {"svd-llm", "basis-sharing", "parse-svd-llm", "deadline"}
    assert all(isinstance(m["created"], int) and m["created"] > 0 for m in r.json()["data"])  # OpenAI's field
    assert httpx.get(service.http_url + "/openapi.json", timeout=10).status_code == 404  # nothing to read without a key
    # the router learned every family's model version at start (and loaded those rank-cache spaces from Redis)
    wait_for(lambda: all(m["model_version"] for m in httpx.get(service.http_url + "/v1/models", headers=AUTH,
                                                                timeout=10).json()["data"]), what="model versions")
    assert httpx.get(service.http_url + "/healthz", timeout=10).json() == {"status": "ok"}
    ready = httpx.get(service.http_url + "/readyz", headers=AUTH, timeout=30)
    assert ready.status_code == 200 and ready.json()["rank_cache_redis_up"] is True
    assert set(ready.json()["families"]) == {"svd-llm", "basis-sharing", "parse-svd-llm", "deadline"}
    ready = httpx.get(service.http_url + "/readyz", timeout=30)  # a probe: no key, no detail
    assert ready.status_code == 200 and ready.json() == {"status": "ok"}


# ---- rank cache ------------------------------------------------------------------------------------------------

def test_similar_prompt_hits_the_rank_cache(service, stub, redis):
    from rankserve.proto import rankserve_pb2 as pb
    from rankserve.rank_cache import RedisStore

    family = "basis-sharing"
    prompt = "The little dog ran to the park to find his red ball."
    hits0 = metric(service, "ray_rankserve_rank_cache_hits_total", family=family)
    version = model_version(service, family)
    store = RedisStore(redis.url)
    try:
        n0 = len(store.entries(family, version)[0])
        r = post(service, {"model": family, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-rankserve-rank-cache"] == "miss"
        # the write-back runs in the background; the router's index takes the entry as Redis answers the write
        wait_for(lambda: len(store.entries(family, version)[0]) > n0, what="the write-back to Redis")
    finally:
        store.close()
    r = post(service, {"model": family, "prompt": "The little dog ran to the park to find his red ball!",
                       "max_tokens": 4})
    assert r.status_code == 200 and r.headers["x-rankserve-rank-cache"] == "hit"
    rep = stub.Generate(pb.GenerateRequest(model=family, prompt="The small dog ran to the park to find his red ball.",
                                           max_tokens=4), metadata=GRPC_AUTH, timeout=60)
    assert rep.rank_cache_hit
    wait_for(lambda: metric(service, "ray_rankserve_rank_cache_hits_total", family=family) >= hits0 + 2,
             what="the hits to show in /metrics")
    assert metric(service, "ray_rankserve_rank_cache_misses_total", family=family) >= 1
    assert metric(service, "ray_rankserve_rank_cache_lookup_seconds_count", family=family) >= 3


def test_parse_family_routes_on_a_miss_only(service, stub, redis, tmp_path):
    """A miss runs the PARSE routers (the CLI's --parse choice and text); a repeat and a paraphrase hit the cache and
    skip them, generating with the cached subset (the CLI's text for --subset with what Redis holds)."""
    from rankserve.proto import rankserve_pb2 as pb
    from rankserve.rank_cache import RedisStore
    from rankserve.rank_cache.store import decode_subset
    from rankserve.workers.parse import digest

    family = "parse-svd-llm"
    model_dir = service.app["args"]["families"][family]["model_dir"]
    prompt = "The little cat climbed the tall tree to see the birds."
    paraphrase = "The little cat climbed up the tall tree to see the birds."  # MiniLM cosine 0.98
    runs = lambda: metric(service, "ray_rankserve_parse_router_runs_total", family=family)
    runs0 = runs()
    body = {"model": family, "prompt": prompt, "max_tokens": N, "temperature": 0}
    miss = post(service, body)
    assert miss.status_code == 200 and miss.headers["x-rankserve-rank-cache"] == "miss", miss.text
    wait_for(lambda: runs() == runs0 + 1, what="the router run to show in /metrics")

    version = model_version(service, family)
    store = RedisStore(redis.url)
    try:  # the router's write-back of the worker's choice: the family's space holds this one entry
        wait_for(lambda: len(store.entries(family, version)[0]) == 1, what="the write-back to Redis")
        (cached,) = map(decode_subset, store.entries(family, version)[2])  # stored as bitmasks
    finally:
        store.close()
    routed = cli_generate(model_dir, prompt, N, "--parse")
    assert routed["subset"]["digest"] == digest(cached)
    assert miss.json()["choices"][0]["text"] == routed["text"]

    hit = post(service, body)
    assert hit.headers["x-rankserve-rank-cache"] == "hit" and hit.json()["choices"][0]["text"] == routed["text"]
    rep = stub.Generate(pb.GenerateRequest(model=family, prompt=paraphrase, max_tokens=N, temperature=0.0),
                        metadata=GRPC_AUTH, timeout=60)
    assert rep.rank_cache_hit
    (tmp_path / "subset.json").write_text(json.dumps(cached))
    assert rep.text == cli_generate(model_dir, paraphrase, N, "--subset", str(tmp_path / "subset.json"))["text"]

    # The hits ran no routers: a later miss on the same replica is the only other run. Its count arrives with (or
    # after) any the hits would have made, so seeing it means the hits' are in too.
    other = post(service, {**body, "prompt": "Tom found a shiny red box under his bed."})
    assert other.headers["x-rankserve-rank-cache"] == "miss"
    wait_for(lambda: runs() >= runs0 + 2, what="the second router run to show in /metrics")
    assert runs() == runs0 + 2


def test_a_cached_subset_the_worker_refuses_is_a_miss_and_leaves_the_cache(service, redis):
    """An entry this model's routers refuse (one naming no projections, as a model of another shape would write): the
    worker routes afresh, the router answers a miss and discards the entry, and the worker's own choice replaces it."""
    from rankserve.rank_cache import Embedder, RedisStore
    from rankserve.rank_cache.store import encode_subset

    family = "parse-svd-llm"
    prompt = "A small green frog sat on a lily pad in the quiet pond."
    version = model_version(service, family)
    misses = lambda: metric(service, "ray_rankserve_rank_cache_misses_total", family=family)
    store = RedisStore(redis.url)
    try:
        bad, _ = store.put(family, version, Embedder().embed_one(prompt), encode_subset({"v": 1, "k": {}}), 10_000,
                           time.time())
        n = len(store.entries(family, version)[0])
        wait_for(lambda: metric(service, "ray_rankserve_rank_cache_size", family=family) == n,
                 what="the router's tail thread to add the planted entry to its index")
        misses0 = misses()
        body = {"model": family, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        r = post(service, body)
        assert r.status_code == 200 and r.headers["x-rankserve-rank-cache"] == "miss", r.text
        wait_for(lambda: bad not in store.entries(family, version)[0], what="the refused entry to leave Redis")
        wait_for(lambda: misses() >= misses0 + 1, what="the miss to show in /metrics")
        wait_for(lambda: max(store.entries(family, version)[0], default=0) > bad,
                 what="the write-back of the worker's own choice")
        again = post(service, body)
        assert again.headers["x-rankserve-rank-cache"] == "hit" and again.json()["choices"] == r.json()["choices"]
    finally:
        store.close()


# ---- bad input, auth -------------------------------------------------------------------------------------------

BAD = [
    ({"model": "svd-llm", "prompt": ""}, "prompt"),
    ({"model": "svd-llm", "prompt": "word " * 2000}, "context limit"),
    ({"model": "svd-llm", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "svd-llm", "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"model": "svd-llm", "prompt": "hi", "max_tokens": 100_000}, "limit of 256"),
    ({"model": "svd-llm", "prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"model": "svd-llm", "prompt": "hi", "temperature": 1e-40}, "must be 0 (greedy"),  # once a dead replica
    ({"model": "svd-llm", "prompt": "hi", "top_p": 0.0}, "top_p"),
    ({"model": "svd-llm", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": "gpt-4", "prompt": "hi"}, "unknown model"),
    ({"model": "svd-llm", "prompt": "hi", "stop": ["a" * 300]}, "at most 256"),
]


@pytest.mark.parametrize("body, words", BAD, ids=[w for _, w in BAD])
def test_bad_input_is_400_and_invalid_argument(service, stub, body, words):
    from rankserve.proto import rankserve_pb2 as pb

    for stream in (False, True):
        r = post(service, {**body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and words in err["message"]

    req = pb.GenerateRequest(**body)
    for call in (stub.Generate, lambda *a, **k: list(stub.GenerateStream(*a, **k))):
        with pytest.raises(grpc.RpcError) as e:
            call(req, metadata=GRPC_AUTH, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


def test_a_lone_surrogate_is_400_and_fails_no_other_request(service):
    """Valid JSON ("\\ud800") but no text: MiniLM's tokenizer raised on it inside the router's batched embedding,
    a 500 for it and for every request embedded in the same batch. Now a 400 naming the field, the others unharmed."""
    from concurrent.futures import ThreadPoolExecutor

    json_headers = {**AUTH, "content-type": "application/json"}
    bad = [("/v1/completions", b'{"model": "svd-llm", "prompt": "Once upon a \\ud800", "max_tokens": 4}', "prompt"),
           ("/v1/chat/completions", b'{"model": "svd-llm", "messages": [{"role": "user", "content": "hi \\udc00"}], '
                                    b'"max_tokens": 4}', "messages.0.content"),
           ("/v1/completions", b'{"model": "svd-llm", "prompt": "hi", "stop": ["\\ud800"]}', "stop")]

    def send(i: int) -> httpx.Response:
        if i < len(bad):
            return httpx.post(service.http_url + bad[i][0], content=bad[i][1], headers=json_headers, timeout=60)
        return post(service, {"model": "svd-llm", "prompt": f"Once upon a time, a dog number {i}", "max_tokens": 4})

    with ThreadPoolExecutor(8) as pool:  # sent together: their prompts are embedded in the same batches
        answers = list(pool.map(send, range(8)))
    for (_, _, param), r in zip(bad, answers):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "lone surrogate" in r.json()["error"]["message"]
    assert [r.status_code for r in answers[len(bad):]] == [200] * (8 - len(bad))


@pytest.mark.parametrize("raw", [b"{not json", b"[]", b'{"model": "svd-llm"}', b'{"model": "svd-llm", "prompt": 7}',
                                 b'{"model": "svd-llm", "prompt": "hi", "max_tokens": "lots"}',
                                 b'{"model": "svd-llm", "prompt": "hi", "best_of": 2}',
                                 b"[" * 100_000,
                                 b'{"model": "svd-llm", "prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}",
                                 b'{"model": "svd-llm", "prompt": "hi", "seed": 18446744073709551616}'],
                         ids=["not-json", "list", "no-prompt", "int-prompt", "str-int", "unknown-field", "deep",
                              "long-int", "seed-past-int64"])
def test_malformed_body_is_400(service, raw):
    r = httpx.post(service.http_url + "/v1/completions", content=raw, headers={**AUTH, "content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_malformed_grpc_message_is_not_a_500(service):
    with grpc.insecure_channel(service.grpc_target) as ch:
        call = ch.unary_unary("/rankserve.Generator/Generate", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff\xff", metadata=GRPC_AUTH, timeout=30)
    assert e.value.code() != grpc.StatusCode.OK and e.value.code() != grpc.StatusCode.INTERNAL, e.value


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY}],
                         ids=["missing", "wrong", "no-scheme"])
def test_api_key_required(service, stub, headers):
    from rankserve.proto import rankserve_pb2 as pb

    body = {"model": "svd-llm", "prompt": "hi", "max_tokens": 2}
    r = post(service, body, headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(service.http_url + "/v1/models", headers=headers, timeout=10).status_code == 401
    md = tuple(headers.items())
    for call in (stub.Generate, lambda *a, **k: list(stub.GenerateStream(*a, **k))):
        with pytest.raises(grpc.RpcError) as e:
            call(pb.GenerateRequest(**body), metadata=md, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_null_means_default_and_any_valid_key_passes(service, stub):
    """OpenAI clients send null for optional fields; a client may send both credential headers, one of them stale."""
    from rankserve.proto import rankserve_pb2 as pb

    nulls = dict.fromkeys(["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "user"])
    r = post(service, {"model": "svd-llm", "prompt": "hi", **nulls, "max_tokens": 2},
             headers={"authorization": "Bearer stale", "x-api-key": KEY})
    assert r.status_code == 200, r.text
    r = post(service, {"model": "svd-llm", "prompt": "hi", "max_tokens": 2, "temperature": None},
             headers={"x-api-key": KEY, "authorization": "Bearer stale"})
    assert r.status_code == 200, r.text
    rep = stub.Generate(pb.GenerateRequest(model="svd-llm", prompt="hi", max_tokens=2),
                        metadata=(("x-api-key", KEY), ("authorization", "Bearer stale")), timeout=60)
    assert rep.usage.completion_tokens <= 2


# ---- cancellation, timeout -----------------------------------------------------------------------------------------

def test_client_going_away_cancels_the_generation(service):
    cancelled0 = metric(service, "ray_rankserve_worker_requests_total", family="svd-llm", outcome="cancelled")
    long = "Once upon a time " * 60  # a long prompt and 256 new tokens: far longer than reading two chunks
    with httpx.stream("POST", service.http_url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "svd-llm", "prompt": long, "max_tokens": 256, "stream": True}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break  # leaving the block closes the connection
    wait_for(lambda: metric(service, "ray_rankserve_worker_requests_total", family="svd-llm",
                            outcome="cancelled") >= cancelled0 + 1, what="the worker to count a cancelled request")
    t0 = time.time()
    assert post(service, {"model": "svd-llm", "prompt": "hi", "max_tokens": 4}).status_code == 200
    assert time.time() - t0 < 10  # the replica is free again


def test_request_timeout(service, stub):
    from rankserve.proto import rankserve_pb2 as pb

    body = {"model": "deadline", "prompt": "Once upon a time " * 60, "max_tokens": 256, "temperature": 0}
    r = post(service, body)
    assert r.status_code == 408 and "timeout" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(**body), metadata=GRPC_AUTH, timeout=60)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _, chunks = sse(service, body)
    assert chunks[-1]["choices"][0]["finish_reason"] == "timeout"


def test_full_queue_is_refused_with_503(service, stub):
    from concurrent.futures import ThreadPoolExecutor

    from rankserve.proto import rankserve_pb2 as pb

    # ignore_eos: a reply that ended early with EOS would answer 200 inside the deadline
    body = {"model": "deadline", "prompt": "Once upon a time " * 60, "max_tokens": 256, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda _: post(service, body), range(8)))
    statuses = sorted(r.status_code for r in rs)
    assert set(statuses) <= {408, 503} and 503 in statuses, statuses  # 408: the ones that ran into the deadline
    for r in rs:
        assert r.json()["error"]["message"]
    assert "queue is full" in next(r for r in rs if r.status_code == 503).json()["error"]["message"]

    def call(_):
        try:
            stub.Generate(pb.GenerateRequest(**body), metadata=GRPC_AUTH, timeout=60)
        except grpc.RpcError as e:
            return e.code()

    with ThreadPoolExecutor(8) as pool:
        codes = set(pool.map(call, range(8)))
    assert codes <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    assert grpc.StatusCode.UNAVAILABLE in codes


# ---- Redis going away (last: it restarts Redis empty) ------------------------------------------------------------

def test_service_answers_with_redis_stopped(service, redis):
    body = {"model": "svd-llm", "prompt": "A cat sat on the mat and looked at the moon.", "max_tokens": 8}
    assert post(service, body).status_code == 200
    redis.stop()
    try:
        for i in range(3):  # the first calls notice; all of them answer
            r = post(service, {**body, "prompt": body["prompt"] + " " * i + str(i)})
            assert r.status_code == 200, r.text
        wait_for(lambda: post(service, body).status_code == 200
                 and metric(service, "ray_rankserve_rank_cache_redis_up") == 0, what="redis_up to drop to 0")
    finally:
        redis.start()
    wait_for(lambda: post(service, body).status_code == 200
             and metric(service, "ray_rankserve_rank_cache_redis_up") == 1, timeout=60, what="redis_up back to 1")
