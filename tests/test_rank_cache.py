"""Rank cache against a real redis-server: rebuild from Redis, stream tailing between two replicas, threshold,
size bound (LRU), Redis going down and coming back, malformed entries in Redis skipped (the tail thread never dies).
One test loads the real MiniLM.

Run alone:  .venv/bin/python -m pytest tests/test_rank_cache.py -q     (needs `redis-server` on PATH)
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import redis

from rankserve.rank_cache import KEY_SCHEMA, RankCache, RankIndex
from servers import RedisServer

pytestmark = pytest.mark.serve
DIM = 384


def unit(seed: str) -> np.ndarray:
    """Deterministic fake embedding: hash -> (384,) unit vector."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little"))
    v = rng.standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def near(v: np.ndarray, cos: float, seed: int = 0) -> np.ndarray:
    """A unit vector with cosine `cos` to unit vector v."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(DIM).astype(np.float32)
    w -= (w @ v) * v
    w /= np.linalg.norm(w)
    return (cos * v + np.sqrt(1 - cos**2) * w).astype(np.float32)


def wait_for(cond, timeout: float = 5.0, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path).start()
    yield srv
    srv.stop()


@pytest.fixture
def make_cache(server):
    made = []

    def make(**kw) -> RankCache:
        kw.setdefault("redis_url", server.url)
        c = RankCache(poll_ms=50, **kw)
        c.start([("svd-llm", "m1"), ("basis-sharing", "m1")])
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_index_add_search_remove():
    idx = RankIndex(DIM)
    a, b = unit("a"), unit("b")
    idx.add(np.array([7, 9]), np.stack([a, b]))
    assert len(idx) == 2
    (id, score), *_ = idx.search(a, k=2)
    assert id == 7 and score == pytest.approx(1.0, abs=1e-5)
    idx.remove([7])
    assert [i for i, _ in idx.search(a, k=2)] == [9]


def test_threshold_and_spaces(make_cache):
    c = make_cache(threshold=0.9)
    v = unit("once upon a time")
    subset = {"layers.0.attn.q": [0, 1, 2]}
    assert c.lookup("svd-llm", "m1", v) is None  # empty: a miss
    id = c.insert("svd-llm", "m1", v, subset)
    assert id is not None

    hit = c.lookup("svd-llm", "m1", near(v, 0.95))
    assert hit is not None and hit.subset == subset and hit.score == pytest.approx(0.95, abs=1e-4)
    assert c.lookup("svd-llm", "m1", near(v, 0.85)) is None  # below threshold
    assert c.lookup("basis-sharing", "m1", v) is None  # other family
    assert c.lookup("svd-llm", "m2", v) is None  # other model version

    c.thresholds["svd-llm"] = 0.8  # per-family override
    assert c.lookup("svd-llm", "m1", near(v, 0.85)) is not None


def test_static_choice_is_a_hit(make_cache):
    """A worker without PARSE routers chooses the static ranks (None); that choice is cached too."""
    c = make_cache()
    v = unit("static")
    c.insert("svd-llm", "m1", v, None)
    hit = c.lookup("svd-llm", "m1", v)
    assert hit is not None and hit.subset is None


def test_rebuild_from_redis(make_cache, server):
    a = make_cache()
    vecs = [unit(f"p{i}") for i in range(20)]
    for i, v in enumerate(vecs):
        a.insert("svd-llm", "m1", v, {"i": i})
    r = redis.Redis.from_url(server.url)
    assert r.zcard(f"rankcache:{KEY_SCHEMA}:svd-llm:m1:ids") == 20

    b = make_cache()  # a fresh replica rebuilds its FAISS index from Redis at start
    assert b.size("svd-llm", "m1") == 20
    assert all(b.lookup("svd-llm", "m1", v).subset == {"i": i} for i, v in enumerate(vecs))


def test_stream_keeps_replicas_current(make_cache):
    a, b = make_cache(), make_cache()
    v = unit("shared")
    a.insert("basis-sharing", "m1", v, {"r": 3})
    wait_for(lambda: b.lookup("basis-sharing", "m1", v) is not None, what="replica b to see a's insert")
    assert b.lookup("basis-sharing", "m1", v).subset == {"r": 3}
    assert a.size("basis-sharing", "m1") == b.size("basis-sharing", "m1") == 1


def test_track_a_space_after_start(make_cache, server):
    """A router learns a family's model version from its worker after start: `track` loads that space then."""
    a = make_cache()
    v = unit("late")
    a.insert("svd-llm", "m9", v, {"late": 1})
    b = RankCache(server.url, poll_ms=50)
    b.start([])
    try:
        assert b.lookup("svd-llm", "m9", v) is None
        b.track("svd-llm", "m9")
        assert b.lookup("svd-llm", "m9", v).subset == {"late": 1}
        w = unit("later")
        a.insert("svd-llm", "m9", w, {"late": 2})  # and the stream keeps it current from then on
        wait_for(lambda: b.lookup("svd-llm", "m9", w) is not None, what="b to see the new entry")
    finally:
        b.close()


def test_size_bound_evicts_least_recently_used(make_cache, server):
    a, b = make_cache(max_entries=3), make_cache(max_entries=3)
    vecs = [unit(f"e{i}") for i in range(5)]
    for i in range(3):
        a.insert("svd-llm", "m1", vecs[i], {"i": i})
        time.sleep(0.01)  # distinct last-use times
    assert a.lookup("svd-llm", "m1", vecs[0]) is not None  # use entry 0: entry 1 is now the oldest
    time.sleep(0.3)  # the tail thread flushes the touch to Redis
    a.insert("svd-llm", "m1", vecs[3], {"i": 3})
    a.insert("svd-llm", "m1", vecs[4], {"i": 4})

    r = redis.Redis.from_url(server.url)
    assert r.zcard(f"rankcache:{KEY_SCHEMA}:svd-llm:m1:ids") == 3
    assert a.size("svd-llm", "m1") == 3
    wait_for(lambda: b.size("svd-llm", "m1") == 3 and b.lookup("svd-llm", "m1", vecs[4]) is not None,
             what="replica b to apply the evictions")
    for c in (a, b):
        kept = [i for i, v in enumerate(vecs) if c.lookup("svd-llm", "m1", v) is not None]
        assert kept == [0, 3, 4]


def test_redis_down_then_back(make_cache, server):
    c = make_cache()
    v = unit("before")
    c.insert("svd-llm", "m1", v, {"x": 1})
    assert c.redis_up

    server.stop()
    wait_for(lambda: not c.redis_up, what="redis_up to turn False")
    assert c.lookup("svd-llm", "m1", v).subset == {"x": 1}  # the local index keeps serving
    t0 = time.time()
    assert c.insert("svd-llm", "m1", unit("during"), {"x": 2}) is None  # dropped, and without waiting on Redis
    assert time.time() - t0 < 0.05

    server.start()  # same port, empty: Redis is the truth, so the replica rebuilds to empty
    wait_for(lambda: c.redis_up, timeout=10, what="redis_up to turn True")
    assert c.size("svd-llm", "m1") == 0
    assert c.insert("svd-llm", "m1", v, {"x": 3}) is not None
    assert c.lookup("svd-llm", "m1", v).subset == {"x": 3}


def test_redis_absent_at_start(tmp_path):
    from servers import free_port

    c = RankCache(f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s=0.2, poll_ms=50)
    t0 = time.time()
    c.start([("svd-llm", "m1")])
    try:
        assert not c.redis_up
        assert c.lookup("svd-llm", "m1", unit("x")) is None
        assert c.insert("svd-llm", "m1", unit("x"), None) is None
        assert time.time() - t0 < 2
    finally:
        c.close()


def test_bad_names_rejected(make_cache):
    c = make_cache()
    with pytest.raises(ValueError, match="no ':'"):
        c.insert("svd:llm", "m1", unit("x"), None)


@pytest.mark.slow
def test_minilm_embedder_similarity():
    from rankserve.rank_cache import Embedder

    e = Embedder()
    x = e.embed(["Once upon a time, there was a little girl named Lily.",
                 "Once upon a time there was a little girl called Lily.",
                 "The quarterly tax filing deadline is next Tuesday."])
    assert x.shape == (3, DIM) and x.dtype == np.float32
    assert np.allclose(np.linalg.norm(x, axis=1), 1, atol=1e-5)
    assert x[0] @ x[1] > 0.9 > 0.3 > x[0] @ x[2]


# ---- data the cache didn't write: skipped, never fatal -------------------------------------------------------------

STREAM = f"rankcache:{KEY_SCHEMA}:stream"


def test_malformed_stream_entries_are_skipped(make_cache, server, caplog):
    """Another writer's (or a hand-made) bad entry is logged and skipped; the tail thread keeps applying later ones."""
    a, b = make_cache(), make_cache()
    r = redis.Redis.from_url(server.url)
    good = {"op": "add", "family": "svd-llm", "version": "m1", "id": "500", "vec": unit("x").tobytes(), "subset": "{}"}
    bad = [
        {"op": "add", "family": "x", "version": "v9", "id": "1", "vec": "x", "subset": "{not json"},  # other space
        {**good, "vec": unit("x")[:100].tobytes()},  # a tracked space: short vector
        {**good, "subset": "{not json"},
        {**good, "subset": "[1, 2]"},  # JSON, but not an object
        {**good, "subset": "[" * 100_000},  # deeper than the JSON parser goes
        {**good, "id": "not-an-id"},
        {**good, "op": "upsert"},
        {"op": "add", "family": "svd-llm"},  # fields missing
    ]
    for fields in bad:
        r.xadd(STREAM, fields)
    v = unit("after the bad ones")
    a.insert("svd-llm", "m1", v, {"ok": 1})
    wait_for(lambda: b.lookup("svd-llm", "m1", v) is not None, what="replica b to see the insert after bad entries")
    assert b.lookup("svd-llm", "m1", v).subset == {"ok": 1} and b.size("svd-llm", "m1") == 1
    assert b.redis_up and b._thread.is_alive()
    # a and b both skip each; a's tail thread reads the stream on its own time (the wait above is on b only: a CI run
    # once asserted with 13 of the 16 skips logged), so wait for the count rather than read it once
    wait_for(lambda: sum("skipping stream entry" in m for m in caplog.messages) >= 2 * len(bad),
             what="both replicas to log a skip for every bad entry")


def test_tail_thread_survives_an_unexpected_error(make_cache):
    """Any exception in the tail thread (a bug, say) marks Redis down and rebuilds; the thread never ends."""
    a, b = make_cache(), make_cache()
    apply, failed = b._apply, []

    def apply_once_failing(last, events):
        if events and not failed:
            failed.append(last)
            raise RuntimeError("boom")
        apply(last, events)

    b._apply = apply_once_failing
    v, w = unit("lost in the failure"), unit("after it")
    a.insert("svd-llm", "m1", v, {"v": 1})
    wait_for(lambda: failed, what="the injected failure")
    wait_for(lambda: b.lookup("svd-llm", "m1", v) is not None, what="b to rebuild from Redis")  # the rebuild has v
    a.insert("svd-llm", "m1", w, {"w": 1})
    wait_for(lambda: b.lookup("svd-llm", "m1", w) is not None, what="b to tail the stream again")
    assert b.redis_up and b._thread.is_alive()


def test_malformed_entries_are_skipped_on_rebuild(make_cache, server):
    a = make_cache()
    v = unit("good")
    a.insert("svd-llm", "m1", v, {"good": 1})
    r = redis.Redis.from_url(server.url)
    sp = f"rankcache:{KEY_SCHEMA}:svd-llm:m1"
    r.hset(f"{sp}:e:900", mapping={"vec": b"x", "subset": "{}"})
    r.hset(f"{sp}:e:901", mapping={"vec": unit("y").tobytes(), "subset": "{not json"})
    r.zadd(f"{sp}:ids", {"900": time.time(), "901": time.time(), "junk": time.time()})

    b = make_cache()  # start() rebuilds from Redis: the bad entries are left out, the good one served
    assert b.size("svd-llm", "m1") == 1 and b.lookup("svd-llm", "m1", v).subset == {"good": 1}
    assert b.redis_up
