"""The Worker deployment's request loop, in-process (no Ray cluster): same text as Engine.generate, the stop token
kept out of the text, prompt-length check with its parameter, cancellation freeing the replica, the request
timeout, batching (concurrent requests decode together, each with its own text; FIFO beyond the batch size), an
error in one request failing that request only (a device error failing health checks). The bundled stories260K
model, greedy.

Run alone:  .venv/bin/python -m pytest tests/test_worker.py -q
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from rankserve.deployments.worker import Worker, fold, model_version
from rankserve.workers.engine import Engine
from rankserve.workers.sampler import SamplingParams

pytestmark = pytest.mark.serve
MODEL = Path(__file__).resolve().parents[1] / "models" / "stories260K"
PROMPT = "Once upon a time"


def make_worker(**spec) -> Worker:
    return Worker.func_or_class("dense", {"model_dir": str(MODEL), "torch_threads": 1, **spec})


def greedy(n: int) -> dict:
    return dict(max_new_tokens=n, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=())


async def collect(agen, limit: int | None = None) -> list[dict]:
    out = []
    async for ev in agen:
        out.append(ev)
        if limit is not None and len(out) >= limit:
            break
    return out


@pytest.fixture(scope="module")
def engine():
    return Engine.load(MODEL)


def test_same_text_as_engine_generate(engine):
    w = make_worker()
    ref = engine.generate(PROMPT, SamplingParams(**greedy(40)))
    out = asyncio.run(w.generate(PROMPT, greedy(40), cached=False, subset=None))
    assert out["text"] == ref.text and out["token_ids"] == ref.token_ids
    assert out["finish_reason"] == ref.finish_reason and out["prompt_tokens"] == ref.num_prompt_tokens
    assert out["completion_tokens"] == len(ref.token_ids)
    assert out["cached"] is False and out["subset"] is None  # no PARSE routers: the static ranks


def test_stop_token_is_not_text(engine):
    """Run until EOS: the text and token ids match Engine.generate, the EOS isn't counted."""
    w = make_worker(max_tokens=400)
    ref = engine.generate(PROMPT, SamplingParams(**greedy(400)))
    events = asyncio.run(collect(w.stream(PROMPT, greedy(400), cached=True, subset=None)))
    out = fold(events)
    assert out["text"] == ref.text and out["token_ids"] == ref.token_ids
    assert out["finish_reason"] == ref.finish_reason
    if ref.finish_reason == "stop":
        assert events[-2]["token_id"] in engine.eos and out["completion_tokens"] == len(ref.token_ids)


def test_prompt_longer_than_context_is_a_400():
    w = make_worker()
    (ev,) = asyncio.run(collect(w.stream("word " * 2000, greedy(8), cached=False, subset=None)))
    assert ev["event"] == "error" and ev["status"] == 400 and ev["param"] == "prompt"
    assert "context limit" in ev["message"]


def test_a_prompt_the_tokenizer_cant_read_is_a_400():
    """A lone surrogate (the router's schema refuses one; this is the guard behind it) made sentencepiece raise a
    RuntimeError, which failed the request with a 500: now it is bad input, like an over-long prompt."""
    w = make_worker()
    (ev,) = asyncio.run(collect(w.stream("Once upon a time \ud800", greedy(4), cached=False, subset=None)))
    assert ev["event"] == "error" and ev["status"] == 400 and ev["param"] == "prompt"
    assert "lone surrogate (U+D800) at character 17" in ev["message"]
    ev["message"].encode("utf-8")  # it goes out in a JSON body
    assert asyncio.run(w.generate(PROMPT, greedy(2), cached=False, subset=None))["completion_tokens"] == 2


def test_long_prompts_tokenize_off_the_event_loop():
    """A 1 M-character prompt takes ~0.3 s to tokenize: on the event loop it would stall every other stream of the
    replica meanwhile, so it runs on a thread; a short one is tokenized inline, so requests queue in arrival order
    (test_fifo_beyond_the_batch_size)."""
    import threading

    w = make_worker()
    real, threads = w.engine.encode_prompt, []
    w.engine.encode_prompt = lambda *a: threads.append(threading.get_ident()) or real(*a)

    async def go():
        loop_thread = threading.get_ident()
        (ev,) = await collect(w.stream("word " * 200_000, greedy(4), cached=False, subset=None))
        out = await w.generate(PROMPT, greedy(2), cached=False, subset=None)
        return loop_thread, ev, out

    loop_thread, ev, out = asyncio.run(go())
    assert ev["status"] == 400 and "context limit" in ev["message"] and out["completion_tokens"] == 2
    assert threads[0] != loop_thread and threads[1] == loop_thread  # (then the engine encodes on its own thread)


def test_max_tokens_above_family_limit_is_a_400():
    w = make_worker(max_tokens=8)
    out = asyncio.run(w.generate(PROMPT, greedy(9), cached=False, subset=None))
    assert out["status"] == 400 and out["param"] == "max_tokens"


def test_cancel_frees_the_replica():
    w = make_worker()

    async def go():
        agen = w.stream(PROMPT, greedy(200), cached=False, subset=None)
        first = await collect(agen, limit=3)  # start + 2 tokens, then the client goes away
        await agen.aclose()
        assert [e["event"] for e in first] == ["start", "token", "token"]
        out = await asyncio.wait_for(w.generate(PROMPT, greedy(4), cached=False, subset=None), timeout=30)
        assert not w._pending  # the cancelled row left its batch: the next request ran at once
        return out

    assert asyncio.run(go())["completion_tokens"] == 4


def test_cancel_while_queued():
    w = make_worker(max_batch_size=1)

    async def go():
        long = asyncio.create_task(w.generate(PROMPT, greedy(200), cached=False, subset=None))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(w.generate(PROMPT, greedy(4), cached=False, subset=None))
        await asyncio.sleep(0.01)
        assert len(w._pending) == 1
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert not w._pending
        return await long

    assert asyncio.run(go())["completion_tokens"] == 200


def test_request_timeout_ends_generation():
    w = make_worker(request_timeout_s=0.05)
    out = asyncio.run(w.generate(PROMPT, greedy(256), cached=False, subset=None))
    assert out["finish_reason"] == "timeout" and out["completion_tokens"] < 256
    assert not w._pending


def test_queued_past_the_deadline_is_a_408(monkeypatch):
    from rankserve.workers import engine as engine_mod

    w = make_worker(max_batch_size=1, request_timeout_s=0.3)
    step = engine_mod._Batch.step

    def slow(self):  # 0.2 s a step: the first request (ended between steps, at 0.4 s) holds the replica's one row
        time.sleep(0.2)  # past the deadline of the second (0.31 s)
        return step(self)

    monkeypatch.setattr(engine_mod._Batch, "step", slow)

    async def go():
        long = asyncio.create_task(w.generate(PROMPT, greedy(256), cached=False, subset=None))
        await asyncio.sleep(0.01)
        late = await w.generate(PROMPT, greedy(4), cached=False, subset=None)
        return late, await long

    late, long = asyncio.run(go())
    assert late["event"] == "error" and late["status"] == 408 and "no free dense replica" in late["message"]
    assert long["finish_reason"] == "timeout"


def test_concurrent_requests_decode_together(engine):
    """Requests that wait together run as one batch, each with the text it gets alone; a request cancelled
    mid-batch leaves it and the others finish."""
    w = make_worker(max_batch_size=4)
    prompts = ["Once upon a time", "The dog", "Lily and Ben went to the park", "One day"]
    refs = [engine.generate(p, SamplingParams(**greedy(n))) for p, n in zip(prompts, (20, 9, 14, 30))]
    sizes = []

    async def go():
        real = w._run_batch

        async def spy(batch):
            sizes.append(len(batch))
            return await real(batch)

        w._run_batch = spy
        tasks = [asyncio.create_task(w.generate(p, greedy(n), cached=False, subset=None))
                 for p, n in zip(prompts, (20, 9, 14, 30))]
        fifth = asyncio.create_task(w.generate(PROMPT, greedy(200), cached=False, subset=None))
        await asyncio.sleep(0)  # all five queued before the loop takes a batch of 4; the fifth waits
        outs = await asyncio.gather(*tasks)
        agen = w.stream(PROMPT, greedy(200), cached=False, subset=None)
        await collect(agen, limit=2)
        await agen.aclose()
        return outs, await fifth

    outs, last = asyncio.run(go())
    assert sizes[0] == 4
    for out, ref in zip(outs, refs):
        assert out["text"] == ref.text and out["token_ids"] == ref.token_ids
        assert out["completion_tokens"] == len(ref.token_ids)
    assert last["completion_tokens"] == 200


@pytest.mark.parametrize("join", [True, False], ids=["continuous", "static"])
def test_a_request_joins_the_running_batch(engine, join):
    """A request that arrives while a batch decodes joins it at the next step and ends long before the batch's
    long row does (join_running=False: it waits for the batch to end); each text is the one it gets alone."""
    w = make_worker(max_batch_size=4, join_running=join)
    refs = [engine.generate(p, SamplingParams(**greedy(n))) for p, n in ((PROMPT, 200), ("The dog", 5))]

    async def go():
        order = []

        async def one(prompt, n):
            out = await w.generate(prompt, greedy(n), cached=False, subset=None)
            order.append(n)
            return out

        long = asyncio.create_task(one(PROMPT, 200))
        while not w._running:
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.03)  # well into the long row's 200 steps
        short = await one("The dog", 5)
        return order, [await long, short]

    order, outs = asyncio.run(go())
    assert order == ([5, 200] if join else [200, 5])
    for out, ref in zip(outs, refs):
        assert out["token_ids"] == ref.token_ids and out["text"] == ref.text


def test_fifo_beyond_the_batch_size():
    w = make_worker(max_batch_size=1)

    async def go():
        order = []

        async def one(i):
            out = await w.generate(PROMPT, greedy(10), cached=False, subset=None)
            order.append(i)
            return out

        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.001)
        outs = await asyncio.gather(*tasks)
        return order, outs

    order, outs = asyncio.run(go())
    assert order == [0, 1, 2] and len({o["text"] for o in outs}) == 1


def test_echo_scores_the_prompt(engine):
    """echo + logprobs: the prompt's entries ride on the start event; max_new_tokens 0 generates nothing."""
    w = make_worker()

    async def go():
        return await asyncio.gather(
            w.generate(PROMPT, dict(max_new_tokens=0, logprobs=2), cached=False, subset=None, echo=True),
            w.generate(PROMPT, {**greedy(3), "logprobs": 1}, cached=False, subset=None, echo=True),
            w.generate(PROMPT, {**greedy(3), "logprobs": 1}, cached=False, subset=None),
            w.generate(PROMPT, dict(max_new_tokens=0), cached=False, subset=None))

    scored, echoed, plain, bad = asyncio.run(go())
    ref = engine.prompt_logprobs(PROMPT, 2)
    assert scored["completion_tokens"] == 0 and scored["text"] == "" and scored["token_ids"] == []
    assert [(e["token"], e["offset"]) for e in scored["prompt_logprobs"]] == [(e.token, e.offset) for e in ref]
    assert [e["logprob"] for e in scored["prompt_logprobs"]] == pytest.approx([e.logprob for e in ref], abs=1e-5)
    assert [len(e["top"]) for e in scored["prompt_logprobs"]] == [2] * len(ref)
    assert echoed["completion_tokens"] == 3 and len(echoed["prompt_logprobs"]) == len(ref)
    assert echoed["token_ids"] == plain["token_ids"] and plain["prompt_logprobs"] is None
    assert bad["event"] == "error" and bad["status"] == 400 and bad["param"] == "max_tokens"


def test_token_id_prompts(engine):
    """A prompt of token ids gives its text's result (generated and echoed), the n choices of one ids prompt route
    once (a dict key of ids), detokenize gives the text back, and an id outside the vocabulary is a 400."""
    w = make_worker()
    ids = engine.tokenizer.encode(PROMPT, bos=True)

    async def go():
        return await asyncio.gather(
            w.generate(PROMPT, {**greedy(6), "logprobs": 1}, cached=False, subset=None, echo=True),
            w.generate(ids, {**greedy(6), "logprobs": 1}, cached=False, subset=None, echo=True),
            w.generate(ids, greedy(6), cached=False, subset=None),
            w.generate([1, engine.tokenizer.vocab_size], greedy(6), cached=False, subset=None),
            w.detokenize(ids), w.detokenize([-3]))

    text, by_ids, again, bad, back, bad_back = asyncio.run(go())
    assert by_ids["token_ids"] == text["token_ids"] == again["token_ids"]
    assert by_ids["prompt_logprobs"] == text["prompt_logprobs"] and by_ids["prompt_tokens"] == text["prompt_tokens"]
    assert bad["event"] == "error" and bad["status"] == 400 and bad["param"] == "prompt"
    assert "is not a token of this model" in bad["message"]
    assert back == {"text": PROMPT}
    assert bad_back["status"] == 400 and "token id -3 at position 0" in bad_back["message"]


def test_a_dead_batch_loop_fails_its_requests():
    """Should the batch loop itself end (a bug), its requests fail instead of waiting forever; the next request
    starts a new loop."""
    w = make_worker()
    real = w._run_batch

    async def broken(batch):
        raise RuntimeError("a bug in the loop")

    w._run_batch = broken
    with pytest.raises(RuntimeError, match="batch loop stopped"):
        asyncio.run(w.generate(PROMPT, greedy(4), cached=False, subset=None))
    w._run_batch = real
    assert asyncio.run(w.generate(PROMPT, greedy(4), cached=False, subset=None))["completion_tokens"] == 4


@pytest.mark.parametrize("bad", [{"max_batch_size": 0}, {"decoder_memory_gb": 0}, {"max_tokens": -1}])
def test_family_options_are_checked(bad):
    with pytest.raises(ValueError, match="must be positive"):
        make_worker(**bad)


def test_model_version_is_stable(tmp_path):
    v = model_version(MODEL)
    assert v == model_version(MODEL) and ":" not in v and v.startswith("dense-")
    assert make_worker().info()["model_version"] == v


def raising_stream(w, exc: BaseException):
    """A stand-in for Engine.stream_batch whose steps raise `exc` (on the engine thread, like a real step)."""
    real = w.engine.stream_batch

    def stream(*args, **kw):
        s = real(*args, **kw)

        def boom():
            raise exc

        s._batch.step = boom
        return s

    return stream


def test_a_failing_request_leaves_the_replica_healthy():
    """A non-device error (here torch.multinomial's, for inf/nan probabilities) fails that request only."""
    w = make_worker()
    real = w.engine.stream_batch
    w.engine.stream_batch = raising_stream(w, RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"))
    with pytest.raises(RuntimeError, match="probability tensor"):
        asyncio.run(w.generate(PROMPT, greedy(4), cached=False, subset=None))
    w.check_health()  # no raise: Serve keeps the replica
    assert w._broken is None and not w._pending
    w.engine.stream_batch = real
    assert asyncio.run(w.generate(PROMPT, greedy(4), cached=False, subset=None))["completion_tokens"] == 4


@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: an illegal memory access was encountered"),
                                 torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")],
                         ids=["cuda-error", "oom"])
def test_a_device_failure_fails_health_checks(exc):
    w = make_worker()
    w.engine.stream_batch = raising_stream(w, exc)
    with pytest.raises(type(exc)):
        asyncio.run(w.generate(PROMPT, greedy(4), cached=False, subset=None))
    with pytest.raises(RuntimeError, match="engine failed"):
        w.check_health()  # Serve restarts the replica after a few of these


def test_join_min_rows_is_checked_and_reaches_the_engine():
    from rankserve.deployments.worker import FamilySpec

    with pytest.raises(ValueError, match="join_min_rows"):
        FamilySpec(model_dir=str(MODEL), join_min_rows=9)  # more than a batch holds
    with pytest.raises(ValueError, match="batch_wait_ms"):
        FamilySpec(model_dir=str(MODEL), batch_wait_ms=-1)
    assert make_worker().engine.join_min == 1  # the engine's default for a static family
    assert make_worker(join_min_rows=3).engine.join_min == 3


def test_prefill_options_reach_the_engine_and_prefix_hits_are_counted():
    from rankserve.deployments.worker import FamilySpec

    with pytest.raises(ValueError, match="prefill_chunk"):
        FamilySpec(model_dir=str(MODEL), prefill_chunk=-1)
    with pytest.raises(ValueError, match="prefix_cache_gb"):
        FamilySpec(model_dir=str(MODEL), prefix_cache_gb=-1)
    assert make_worker(prefix_cache_gb=0).engine.prefix is None
    w = make_worker(prefill_chunk=64, prefix_cache_gb=0.01)
    assert w.engine.prefill_chunk == 64 and w.engine.prefix.max_bytes == int(0.01 * 2**30)
    story = "Once upon a time there was a little girl named Lily. She loved to play outside. " * 3
    first = asyncio.run(w.generate(story + "She", greedy(4), cached=False, subset=None))
    assert first["completion_tokens"] == 4 and w._prefix_seen == 0
    again = asyncio.run(w.generate(story + "He", greedy(4), cached=False, subset=None))
    assert w._prefix_seen == w.engine.prefix.hit_tokens >= 64  # what the counter was given
    plain = Engine.load(MODEL, prefix_cache_bytes=0)
    assert again["text"] == plain.generate(story + "He", SamplingParams(max_new_tokens=4)).text
