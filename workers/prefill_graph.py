"""One prompt's prefill replayed from a CUDA graph: a request joins a running batch without the eager forward's
host cost.

The eager forward launches ~50 kernels a layer from Python; at the LLaMA-7B shape that is 26-43 ms of host time
for short prompts, and every running row waits for it while a request joins (bench/results/
continuous-h200.md: 24 one-row prefills of ~176 tokens took 0.85 s). Here one graph per prompt-length bucket
(powers of two from 16 up to the context) runs `Transformer.forward(fresh=True)` on the right-padded prompt into a
one-row staging cache; the row's K/V are then copied into its slot of the batch's cache. The padding is causal-safe
(a real token's earlier keys are all real) and its K/V writes land in the staging cache's scratch slot.

Memory: the staging cache holds one row of the whole context (1.07 GB at the 7B shape with 2,048 positions, bf16)
and the captured buckets keep their activations in one graph memory pool, shared by all of them since they replay
one at a time (so it holds about the largest bucket's, not the sum: 422 MiB for all 8 buckets at the 7B shape with
2,048 positions, against 640 MiB as a pool per bucket, with every replay, in any order, equal to the eager forward's
argmax; bench/results/prefill-pool-h200.md); the engine counts the staging cache and the pool, as it stands, against
its decoder_memory_bytes (Engine._prefill_bytes, `pool_bytes`).

    graphs = PrefillGraphs(model, max_len=2048)
    logits = graphs.prefill(prompt_ids, cache, slot)   # (V,) fp32; cache row `slot` holds the prompt, its
                                                       # position set to len(prompt_ids)
"""

from __future__ import annotations

from typing import Callable

import torch

from rankserve.workers.host import upload_into
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import Transformer

MIN_BUCKET = 16  # shortest padded prompt: below it a graph saves nothing worth its memory


def pool_bytes(*pools: tuple | None) -> int:
    """Bytes the CUDA caching allocator holds in segments of these graph memory pools (torch.cuda.graph_pool_handle()
    handles; None ones are skipped, and none at all give 0). One memory snapshot, host-side bookkeeping: call it when
    sizing, not per step."""
    ids = {tuple(p) for p in pools if p is not None}
    if not ids:
        return 0
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) in ids)


def _capture(fn: Callable[[], torch.Tensor], dev: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`fn` run twice on a side stream (cuBLAS handles and workspaces, lazy inits), then captured; -> the graph and
    its output. The warm-up runs write what the replays will write."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()  # captured, not run: the replay that follows runs it
    return g, out


def _place(src: KVCache, cache: KVCache, slot: int, n: int) -> None:
    """Row 0's first n positions of the one-row cache `src` into row `slot` of `cache`, its position set to n."""
    cache._k[:, slot, :n].copy_(src._k[:, 0, :n])  # (layers, n, H_kv, D)
    cache._v[:, slot, :n].copy_(src._v[:, 0, :n])
    cache.seqlens[slot:slot + 1].fill_(n)  # a fill kernel: `seqlens[slot] = n` copies from the host and syncs


class PrefillGraphs:
    """CUDA graphs of a one-row prefill per prompt-length bucket, captured on first use. `graph=False` runs the
    same padded forward eagerly (the CPU, tests). Graphs are not thread-safe: one caller at a time (the engine's
    thread). A PARSE slots model's masks are per batch row: `ParseSlots.prefill` points them at one row's buffer
    (workers/parse_decode.py) around each call."""

    def __init__(self, model: Transformer, max_len: int, graph: bool = True, stage: KVCache | None = None,
                 pool: tuple | None = None) -> None:
        """`stage` (a one-row cache of >= max_len positions) and `pool` (a graph memory pool handle) may be shared
        by several PrefillGraphs that run one at a time (PARSE: one per rank-slots model). Without a pool, the
        buckets' graphs share one of their own: each replay's output is copied out before the next replay, the
        rule for graphs on one pool (as the PARSE slot graphs and ChunkedPrefill's have run on the H200)."""
        cfg, w = model.cfg, model.embed.weight
        if graph and w.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use graph=False on the CPU")
        if stage is not None and (stage.batch_size != 1 or stage.max_seq_len < max_len):
            raise ValueError(f"a staging cache of one row and >= {max_len} positions is needed")
        if graph and pool is None:
            pool = torch.cuda.graph_pool_handle()
        self.model, self.max_len, self.graph, self.pool = model, max_len, graph, pool
        # (L, 1, max_len + 1, H_kv, D): filled from position 0 by each replay, its rows copied out after
        if stage is None:
            stage = KVCache(cfg.num_hidden_layers, 1, max_len, cfg.num_key_value_heads, cfg.head_dim, device=w.device,
                            dtype=w.dtype)
        self.stage = stage
        # bucket -> (graph or None, static tokens (1, bucket), static length (1,), the graph's logits (1, V) or None)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    def bucket(self, n: int) -> int:
        """Padded length of an n-token prompt."""
        return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), self.max_len)

    def replays(self, n: int) -> bool:
        """Whether an n-token prompt replays a graph already captured, so that no module of the model runs (its
        attributes, such as a PARSE slot's masks, are then not read: what the graph captured is)."""
        entry = self._graphs.get(self.bucket(n))
        return entry is not None and entry[0] is not None

    def buckets(self) -> list[int]:
        """Buckets captured so far."""
        return sorted(self._graphs)

    @torch.inference_mode()
    def prefill(self, ids: list[int], cache: KVCache, slot: int) -> torch.Tensor:
        """The prompt `ids` into row `slot` of `cache` (its position set to len(ids)); -> its last logits (V,) fp32,
        a tensor of its own."""
        n = len(ids)
        if not 1 <= n <= min(self.max_len, cache.max_seq_len):
            raise ValueError(f"a prompt of {n} tokens does not fit (1..{min(self.max_len, cache.max_seq_len)})")
        L = self.bucket(n)
        if L not in self._graphs:
            self._capture(L)
        g, tokens, length, logits = self._graphs[L]
        host = torch.zeros(1, L, dtype=torch.long)
        host[0, :n] = torch.tensor(ids)
        upload_into(tokens, host)  # queued: no wait for the device's earlier work
        length.fill_(n)
        if g is not None:
            g.replay()
        else:
            logits = self._forward(tokens, length)
        _place(self.stage, cache, slot, n)
        return logits[0].clone()

    def _forward(self, tokens: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        self.stage.seqlens.zero_()
        return self.model(tokens, self.stage, length, last_only=True, fresh=True)  # (1, V)

    def _capture(self, L: int) -> None:
        dev = self.model.embed.weight.device
        tokens = torch.zeros(1, L, dtype=torch.long, device=dev)
        length = torch.full((1,), L, dtype=torch.int32, device=dev)
        if not self.graph:
            self._graphs[L] = (None, tokens, length, None)
            return
        g, logits = _capture(lambda: self._forward(tokens, length), dev, self.pool)
        self._graphs[L] = (g, tokens, length, logits)


class ChunkedPrefill:
    """A long prompt prefilled a chunk at a time, so the rows already decoding take a step between its chunks instead
    of waiting for the whole prompt (at the 7B shape a 2,000-token prefill holds them for ~48 ms;
    bench/results/continuous-h200.md).

    The chunks go into a one-row cache of its own (`fill`, the whole context), each attending to the ones before
    (flash attention over exactly the positions filled: `Transformer.forward(at=...)`); `place` then copies the
    finished prompt's K/V into its row of the batch's cache. One prompt fills at a time. With `graph` (a static model
    on CUDA) a chunk replays a CUDA graph, one per (chunk size, start) in use (starts are multiples of the chunk
    size, or of the prefix cache's 64-token blocks after a hit), captured on first use, on one shared memory pool;
    otherwise, and whenever `run` is given another model (PARSE slots, masks narrowed to the
    row by the caller), it runs eagerly.

        chunks = ChunkedPrefill(model, max_len=4096)
        for start in range(0, len(ids), 512):
            logits = chunks.run(ids, start, 512)   # (V,) fp32: the last token's, once the last chunk has run
        chunks.place(cache, slot, len(ids))
    """

    def __init__(self, model: Transformer, max_len: int, graph: bool = True) -> None:
        cfg, w = model.cfg, model.embed.weight
        if graph and w.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use graph=False on the CPU")
        self.model, self.max_len, self.graph = model, max_len, graph
        self.fill = KVCache(cfg.num_hidden_layers, 1, max_len, cfg.num_key_value_heads, cfg.head_dim,
                            device=w.device, dtype=w.dtype)  # (L, 1, max_len + 1, H_kv, D)
        # (chunk size, start) -> (graph or None, static tokens (1, chunk), static length (1,), its logits (1, V) or None)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor, torch.Tensor,
                                                  torch.Tensor | None]] = {}
        self.pool = torch.cuda.graph_pool_handle() if graph else None  # replays run one at a time: one pool

    def graphs(self) -> list[tuple[int, int]]:
        """(chunk size, start) of the graphs captured so far."""
        return sorted(k for k, v in self._graphs.items() if v[0] is not None)

    @torch.inference_mode()
    def run(self, ids: list[int], start: int, chunk: int, model: Transformer | None = None) -> torch.Tensor:
        """ids[start : start + chunk] at positions start.. of the fill cache (the chunks before it already there);
        -> the logits of its last token (V,) fp32, a tensor of its own. `model`: run it eagerly instead."""
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 token, got {chunk}")
        piece = ids[start:start + chunk]
        if not piece or start + len(piece) > self.max_len:
            raise ValueError(f"no chunk of a {len(ids)}-token prompt starts at {start} (context {self.max_len})")
        chunk = min(chunk, self.max_len - start)  # the last chunk's padding stays inside the cache
        key = (chunk, start)
        if key not in self._graphs:
            dev = self.model.embed.weight.device
            self._graphs[key] = (None, torch.zeros(1, chunk, dtype=torch.long, device=dev),
                                 torch.ones(1, dtype=torch.int32, device=dev), None)
        g, tokens, length, logits = self._graphs[key]
        host = torch.zeros(1, chunk, dtype=torch.long)
        host[0, :len(piece)] = torch.tensor(piece)
        upload_into(tokens, host)  # queued: no wait for the device's earlier work
        length.fill_(len(piece))
        if model is not None or not self.graph:
            logits = self._forward(model or self.model, tokens, length, start)
        else:
            if g is None:
                g, logits = _capture(lambda: self._forward(self.model, tokens, length, start),
                                     self.model.embed.weight.device, self.pool)
                self._graphs[key] = (g, tokens, length, logits)
            g.replay()
        return logits[0].clone()

    def place(self, cache: KVCache, slot: int, n: int) -> None:
        """The filled prompt's n positions into row `slot` of `cache`, its position set to n."""
        _place(self.fill, cache, slot, n)

    def _forward(self, model: Transformer, tokens: torch.Tensor, length: torch.Tensor, start: int) -> torch.Tensor:
        self.fill.seqlens.fill_(start)
        return model(tokens, self.fill, length, last_only=True, at=start)  # (1, V)
