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

    def __init__(self, url: str, prefix: str = "rankcache", timeout_s: float = 0.5, stream_maxlen: int = 100_000):
        # Short timeouts and no retries: a down Redis must cost a request at most one timeout, once.
        opts = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self.r = redis.Redis.from_url(url, **opts)
        # The stream reader blocks server-side, so its socket timeout must outlast the block (connections are lazy).
        self.rb = redis.Redis.from_url(url, **{**opts, "socket_timeout": timeout_s + 5.0})
        self.timeout_s = timeout_s
        self.root = f"{prefix}:{KEY_SCHEMA}"
        self.stream = f"{self.root}:stream"
        self.stream_maxlen = stream_maxlen
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
        """All entries of a space as `(ids (N,) int64, vecs (N, 384) float32, subsets list)`."""
        sp = self.space(family, version)
        ids = [int(i) for i in self.r.zrange(f"{sp}:ids", 0, -1)]
        out_ids, vecs, subsets = [], [], []
        for s in range(0, len(ids), batch):
            chunk = ids[s : s + batch]
            pipe = self.r.pipeline(transaction=False)
            for i in chunk:
                pipe.hmget(f"{sp}:e:{i}", "vec", "subset")
            for i, (v, sub) in zip(chunk, pipe.execute()):
                if v is None:  # evicted between ZRANGE and HMGET
                    continue
                out_ids.append(i)
                vecs.append(np.frombuffer(v, dtype="<f4"))
                subsets.append(json.loads(sub))
        dim = vecs[0].shape[0] if vecs else 0
        return np.asarray(out_ids, dtype=np.int64), np.stack(vecs) if vecs else np.zeros((0, dim), np.float32), subsets

    def last_stream_id(self) -> str:
        """The newest stream id (tail from here after a rebuild), "0-0" for an empty stream."""
        last = self.r.xrevrange(self.stream, count=1)
        return last[0][0].decode() if last else "0-0"

    def read_stream(self, after: str, block_ms: int, count: int = 512) -> list[Event]:
        """Events after stream id `after`, waiting up to `block_ms` for the first one."""
        res = self.rb.xread({self.stream: after}, count=count, block=block_ms)
        events = []
        for _, entries in res or []:
            for sid, f in entries:
                ev = Event(sid.decode(), f[b"op"].decode(), f[b"family"].decode(), f[b"version"].decode(), int(f[b"id"]))
                if ev.op == "add":
                    ev.vec = np.frombuffer(f[b"vec"], dtype="<f4")
                    ev.subset = json.loads(f[b"subset"])
                events.append(ev)
        return events

    def close(self) -> None:
        self.r.close()
        self.rb.close()


def _vec_bytes(vec: np.ndarray) -> bytes:
    return np.ascontiguousarray(vec, dtype="<f4").tobytes()
