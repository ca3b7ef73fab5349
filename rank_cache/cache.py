"""Rank cache: prompt embedding -> PARSE rank subset, per family and model version.

Redis (`store.RedisStore`) holds the entries; each router replica keeps a local exact FAISS index per
(family, model version) space, rebuilt from Redis at start and kept current by tailing the Redis stream in a
background thread. Lookups are local (sub-millisecond) and never touch Redis; inserts go to Redis and into the
local index at once. When Redis is down, lookups keep serving what the local index holds, inserts are dropped,
`redis_up` turns False, and the tail thread reconnects and rebuilds.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import faiss
import numpy as np

from .store import REDIS_ERRORS, RedisStore

Space = tuple[str, str]  # (family, model version)
log = logging.getLogger(__name__)


class RankIndex:
    """Exact inner-product search over unit vectors: FAISS `IndexIDMap2(IndexFlatIP(dim))`.

    Flat is exact and needs no training; at 1.5 KB per 384-d vector a million entries fit in 1.5 GB.
    Swap in `IndexHNSWFlat(dim, 32, METRIC_INNER_PRODUCT)` here if a space ever grows past that.
    """

    def __init__(self, dim: int = 384):
        self.dim = dim
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        """ids `(N,) int64`, vecs `(N, dim) float32` unit rows."""
        if len(ids):
            self.index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32).reshape(-1, self.dim),
                                    np.asarray(ids, dtype=np.int64))

    def remove(self, ids: list[int]) -> None:
        if ids:
            self.index.remove_ids(np.asarray(ids, dtype=np.int64))

    def search(self, vec: np.ndarray, k: int = 1) -> list[tuple[int, float]]:
        """vec `(dim,)` -> up to k `(id, inner product)`, best first."""
        if self.index.ntotal == 0:
            return []
        D, I = self.index.search(np.ascontiguousarray(vec, dtype=np.float32).reshape(1, self.dim), k)  # (1, k)
        return [(int(i), float(d)) for d, i in zip(D[0], I[0]) if i != -1]

    def __len__(self) -> int:
        return self.index.ntotal


@dataclass
class Hit:
    """A cached choice: `subset` is what the worker used for a similar prompt (None = the static ranks)."""

    id: int
    score: float  # cosine similarity to the cached prompt
    subset: dict | None


class _Space:
    """One (family, version): FAISS index + id -> subset, mutated only under RankCache._lock."""

    def __init__(self, dim: int):
        self.index = RankIndex(dim)
        self.subsets: dict[int, dict | None] = {}

    def add(self, ids, vecs, subsets) -> None:
        new = [j for j, i in enumerate(ids) if int(i) not in self.subsets]  # stream replays what a rebuild read
        if new:
            self.index.add(np.asarray(ids)[new], np.asarray(vecs)[new])
            for j in new:
                self.subsets[int(ids[j])] = subsets[j]

    def remove(self, ids: list[int]) -> None:
        ids = [i for i in ids if i in self.subsets]
        self.index.remove(ids)
        for i in ids:
            del self.subsets[i]


class RankCache:
    """Similarity cache of rank subsets, shared across router replicas through Redis.

    lookup(family, version, vec) -> Hit | None    (vec: `(384,)` unit vector from `Embedder`)
    insert(family, version, vec, subset) -> id | None
    """

    def __init__(
        self,
        redis_url: str,
        threshold: float = 0.9,  # cosine similarity needed for a hit; MiniLM paraphrases score ~0.85-0.97
        max_entries: int = 10_000,  # per (family, version) space; least recently used entries are evicted
        thresholds: dict[str, float] | None = None,  # per-family override of `threshold`
        dim: int = 384,
        redis_timeout_s: float = 0.5,
        poll_ms: int = 200,  # stream read block; also how often LRU touches are flushed
    ):
        self.store = RedisStore(redis_url, timeout_s=redis_timeout_s, dim=dim)
        self.threshold = threshold
        self.thresholds = dict(thresholds or {})
        self.max_entries = max_entries
        self.dim = dim
        self.poll_ms = poll_ms
        self.redis_up = False
        self._spaces: dict[Space, _Space] = {}
        self._touched: dict[Space, set[int]] = {}
        self._lock = threading.Lock()
        self._last_id = "0-0"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self, spaces: list[Space]) -> None:
        """Track these spaces: rebuild them from Redis (if up) and start tailing the stream."""
        with self._lock:
            for sp in spaces:
                self.store.space(*sp)  # validate names early
                self._spaces.setdefault(sp, _Space(self.dim))
        self._rebuild()
        self._thread = threading.Thread(target=self._tail, name="rank-cache-tail", daemon=True)
        self._thread.start()

    def track(self, family: str, version: str) -> None:
        """Start serving a space after `start` (e.g. once a worker reports its model version): load it from Redis."""
        sp = (family, version)
        self.store.space(*sp)
        with self._lock:
            if sp in self._spaces:
                return
            self._spaces[sp] = _Space(self.dim)  # registered first: stream events from now on are applied
        if not self.redis_up:
            return  # the tail thread rebuilds every tracked space when Redis answers again
        try:
            ids, vecs, subsets = self.store.entries(*sp)
        except REDIS_ERRORS:
            self.redis_up = False
            return
        with self._lock:
            self._spaces[sp].add(ids, vecs, subsets)  # idempotent with what the stream added meanwhile

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_ms / 1000 + 2 * self.store.timeout_s + 1)
        self.store.close()

    # ---- the two calls the router makes ----------------------------------------------------------------------

    def lookup(self, family: str, version: str, vec: np.ndarray) -> Hit | None:
        """Nearest cached prompt of this space if its similarity clears the threshold, else None (a miss)."""
        sp = (family, version)
        with self._lock:
            space = self._spaces.get(sp)
            if space is None:
                return None
            found = space.index.search(vec, k=1)
            if not found or found[0][1] < self.thresholds.get(family, self.threshold):
                return None
            id, score = found[0]
            self._touched.setdefault(sp, set()).add(id)
            return Hit(id, score, space.subsets[id])

    def insert(self, family: str, version: str, vec: np.ndarray, subset: dict | None) -> int | None:
        """Write a worker's choice back (Redis, then the local index). None when Redis is down: nothing stored."""
        if not self.redis_up:  # don't pay a connect timeout per request; the tail thread notices recovery
            return None
        try:
            id, evicted = self.store.put(family, version, vec, subset, self.max_entries, time.time())
        except REDIS_ERRORS:
            self.redis_up = False
            return None
        with self._lock:
            space = self._spaces.setdefault((family, version), _Space(self.dim))
            space.add([id], np.asarray(vec, np.float32).reshape(1, -1), [subset])
            space.remove(evicted)
        return id

    def size(self, family: str, version: str) -> int:
        with self._lock:
            space = self._spaces.get((family, version))
            return len(space.index) if space else 0

    # ---- keeping the local index current ---------------------------------------------------------------------

    def _rebuild(self) -> bool:
        """Replace every tracked space by Redis' content; True if Redis answered."""
        try:
            last = self.store.last_stream_id()  # read before the scan: replaying a few events is harmless, missing one is not
            with self._lock:
                spaces = list(self._spaces)
            fresh = {}
            for sp in spaces:
                fresh[sp] = _Space(self.dim)
                ids, vecs, subsets = self.store.entries(*sp)
                fresh[sp].add(ids, vecs, subsets)
        except REDIS_ERRORS:
            self.redis_up = False
            return False
        with self._lock:
            self._spaces.update(fresh)
            self._last_id = last
        self.redis_up = True
        return True

    def _tail(self) -> None:
        """The background thread: apply the stream's events; on any failure, rebuild from Redis (never exit)."""
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if not self.redis_up:
                    if not self._rebuild():  # Redis may have restarted empty: it is the truth, so rebuild in full
                        self._stop.wait(backoff)
                        backoff = min(backoff * 2, 2.0)
                        continue
                    backoff = 0.1
                self._flush_touches()
                last, events = self.store.read_stream(self._last_id, block_ms=self.poll_ms)
                self._apply(last, events)
            except REDIS_ERRORS:
                self.redis_up = False
            except Exception:  # a bug or data we didn't foresee: the local index may be off, so rebuild it
                log.exception("rank cache: the stream reader failed; rebuilding from Redis in %.1f s", backoff)
                self.redis_up = False
                self._stop.wait(backoff)  # no busy loop if it keeps failing
                backoff = min(backoff * 2, 2.0)

    def _apply(self, last: str, events) -> None:
        """Apply events read from the stream, up to stream id `last` (past any malformed entries left out)."""
        with self._lock:
            self._last_id = last
            for ev in events:
                space = self._spaces.get((ev.family, ev.version))
                if space is None:  # a space this replica doesn't serve
                    continue
                if ev.op == "add":
                    space.add([ev.id], ev.vec.reshape(1, -1), [ev.subset])
                elif ev.op == "del":
                    space.remove([ev.id])

    def _flush_touches(self) -> None:
        with self._lock:
            touched, self._touched = self._touched, {}
        now = time.time()
        for (family, version), ids in touched.items():
            self.store.touch(family, version, sorted(ids), now)
