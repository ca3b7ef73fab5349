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

from .store import REDIS_ERRORS, REFUSED, MalformedEntry, RedisStore, decode_subset, encode_subset

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
    """One (family, version): FAISS index + id -> encoded subset (decoded on a hit: a 7B subset is ~0.1 MB
    encoded, ~11 MB as Python lists), mutated only under RankCache._lock."""

    def __init__(self, dim: int):
        self.index = RankIndex(dim)
        self.subsets: dict[int, bytes] = {}
        # ids this replica discarded whose stream "del" has not come back yet: an "add" of one read from the stream
        # before the discard must not bring it back (ids are never reused)
        self.dropped: set[int] = set()

    def add(self, ids, vecs, subsets) -> None:
        # the stream replays what a rebuild read; a discarded id stays out
        new = [j for j, i in enumerate(ids) if int(i) not in self.subsets and int(i) not in self.dropped]
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
        for name, t in [("threshold", threshold)] + [(f"thresholds[{f!r}]", t) for f, t in (thresholds or {}).items()]:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not -1 <= t <= 1:
                raise ValueError(f"rank cache {name} must be a cosine similarity in [-1, 1], got {t!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"rank cache max_entries must be a positive integer, got {max_entries!r}")
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
            last = self.store.last_stream_id()  # before the scan: deletes during it are replayed below
            ids, vecs, subsets = self.store.entries(*sp)
            gone = [ev.id for ev in self.store.events_since(last) if ev.op == "del" and (ev.family, ev.version) == sp]
        except REDIS_ERRORS:
            self.redis_up = False
            return
        with self._lock:
            self._spaces[sp].add(ids, vecs, subsets)  # idempotent with what the stream added meanwhile
            self._spaces[sp].remove(gone)  # an entry evicted while scanning was read by the scan: drop it again

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
            raw = space.subsets[id]
        try:
            subset = decode_subset(raw)  # outside the lock: ~ms for a 7B subset
        except MalformedEntry as e:  # checked when read; cannot happen for what `insert` wrote
            log.warning("rank cache: entry %s of %s cannot be decoded (%s): a miss", id, sp, e)
            return None
        with self._lock:
            self._touched.setdefault(sp, set()).add(id)
        return Hit(id, score, subset)

    def insert(self, family: str, version: str, vec: np.ndarray, subset: dict | None) -> int | None:
        """Write a worker's choice back (Redis, then the local index). None when Redis is down or refuses the
        write (out of memory, say): nothing stored."""
        if not self.redis_up:  # don't pay a connect timeout per request; the tail thread notices recovery
            return None
        raw = encode_subset(subset)
        try:
            id, evicted = self.store.put(family, version, vec, raw, self.max_entries, time.time())
        except REFUSED as e:  # Redis is up but said no: drop this insert only (no rebuild, no "down")
            log.warning("rank cache: Redis refused an insert into %s/%s: %s", family, version, e)
            return None
        except REDIS_ERRORS:
            self.redis_up = False
            return None
        with self._lock:
            space = self._spaces.setdefault((family, version), _Space(self.dim))
            space.add([id], np.asarray(vec, np.float32).reshape(1, -1), [raw])
            space.remove(evicted)
        return id

    def discard(self, family: str, version: str, id: int) -> None:
        """Remove an entry (e.g. one the worker refused), here and in Redis; best effort, never raises."""
        with self._lock:
            space = self._spaces.get((family, version))
            if space is not None:
                space.remove([id])
                space.dropped.add(id)
        if self.redis_up:
            try:
                self.store.delete(family, version, id)
            except REDIS_ERRORS as e:
                log.warning("rank cache: could not delete entry %s of %s/%s: %s", id, family, version, e)

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
                self._apply(last, self._read_added(events))
            except REDIS_ERRORS:
                self.redis_up = False
            except Exception:  # a bug or data we didn't foresee: the local index may be off, so rebuild it
                log.exception("rank cache: the stream reader failed; rebuilding from Redis in %.1f s", backoff)
                self.redis_up = False
                self._stop.wait(backoff)  # no busy loop if it keeps failing
                backoff = min(backoff * 2, 2.0)

    def _read_added(self, events: list) -> list:
        """The events with every `add` this replica needs read from its entry (vec, subset); an add of an entry
        already evicted, malformed, or of a space not served is left out."""
        with self._lock:
            need: dict[Space, list[int]] = {}
            for ev in events:
                space = self._spaces.get((ev.family, ev.version))
                if ev.op == "add" and space is not None and ev.id not in space.subsets:
                    need.setdefault((ev.family, ev.version), []).append(ev.id)
        got = {(sp, i): (vec, raw) for sp, ids in need.items() for i, vec, raw in self.store.fetch(*sp, ids)}
        out = []
        for ev in events:
            if ev.op == "add":
                found = got.get(((ev.family, ev.version), ev.id))
                if found is None:
                    continue
                ev.vec, ev.subset = found
            out.append(ev)
        return out

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
                    space.dropped.discard(ev.id)

    def _flush_touches(self) -> None:
        with self._lock:
            touched, self._touched = self._touched, {}
        now = time.time()
        for (family, version), ids in touched.items():
            self.store.touch(family, version, sorted(ids), now)
