"""One prompt's prefill replayed from a CUDA graph: a request joins a running batch without the eager forward's
host cost.

The eager forward launches ~50 kernels a layer from Python; at the LLaMA-7B shape that is 26-43 ms of host time
for short prompts, and every running row waits for it while a request joins (bench/results/
continuous-h200.md: 24 one-row prefills of ~176 tokens took 0.85 s). Here one graph per prompt-length bucket
(powers of two from 16 up to the context) runs `Transformer.forward(fresh=True)` on the right-padded prompt into a
one-row staging cache; the row's K/V are then copied into its slot of the batch's cache. The padding is causal-safe
(a real token's earlier keys are all real) and its K/V writes land in the staging cache's scratch slot.

Memory: the staging cache holds one row of the whole context (1.07 GB at the 7B shape with 2,048 positions, bf16)
and each captured bucket keeps its activations' pool; neither counts against the engine's decoder_memory_bytes.

    graphs = PrefillGraphs(model, max_len=2048)
    logits = graphs.prefill(prompt_ids, cache, slot)   # (V,) fp32; cache row `slot` holds the prompt, its
                                                       # position set to len(prompt_ids)
"""

from __future__ import annotations

import torch

from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import Transformer

MIN_BUCKET = 16  # shortest padded prompt: below it a graph saves nothing worth its memory


class PrefillGraphs:
    """CUDA graphs of a one-row prefill per prompt-length bucket, captured on first use. `graph=False` runs the
    same padded forward eagerly (the CPU, tests). Graphs are not thread-safe: one caller at a time (the engine's
    thread). Static models only: PARSE masks are per batch row and would be baked into the graph."""

    def __init__(self, model: Transformer, max_len: int, graph: bool = True) -> None:
        cfg, w = model.cfg, model.embed.weight
        if graph and w.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use graph=False on the CPU")
        self.model, self.max_len, self.graph = model, max_len, graph
        # (L, 1, max_len + 1, H_kv, D): filled from position 0 by each replay, its rows copied out after
        self.stage = KVCache(cfg.num_hidden_layers, 1, max_len, cfg.num_key_value_heads, cfg.head_dim,
                             device=w.device, dtype=w.dtype)
        # bucket -> (graph or None, static tokens (1, bucket), static length (1,), the graph's logits (1, V) or None)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    def bucket(self, n: int) -> int:
        """Padded length of an n-token prompt."""
        return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), self.max_len)

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
        tokens.copy_(host, non_blocking=True)
        length.fill_(n)
        if g is not None:
            g.replay()
        else:
            logits = self._forward(tokens, length)
        cache._k[:, slot, :n].copy_(self.stage._k[:, 0, :n])  # (layers, n, H_kv, D)
        cache._v[:, slot, :n].copy_(self.stage._v[:, 0, :n])
        cache.seqlens[slot] = n
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
        side = torch.cuda.Stream(dev)  # warm-up off the capture: cuBLAS handles and workspaces, lazy inits
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(tokens, length)
        torch.cuda.current_stream(dev).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            logits = self._forward(tokens, length)
        self._graphs[L] = (g, tokens, length, logits)
