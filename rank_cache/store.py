"""Redis side of the rank cache: the source of truth every router replica rebuilds from.

Layout (plain Redis >= 6; no search module needed), `v1` being the key-schema version:

    rankcache:v2:{family}:{version}:next      INCR counter giving entry ids
    rankcache:v2:{family}:{version}:e:{id}    HASH  vec (384 float32, little endian), subset (encode_subset), ts
    rankcache:v2:{family}:{version}:ids       ZSET  id -> last use (unix s); the size bound evicts the lowest
    rankcache:v2:stream                       STREAM of op=add | op=del, family, version, id (no payload: a
                                              replica reads an added entry from its hash)

`version` is the model version a subset belongs to (`model_version`: the same on every replica and in
`rankserve build-rank-cache`): a new checkpoint starts an empty space, old ones age out.
Every write goes through a Lua script, so insert + eviction + stream events are atomic across replicas.

A PARSE subset of a 7B model names ~330,000 component indices (2 MB as JSON lists); `encode_subset` stores each
matrix's indices as a bitmask instead (~1 bit per pool component), and the stream carries ids only, so Redis
holds one copy of each entry and the size bound (`max_entries`) is what bounds its memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

KEY_SCHEMA = "v2"  # bump when the layout above changes; old keys are then simply ignored (v1: payload in the stream)

# KEYS: next, ids, stream. ARGV: entry-key prefix, vec, subset, now, max_entries, family, version, stream maxlen.
_PUT = """
local id = redis.call('INCR', KEYS[1])
redis.call('HSET', ARGV[1] .. id, 'vec', ARGV[2], 'subset', ARGV[3], 'ts', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[4], id)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*', 'op', 'add', 'family', ARGV[6], 'version', ARGV[7],
           'id', id)
local evicted = {}
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if excess > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #popped, 2 do
    redis.call('DEL', ARGV[1] .. popped[i])
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*', 'op', 'del', 'family', ARGV[6], 'version', ARGV[7],
               'id', popped[i])
    evicted[#evicted + 1] = tonumber(popped[i])
  end
end
return {id, evicted}
"""

# KEYS: ids, stream. ARGV: entry key, id, family, version, stream maxlen. Deletes one entry (if still there).
_DEL = """
if redis.call('ZREM', KEYS[1], ARGV[2]) == 1 then
  redis.call('DEL', ARGV[1])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'op', 'del', 'family', ARGV[3], 'version', ARGV[4],
             'id', ARGV[2])
end
return 0
"""

# Any Redis failure (down, timing out) makes the cache step aside until Redis answers again; a command Redis
# refuses (`redis.ResponseError`: out of memory, a key of the wrong type) costs only that command.
REDIS_ERRORS = (redis.RedisError, OSError)
REFUSED = redis.ResponseError
_MAGIC = b"rsbits1\n"  # encode_subset's bitmask form; anything else is JSON
_MAX_INDEX = 1 << 24  # a component index past this is not a real pool's (the bitmask would be huge): kept as JSON
log = logging.getLogger(__name__)


class MalformedEntry(ValueError):
    """An entry or stream event that isn't what `put` writes (another writer, a hand edit): skipped, never applied."""


@dataclass
class Event:
    """One stream entry, decoded."""

    stream_id: str
    op: str  # "add" | "del"
    family: str
    version: str
    id: int
    vec: np.ndarray | None = None  # (384,) float32 for "add", once read from the entry (RedisStore.fetch)
    subset: bytes | None = None  # the entry's encoded subset (decode_subset), likewise


def model_version(model_dir: str | Path) -> str:
    """A stable id of a checkpoint, the same on every replica: family + hash of its JSON files and weight size."""
    d = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", "rankserve.json"):
        h.update((d / name).read_bytes())
    h.update(str((d / "model.safetensors").stat().st_size).encode())
    family = json.loads((d / "rankserve.json").read_text()).get("family", "model")
    return f"{family}-{h.hexdigest()[:12]}"


def _check_name(kind: str, name: str) -> None:
    if not name or ":" in name:
        raise ValueError(f"{kind} {name!r} must be non-empty and contain no ':' (it is part of a Redis key)")


class RedisStore:
    """Reads and writes rank-cache entries in Redis; every call may raise one of `REDIS_ERRORS`."""

    def __init__(self, url: str, prefix: str = "rankcache", timeout_s: float = 0.5, stream_maxlen: int = 100_000,
                 dim: int = 384):  # vector length every entry must have
        # Short timeouts and no retries: a down Redis must cost a request at most one timeout, once.
        opts = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self.r = redis.Redis.from_url(url, **opts)
        # The stream reader blocks server-side, so its socket timeout must outlast the block (connections are lazy).
        self.rb = redis.Redis.from_url(url, **{**opts, "socket_timeout": timeout_s + 5.0})
        self.timeout_s = timeout_s
        self.root = f"{prefix}:{KEY_SCHEMA}"
        self.stream = f"{self.root}:stream"
        self.stream_maxlen = stream_maxlen
        self.dim = dim
        self._put = self.r.register_script(_PUT)
        self._del = self.r.register_script(_DEL)

    def space(self, family: str, version: str) -> str:
        _check_name("family", family)
        _check_name("model version", version)
        return f"{self.root}:{family}:{version}"

    def ping(self) -> bool:
        return bool(self.r.ping())

    def put(self, family: str, version: str, vec: np.ndarray, subset: bytes, max_entries: int, now: float):
        """Store one entry (`subset` as `encode_subset` gives it); returns `(id, evicted_ids)`. Evicts
        least-recently-used entries past `max_entries`."""
        sp = self.space(family, version)
        id, evicted = self._put(
            keys=[f"{sp}:next", f"{sp}:ids", self.stream],
            args=[f"{sp}:e:", _vec_bytes(vec), subset, now, max_entries, family, version, self.stream_maxlen],
        )
        return int(id), [int(e) for e in evicted]

    def delete(self, family: str, version: str, id: int) -> None:
        """Remove one entry (a no-op when it is already gone); other replicas see a `del` event."""
        sp = self.space(family, version)
        self._del(keys=[f"{sp}:ids", self.stream], args=[f"{sp}:e:{id}", id, family, version, self.stream_maxlen])

    def touch(self, family: str, version: str, ids: list[int], now: float) -> None:
        """Mark entries as used (the size bound evicts the least recently used)."""
        if ids:
            self.r.zadd(f"{self.space(family, version)}:ids", {str(i): now for i in ids}, xx=True)

    def entries(self, family: str, version: str, batch: int = 512):
        """All entries of a space as `(ids (N,) int64, vecs (N, dim) float32, encoded subsets list)`; malformed
        ones are logged and left out."""
        sp = self.space(family, version)
        try:
            members = self.r.zrange(f"{sp}:ids", 0, -1)
        except REFUSED as e:  # e.g. a key of another type there: nothing of ours to read
            log.warning("rank cache: cannot read %s:ids (%s); treating the space as empty", sp, e)
            return self._stack([], [], [])
        ids = [int(i) for i in members if i.isdigit() and 0 < int(i) < 2**63]  # members are INCR ids (FAISS ids)
        out_ids, vecs, subsets = [], [], []
        for s in range(0, len(ids), batch):
            for i, vec, sub in self.fetch(family, version, ids[s : s + batch]):
                out_ids.append(i)
                vecs.append(vec)
                subsets.append(sub)
        return self._stack(out_ids, vecs, subsets)

    def fetch(self, family: str, version: str, ids: list[int]) -> list[tuple[int, np.ndarray, bytes]]:
        """`(id, vec (dim,), encoded subset)` of the entries still there, in order; malformed ones are logged and
        left out."""
        sp = self.space(family, version)
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hmget(f"{sp}:e:{i}", "vec", "subset")
        out = []
        for i, res in zip(ids, pipe.execute(raise_on_error=False)):
            if isinstance(res, Exception):  # this key only (a wrong type, say): the rest are fine
                log.warning("rank cache: skipping entry %s:e:%s: %s", sp, i, res)
                continue
            v, sub = res
            if v is None:  # evicted since its id was read
                continue
            try:
                out.append((i, self._vec(v), _checked(sub)))
            except MalformedEntry as e:
                log.warning("rank cache: skipping entry %s:e:%s: %s", sp, i, e)
        return out

    def _stack(self, ids: list[int], vecs: list[np.ndarray], subsets: list[bytes]):
        vecs = np.stack(vecs) if vecs else np.zeros((0, self.dim), np.float32)  # (N, dim)
        return np.asarray(ids, dtype=np.int64), vecs, subsets

    def events_since(self, after: str, count: int = 10_000) -> list[Event]:
        """Stream events after stream id `after` (no waiting); malformed ones left out."""
        events = []
        for sid, f in self.r.xrange(self.stream, min=f"({after}", max="+", count=count):
            try:
                events.append(self._event(sid.decode(), f))
            except MalformedEntry:
                pass  # the tail thread logs it
        return events

    def last_stream_id(self) -> str:
        """The newest stream id (tail from here after a rebuild), "0-0" for an empty stream."""
        last = self.r.xrevrange(self.stream, count=1)
        return last[0][0].decode() if last else "0-0"

    def read_stream(self, after: str, block_ms: int, count: int = 512) -> tuple[str, list[Event]]:
        """`(last stream id read, events)` after stream id `after`, waiting up to `block_ms` for the first one.
        Malformed entries are logged and left out, but still count as read: the next call starts past them."""
        res = self.rb.xread({self.stream: after}, count=count, block=block_ms)
        last, events = after, []
        for _, entries in res or []:
            for sid, f in entries:
                last = sid.decode()
                try:
                    events.append(self._event(last, f))
                except MalformedEntry as e:
                    log.warning("rank cache: skipping stream entry %s: %s", last, e)
        return last, events

    def _event(self, sid: str, f: dict[bytes, bytes]) -> Event:
        """One stream entry's fields -> Event, or MalformedEntry saying what is wrong."""
        try:
            ev = Event(sid, f[b"op"].decode(), f[b"family"].decode(), f[b"version"].decode(), int(f[b"id"]))
        except (KeyError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            raise MalformedEntry(f"bad or missing op/family/version/id ({type(e).__name__}: {e})") from None
        if not 0 < ev.id < 2**63:  # ids come from INCR: positive int64 (FAISS ids)
            raise MalformedEntry(f"id {ev.id} is not a positive int64")
        if ev.op not in ("add", "del"):
            raise MalformedEntry(f"unknown op {ev.op!r}")
        return ev

    def _vec(self, raw: bytes) -> np.ndarray:
        """`dim` little-endian float32 of unit norm -> (dim,) float32 (any other vector would win every search)."""
        if len(raw) != 4 * self.dim:
            raise MalformedEntry(f"vec is {len(raw)} bytes, not {4 * self.dim} ({self.dim} float32)")
        vec = np.frombuffer(raw, dtype="<f4")
        norm = float(np.linalg.norm(vec.astype(np.float64)))
        if not (np.isfinite(vec).all() and abs(norm - 1) <= 1e-3):
            raise MalformedEntry(f"vec is not a finite unit vector (norm {norm:.4g})")
        return vec

    def close(self) -> None:
        self.r.close()
        self.rb.close()


def encode_subset(subset: dict | None) -> bytes:
    """A subset as stored: a PARSE subset (`{"v": 1, "k": {matrix: sorted distinct indices}}`) as one bitmask a
    matrix behind a small JSON header; anything else (None, another shape) as JSON. `decode_subset` inverts it."""
    ok = isinstance(subset, dict) and set(subset) == {"v", "k"} and type(subset["v"]) is int and subset["v"] == 1
    k = subset["k"] if ok else None
    arrays = [_increasing(ix) for ix in k.values()] if isinstance(k, dict) else [None]
    if any(a is None for a in arrays):
        return json.dumps(subset).encode()
    names = list(k)
    sizes = [int(a[-1]) + 1 if len(a) else 0 for a in arrays]  # bits a matrix (its largest index + 1)
    bits = np.zeros(sum(sizes), dtype=bool)  # (sum sizes,)
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    for b, a in zip(base, arrays):
        bits[b + a] = True
    head = json.dumps({"v": 1, "names": names, "sizes": sizes}).encode()
    return _MAGIC + head + b"\n" + np.packbits(bits).tobytes()


def decode_subset(raw: bytes) -> dict | None:
    """`encode_subset`'s bytes -> the subset; MalformedEntry when they are not what it writes."""
    if not raw.startswith(_MAGIC):
        return _json_subset(raw)
    head, _, packed = raw[len(_MAGIC):].partition(b"\n")
    names, sizes = _header(head)
    bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8))[:sum(sizes)].astype(bool)
    if len(bits) != sum(sizes):
        raise MalformedEntry(f"subset bitmask holds {len(bits)} bits, its header {sum(sizes)}")
    out, b = {}, 0
    for n, size in zip(names, sizes):
        out[n] = np.flatnonzero(bits[b:b + size]).tolist()
        b += size
    return {"v": 1, "k": out}


def _checked(raw: bytes) -> bytes:
    """An entry's encoded subset, checked cheaply (the JSON form parsed; the bitmask form's header and length);
    it is decoded in full only when a lookup hits it."""
    if not raw.startswith(_MAGIC):
        _json_subset(raw)
        return raw
    head, _, packed = raw[len(_MAGIC):].partition(b"\n")
    _, sizes = _header(head)
    if len(packed) != (sum(sizes) + 7) // 8:
        raise MalformedEntry(f"subset bitmask is {len(packed)} bytes, its header says {(sum(sizes) + 7) // 8}")
    return raw


def _header(head: bytes) -> tuple[list[str], list[int]]:
    try:
        h = json.loads(head)
        names, sizes = h["names"], h["sizes"]
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise MalformedEntry(f"subset bitmask header is not ours ({type(e).__name__}: {e})") from None
    if not (isinstance(names, list) and isinstance(sizes, list) and len(names) == len(sizes)
            and all(isinstance(n, str) for n in names)
            and all(type(z) is int and 0 <= z <= _MAX_INDEX for z in sizes)):
        raise MalformedEntry("subset bitmask header: names and sizes do not match")
    return names, sizes


def _increasing(ix: object) -> np.ndarray | None:
    """ix as an int64 array if it is a list of ints, strictly increasing, in [0, _MAX_INDEX) (exactly what a
    bitmask gives back); else None."""
    if not isinstance(ix, list):
        return None
    if not ix:
        return np.zeros(0, dtype=np.int64)
    try:
        a = np.asarray(ix)  # ints only: bools, floats or a mix give another dtype kind
    except (ValueError, OverflowError):
        return None
    if a.ndim != 1 or a.dtype.kind != "i" or a[0] < 0 or a[-1] >= _MAX_INDEX or not (np.diff(a) > 0).all():
        return None
    return a.astype(np.int64)


def _json_subset(raw: bytes) -> dict | None:
    """A subset stored as JSON: an object or null."""
    try:
        subset = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting past the parser's limit
        raise MalformedEntry(f"subset is not JSON ({type(e).__name__}: {e})") from None
    if subset is not None and not isinstance(subset, dict):
        raise MalformedEntry(f"subset is a JSON {type(subset).__name__}, not an object or null")
    return subset


def _vec_bytes(vec: np.ndarray) -> bytes:
    return np.ascontiguousarray(vec, dtype="<f4").tobytes()
