"""Redis side of the rank cache: the source of truth every router replica rebuilds from.

Layout (plain Redis >= 6; no search module needed), `v1` being the key-schema version:

    rankcache:v1:{family}:{version}:next      INCR counter giving entry ids
    rankcache:v1:{family}:{version}:e:{id}    HASH  vec (384 float32, little endian), subset (JSON), ts
    rankcache:v1:{family}:{version}:ids       ZSET  id -> last use (unix s); the size bound evicts the lowest
    rankcache:v1:stream                       STREAM of op=add (with vec + subset) | op=del, family, version, id

`version` is the model version a subset belongs to (`model_version`: the same on every replica and in
`rankserve build-rank-cache`): a new checkpoint starts an empty space, old ones age out.
Every write goes through one Lua script, so insert + eviction + stream events are atomic across replicas.
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

KEY_SCHEMA = "v1"  # bump when the layout above changes; old keys are then simply ignored

# KEYS: next, ids, stream. ARGV: entry-key prefix, vec, subset, now, max_entries, family, version, stream maxlen.
_PUT = """
local id = redis.call('INCR', KEYS[1])
redis.call('HSET', ARGV[1] .. id, 'vec', ARGV[2], 'subset', ARGV[3], 'ts', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[4], id)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*', 'op', 'add', 'family', ARGV[6], 'version', ARGV[7],
           'id', id, 'vec', ARGV[2], 'subset', ARGV[3])
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

# Any Redis failure (down, timing out, out of memory) makes the cache step aside until Redis answers again.
REDIS_ERRORS = (redis.RedisError, OSError)
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
    vec: np.ndarray | None = None  # (384,) float32 for "add"
    subset: dict | None = None


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

    def space(self, family: str, version: str) -> str:
        _check_name("family", family)
        _check_name("model version", version)
        return f"{self.root}:{family}:{version}"

    def ping(self) -> bool:
        return bool(self.r.ping())

    def put(self, family: str, version: str, vec: np.ndarray, subset: dict | None, max_entries: int, now: float):
        """Store one entry; returns `(id, evicted_ids)`. Evicts least-recently-used entries past `max_entries`."""
        sp = self.space(family, version)
        id, evicted = self._put(
            keys=[f"{sp}:next", f"{sp}:ids", self.stream],
            args=[f"{sp}:e:", _vec_bytes(vec), json.dumps(subset), now, max_entries, family, version, self.stream_maxlen],
        )
        return int(id), [int(e) for e in evicted]

    def touch(self, family: str, version: str, ids: list[int], now: float) -> None:
        """Mark entries as used (the size bound evicts the least recently used)."""
        if ids:
            self.r.zadd(f"{self.space(family, version)}:ids", {str(i): now for i in ids}, xx=True)

    def entries(self, family: str, version: str, batch: int = 512):
        """All entries of a space as `(ids (N,) int64, vecs (N, dim) float32, subsets list)`; malformed ones are
        logged and left out."""
        sp = self.space(family, version)
        ids = [int(i) for i in self.r.zrange(f"{sp}:ids", 0, -1) if i.isdigit()]  # members are INCR ids
        out_ids, vecs, subsets = [], [], []
        for s in range(0, len(ids), batch):
            chunk = ids[s : s + batch]
            pipe = self.r.pipeline(transaction=False)
            for i in chunk:
                pipe.hmget(f"{sp}:e:{i}", "vec", "subset")
            for i, (v, sub) in zip(chunk, pipe.execute()):
                if v is None:  # evicted between ZRANGE and HMGET
                    continue
                try:
                    vec, subset = self._vec(v), _subset(sub)
                except MalformedEntry as e:
                    log.warning("rank cache: skipping entry %s:e:%s: %s", sp, i, e)
                    continue
                out_ids.append(i)
                vecs.append(vec)
                subsets.append(subset)
        vecs = np.stack(vecs) if vecs else np.zeros((0, self.dim), np.float32)  # (N, dim)
        return np.asarray(out_ids, dtype=np.int64), vecs, subsets

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
        if ev.op == "add":
            if b"vec" not in f or b"subset" not in f:
                raise MalformedEntry("an 'add' without vec or subset")
            ev.vec, ev.subset = self._vec(f[b"vec"]), _subset(f[b"subset"])
        elif ev.op != "del":
            raise MalformedEntry(f"unknown op {ev.op!r}")
        return ev

    def _vec(self, raw: bytes) -> np.ndarray:
        """`dim` little-endian float32 -> (dim,) float32."""
        if len(raw) != 4 * self.dim:
            raise MalformedEntry(f"vec is {len(raw)} bytes, not {4 * self.dim} ({self.dim} float32)")
        return np.frombuffer(raw, dtype="<f4")

    def close(self) -> None:
        self.r.close()
        self.rb.close()


def _subset(raw: bytes) -> dict | None:
    """A stored subset: JSON of an object or null."""
    try:
        subset = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting past the parser's limit
        raise MalformedEntry(f"subset is not JSON ({type(e).__name__}: {e})") from None
    if subset is not None and not isinstance(subset, dict):
        raise MalformedEntry(f"subset is a JSON {type(subset).__name__}, not an object or null")
    return subset


def _vec_bytes(vec: np.ndarray) -> bytes:
    return np.ascontiguousarray(vec, dtype="<f4").tobytes()
