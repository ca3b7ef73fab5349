"""The Router's own logic with fake workers (no Ray cluster): /readyz asks every family's worker each time (a worker
that died after answering once must show), a stuck worker counts as not ready after ready_timeout_s, and without the
API key says only its status; /v1/models carries OpenAI's `created`, and there is no /openapi.json to reach without a
key; a prompt the embedder can't read fails only its own request, not those batched with it (the real MiniLM); a
cached rank subset the worker refuses counts as a miss (header, metric, gRPC) and is discarded from the cache.

Run alone:  .venv/bin/python -m pytest tests/test_router.py -q
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

import numpy as np

from rankserve.deployments import router as router_mod
from rankserve.deployments.auth import ApiKeys
from rankserve.deployments.schemas import CompletionRequest, FamilyLimits
from rankserve.deployments.worker import fold
from rankserve.proto import rankserve_pb2 as pb
from rankserve.rank_cache import Hit

# Serve's ingress wrapper has an async __del__, never awaited for these bare instances: harmless here
pytestmark = [pytest.mark.serve, pytest.mark.filterwarnings("ignore:coroutine .*__del__. was never awaited")]
CREATED = 1_700_000_000


class FakeCall:
    """What `handle.method.remote()` returns: awaitable, cancellable."""

    def __init__(self, coro):
        self.task = asyncio.ensure_future(coro)

    def __await__(self):
        return self.task.__await__()

    def cancel(self):
        self.task.cancel()


class FakeWorker:
    """A Worker deployment handle whose `info` answers, fails (a dead replica) or never answers (a stuck one)."""

    def __init__(self, family: str):
        self.family, self.state, self.asked = family, "up", 0
        self.info = SimpleNamespace(remote=lambda: FakeCall(self._info()))

    async def _info(self):
        self.asked += 1
        if self.state == "dead":
            raise RayActorError()
        if self.state == "stuck":
            await asyncio.sleep(3600)
        return dict(family=self.family, model_version=f"{self.family}-v1", max_seq_len=512, max_tokens=64,
                    created=CREATED, chat_template=dict(source=None, bos_token="", eos_token=""))


def make_router(families=("svd-llm", "basis-sharing")):
    """A Router instance without its __init__ (which loads MiniLM): only what readyz and models use."""
    cls = router_mod.Router.func_or_class
    r = cls.__new__(cls)
    r.workers = {f: FakeWorker(f) for f in families}
    r.limits = {f: FamilyLimits(max_tokens=64) for f in families}
    r.keys, r.cache, r.ready_timeout_s = ApiKeys(), None, 5.0
    r.versions, r.created, r.templates, r.started = {}, {}, {}, int(time.time())
    r._versions_locks = {f: asyncio.Lock() for f in families}
    return r


def readyz(r, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    resp = asyncio.run(r.readyz(SimpleNamespace(headers=headers or {})))
    return resp.status_code, json.loads(resp.body)


def test_readyz_asks_every_time():
    r = make_router()
    assert readyz(r)[0] == 200
    assert r.versions == {"svd-llm": "svd-llm-v1", "basis-sharing": "basis-sharing-v1"}
    asked = r.workers["svd-llm"].asked

    r.workers["svd-llm"].state = "dead"  # answered once, then died: readiness must not rely on the first answer
    status, body = readyz(r)
    assert status == 503 and body["status"] == "unavailable"
    assert body["unavailable"] == ["svd-llm: RayActorError"]
    assert r.workers["svd-llm"].asked == asked + 1

    r.workers["svd-llm"].state = "up"
    assert readyz(r)[0] == 200


def test_readyz_gives_up_on_a_stuck_worker():
    r = make_router()
    r.ready_timeout_s = 0.2
    r.workers["basis-sharing"].state = "stuck"
    t0 = time.monotonic()
    status, body = readyz(r)
    assert status == 503 and body["unavailable"] == ["basis-sharing: TimeoutError"]
    assert time.monotonic() - t0 < 2  # families are asked together, each within the timeout


def test_readyz_without_the_key_says_only_the_status():
    """Probes need no key; which families and model versions are served is for key holders."""
    r = make_router()
    r.keys = ApiKeys(["k1"])
    assert readyz(r) == (200, {"status": "ok"})
    assert readyz(r, {"authorization": "Bearer wrong"}) == (200, {"status": "ok"})
    status, body = readyz(r, {"authorization": "Bearer k1"})
    assert status == 200 and body["families"] == {"svd-llm": "svd-llm-v1", "basis-sharing": "basis-sharing-v1"}
    assert body["unavailable"] == [] and body["rank_cache_redis_up"] is False
    r.workers["svd-llm"].state = "dead"
    assert readyz(r) == (503, {"status": "unavailable"})
    assert readyz(r, {"x-api-key": "k1"})[1]["unavailable"] == ["svd-llm: RayActorError"]
    r.keys = ApiKeys()  # auth off: everyone gets the detail
    assert "families" in readyz(r)[1]


def test_models_carry_created():
    r = make_router()
    request = SimpleNamespace(headers={})
    before = asyncio.run(r.models(request))["data"]  # no worker asked yet: the router's start time
    assert [m["created"] for m in before] == [r.started] * 2
    assert readyz(r)[0] == 200
    after = asyncio.run(r.models(request))["data"]
    assert all(m["created"] == CREATED and m["object"] == "model" for m in after)


def test_no_openapi_schema_to_reach_without_a_key():
    from fastapi.testclient import TestClient

    client = TestClient(router_mod.api)
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert client.get(path).status_code == 404, path


# ---- embedding and the rank cache's outcome -------------------------------------------------------------------

class Meter:
    """A stand-in for Serve's Counter / Gauge / Histogram: adds up what it is given."""

    def __init__(self):
        self.total = 0.0

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.total += value

    observe = set = inc


def with_meters(r):
    for name in ("m_requests", "m_latency", "m_ttft", "m_overhead", "m_embed", "m_lookup", "m_hits", "m_misses",
                 "m_size", "m_redis_up"):
        setattr(r, name, Meter())
    r._background = set()
    return r


@pytest.fixture
def bare_batching(monkeypatch):
    """@serve.batch outside a replica: no replica context to read max_ongoing_requests from, and each test's
    asyncio.run is a new event loop, which needs a batch queue of its own (Serve makes one per method, on first use)."""
    import ray.serve.batching as batching

    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
    lazy = router_mod.Router.func_or_class._embed._get_max_batch_size.__self__  # the method's lazy queue holder
    monkeypatch.setattr(lazy, "_queue", None)


def run(coro, timeout_s: float = 60.0):
    """asyncio.run with a deadline: a batch loop that broke would leave its callers waiting for ever."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def embedder():
    from rankserve.rank_cache import Embedder

    return Embedder()


def test_a_prompt_the_embedder_cant_read_fails_only_its_own_request(embedder, bare_batching):
    """A lone surrogate makes MiniLM's tokenizer raise (the schema refuses one now; this is the guard behind it):
    the prompts batched with it are embedded anyway, and its own request fails alone."""
    r = with_meters(make_router(("svd-llm",)))
    r.embedder = embedder
    good = CompletionRequest(model="svd-llm", prompt="Once upon a time")
    bad = good.model_copy(update={"prompt": "Once upon a time \ud800"})  # past the schema, as a bug would let it

    async def go():
        return await asyncio.gather(r._embed("Once upon a time"), r._embed("A dog ran home"), r._embed("x \ud800"),
                                    r._lookup(good, "v1", False), r._lookup(bad, "v1", False),
                                    return_exceptions=True)

    a, b, c, routed, failed = run(go())
    assert a.shape == b.shape == (384,) and np.allclose(a, embedder.embed_one("Once upon a time"), atol=1e-5)
    assert isinstance(c, TypeError)  # returned, not raised: only its own caller fails
    assert isinstance(routed, router_mod.Routed) and routed.vec.shape == (384,)
    assert isinstance(failed, router_mod.Failure) and failed.status == 500 and "embedding" in failed.message


class FakeEmbedder:
    max_chars = 2000

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.full((len(texts), 384), 384 ** -0.5, np.float32)  # (N, 384) unit rows


class FakeCache:
    """The RankCache calls the router makes; every lookup finds entry 7."""

    redis_up = True
    HIT = {"v": 1, "k": {"layers.0.attn.q": [0, 2]}}

    def __init__(self):
        self.discarded, self.inserted = [], []

    def track(self, family: str, version: str) -> None:
        pass

    def lookup(self, family: str, version: str, vec: np.ndarray) -> Hit:
        return Hit(7, 0.99, self.HIT)

    def size(self, family: str, version: str) -> int:
        return 1

    def insert(self, family: str, version: str, vec: np.ndarray, subset: dict | None) -> int:
        self.inserted.append((family, version, subset))
        return 8

    def discard(self, family: str, version: str, id: int) -> None:
        self.discarded.append((family, version, id))


class FakeStream:
    """What `handle.options(stream=True).stream.remote()` returns: async-iterable, cancellable."""

    def __init__(self, events: list[dict]):
        self.events = events

    async def _gen(self):
        for ev in self.events:
            yield ev

    def __aiter__(self):
        return self._gen()

    def cancel(self):
        pass


FRESH = {"v": 1, "k": {"layers.0.attn.q": [1, 3]}}  # the worker's own routers' choice


def worker_events(cached: bool, subset: dict | None, refused: bool) -> list[dict]:
    """A PARSE worker's events for one token: it took the router's cached subset, or refused it and routed afresh."""
    return [dict(event="start", prompt_tokens=3, subset=subset if cached and not refused else FRESH,
                 cached=cached and not refused, cache_rejected=cached and refused),
            dict(event="token", token_id=5, text=" hi"),
            dict(event="end", finish_reason="length", completion_tokens=1)]


def cache_router(refused: bool):
    """A router with a rank cache that always hits, and a worker that refuses (or takes) the cached subset."""
    r = with_meters(make_router(("svd-llm",)))
    r.embedder, r.cache = FakeEmbedder(), FakeCache()
    w = r.workers["svd-llm"]

    async def generate(prompt, sampling, cached, subset, echo):
        return fold(worker_events(cached, subset, refused))

    w.generate = SimpleNamespace(remote=lambda *a: FakeCall(generate(*a)))
    stream = SimpleNamespace(remote=lambda p, s, cached, subset, echo:
                             FakeStream(worker_events(cached, subset, refused)))
    w.options = lambda **kw: SimpleNamespace(stream=stream)
    return r


class GrpcContext:
    def invocation_metadata(self):
        return ()

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


BODY = {"model": "svd-llm", "prompt": "Once upon a time", "max_tokens": 1}


async def http(r, body: dict) -> tuple[int, dict[str, str]]:
    async def read():
        return json.dumps(body).encode()

    resp = await r._http(SimpleNamespace(headers={}, body=read), chat=False)
    if hasattr(resp, "body_iterator"):
        [chunk async for chunk in resp.body_iterator]
    return resp.status_code, dict(resp.headers)


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "taken"])
@pytest.mark.parametrize("path", ["http", "http-stream", "grpc"])
def test_a_refused_cached_subset_is_a_miss_and_leaves_the_cache(refused, path, bare_batching):
    r = cache_router(refused)

    async def go():
        if path == "grpc":
            reply = await r._grpc(pb.GenerateRequest(**BODY), GrpcContext(), chat=False)
            said = "hit" if reply.rank_cache_hit else "miss"
        else:
            status, headers = await http(r, {**BODY, "stream": path == "http-stream"})
            assert status == 200
            said = headers["x-rankserve-rank-cache"]
        await asyncio.gather(*r._background)  # the cache writes run in the background
        return said

    said = run(go())
    if refused:
        assert said == "miss" and (r.m_hits.total, r.m_misses.total) == (0, 1)
        assert r.cache.discarded == [("svd-llm", "svd-llm-v1", 7)]
        assert r.cache.inserted == [("svd-llm", "svd-llm-v1", FRESH)]  # the worker's own choice replaces it
    else:
        assert said == "hit" and (r.m_hits.total, r.m_misses.total) == (1, 0)
        assert r.cache.discarded == [] and r.cache.inserted == []


def test_each_prompt_s_refused_subset_is_counted_once(bare_batching):
    """Two prompts x n = 2: one miss each (the first choice of a prompt settles its outcome), two discards."""
    r = cache_router(refused=True)

    async def go():
        answer = await http(r, {**BODY, "prompt": ["a", "b"], "n": 2})
        await asyncio.gather(*r._background)
        return answer

    status, headers = run(go())
    assert status == 200 and headers["x-rankserve-rank-cache"] == "miss,miss"
    assert (r.m_hits.total, r.m_misses.total) == (0, 2) and len(r.cache.discarded) == 2
