"""The thin decode path: packed factors, static buffers, Triton kernels, CUDA-graph replay.

Per layer and token (B rows, all projections factorized):
    rmsnorm(+residual) → Vqkv x (one GEMV) → Uq/Uk/Uv + RoPE on the current token + K/V written into the
    dense cache → split-K decode attention → o: Uo (Vo a) → rmsnorm(+residual) → Vgu x (one GEMV) →
    Ug/Uu + SiLU·mul → down: Ud (Vd h)
A layer with a dense projection runs the same step with torch ops (`backend="torch"` does so everywhere).

Packing is derived at load time (never stored); a Basis Sharing basis is packed once per group per layer
(it is concatenated with the layer's other factors, so each layer's packed copy is its own).
Everything the step touches lives in preallocated buffers and the per-row positions (`cache.seqlens`) live
on the device, so one step is captured as a CUDA graph (`graph="step"`), or one graph per layer
(`graph="layer"`), per batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import ATTN_PROJS, Transformer


@dataclass
class DecodeConfig:
    batch_size: int = 1
    max_seq_len: int = 2048  # cache length per row (prompt + generated tokens)
    backend: str = "triton"  # "triton" kernels where a layer is fully factorized, or "torch" ops everywhere
    graph: str = "step"  # "none" | "layer" (one CUDA graph per layer) | "step" (one graph for the whole step)
    num_splits: int = 0  # split-K factor of decode attention; 0 = from the cache length
    gemv: str = "auto"  # "triton" (fused GEMV kernels) | "cublas" (torch.mm) | "auto" (= triton, the measured winner)

    def __post_init__(self) -> None:
        if self.gemv not in ("auto", "triton", "cublas"):
            raise ValueError(f"gemv must be 'auto', 'triton' or 'cublas', got {self.gemv!r}")
        if self.backend not in ("triton", "torch"):
            raise ValueError(f"backend must be 'triton' or 'torch', got {self.backend!r}")
        if self.graph not in ("none", "layer", "step"):
            raise ValueError(f"graph must be 'none', 'layer' or 'step', got {self.graph!r}")


class _Layer:
    """One decoder layer's weights in decode layout."""

    def __init__(self, blk, cfg) -> None:
        a, m = blk.attn, blk.mlp
        self.attn_norm, self.mlp_norm = blk.attn_norm.weight, blk.mlp_norm.weight
        projs = {p: getattr(a if p in ATTN_PROJS else m, p) for p in ("q", "k", "v", "o", "gate", "up", "down")}
        self.factorized = all(l.factorized for l in projs.values())
        self.proj = projs
        qkv = [projs[p] for p in ("q", "k", "v")]
        if all(l.factorized for l in qkv):  # one GEMV for the three input factors, then per-projection U
            self.Vqkv = torch.cat([l.V for l in qkv]).contiguous()  # (rq + rk + rv, hidden)
            self.qkv_split = [l.rank for l in qkv]
            self.Uq, self.Uk, self.Uv = (l.U.contiguous() for l in qkv)
        else:
            self.Wqkv = torch.cat([l.dense_weight() for l in qkv]).contiguous()  # (q + 2 kv, hidden)
        gu = [projs["gate"], projs["up"]]
        if all(l.factorized for l in gu):
            self.Vgu = torch.cat([l.V for l in gu]).contiguous()  # (rg + ru, hidden)
            self.gu_split = [l.rank for l in gu]
            self.Ug, self.Uu = gu[0].U.contiguous(), gu[1].U.contiguous()
        else:
            self.Wgu = torch.cat([l.dense_weight() for l in gu]).contiguous()  # (2 inter, hidden)


class FastDecoder:
    """Decode steps for a fixed batch size over a dense KV cache, optionally replayed from CUDA graphs.

    Use: `dec.prefill(tokens, lengths)` (eager runtime, fills the cache), then `dec.step(tokens)` per token.
    """

    def __init__(self, model: Transformer, dcfg: DecodeConfig, packed: list[_Layer] | None = None) -> None:
        self.model, self.dcfg, self.cfg = model, dcfg, model.cfg
        cfg, B = model.cfg, dcfg.batch_size
        dev, dt = model.embed.weight.device, model.embed.weight.dtype
        if dcfg.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {dcfg.max_seq_len} exceeds max_position_embeddings {cfg.max_position_embeddings}")
        if dcfg.graph != "none" and dev.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use graph='none' on CPU")
        self.use_triton = dcfg.backend == "triton"
        # measured on the H200 (bench/results/kernels-h200.json, decode.md): the Triton kernels beat cuBLAS GEMVs
        # for B = 1..8 (B > 1 pads rows to 16 for tensor cores), and the fused step is 1.8x faster at B = 1
        self.gemv = "triton" if dcfg.gemv == "auto" else dcfg.gemv
        if self.use_triton:  # imported lazily: the torch backend must work without triton
            from rankserve.kernels import decode_attention as _attn
            from rankserve.kernels import gate_up as _gu
            from rankserve.kernels import lowrank_linear as _ll
            from rankserve.kernels import qkv_rope as _qkv
            from rankserve.kernels import rmsnorm as _rms
            self._k = dict(attn=_attn, gu=_gu, ll=_ll, qkv=_qkv, rms=_rms)
            self.num_splits = dcfg.num_splits or _attn.default_num_splits(dcfg.max_seq_len, B, cfg.num_key_value_heads)
        self.layers = packed or [_Layer(blk, cfg) for blk in model.layers]  # packed copies may be shared
        self.cache = KVCache(cfg.num_hidden_layers, B, dcfg.max_seq_len, cfg.num_key_value_heads, cfg.head_dim,
                             device=dev, dtype=dt)
        half = cfg.head_dim // 2
        self.cos = model.rope_cos[:dcfg.max_seq_len, :half].contiguous()  # (S_max, D/2) fp32
        self.sin = model.rope_sin[:dcfg.max_seq_len, :half].contiguous()
        self.head = model.head_weight()
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        z = lambda *s, dtype=dt: torch.zeros(*s, device=dev, dtype=dtype)  # noqa: E731
        self.tokens = z(B, dtype=torch.long)  # static input
        self.x = z(B, cfg.hidden_size)  # residual stream
        self.h = z(B, cfg.hidden_size)  # normed input of the current sub-layer
        self.q = z(B, H, D)
        self.a = z(B, H, D)  # attention output
        self.y = z(B, cfg.hidden_size)  # o / down projection output
        self.m = z(B, cfg.intermediate_size)  # SiLU(gate)·up
        rmax = max([sum(l.qkv_split) for l in self.layers if hasattr(l, "qkv_split")] +
                   [sum(l.gu_split) for l in self.layers if hasattr(l, "gu_split")] +
                   [l.proj[p].rank or 0 for l in self.layers for p in ("o", "down")] + [1])
        self.t = z(B, rmax, dtype=torch.float32)  # rank-space scratch, fp32
        self.logits = z(B, cfg.vocab_size, dtype=torch.float32)
        if self.use_triton:
            self.mid_o = z(B, H, self.num_splits, D, dtype=torch.float32)
            self.mid_lse = z(B, H, self.num_splits, dtype=torch.float32)
        self._graphs: list[torch.cuda.CUDAGraph] | None = None

    # --- prefill ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Fill the cache with right-padded prompts (B, S) through the eager runtime; -> last logits (B, V)."""
        self.cache.reset()
        return self.model(tokens, self.cache, lengths, last_only=True)

    # --- one decode step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B,) -> logits (B, V) fp32 (a view of a static buffer: copy it to keep it)."""
        self.tokens.copy_(tokens, non_blocking=True)
        if self.dcfg.graph == "none":
            self._step_body()
        else:
            if self._graphs is None:
                self._capture()
            for g in self._graphs:
                g.replay()
        return self.logits

    def _step_body(self) -> None:
        self._embed()
        for i in range(len(self.layers)):
            self._layer(i)
        self._finish()

    def _embed(self) -> None:
        torch.index_select(self.model.embed.weight, 0, self.tokens, out=self.x)

    def _finish(self) -> None:
        self._norm(self.x, self.model.norm.weight, self.h, residual=None)
        self.logits.copy_(self.h @ self.head.t())  # (B, V)
        self.cache.seqlens += 1  # every row advanced by one token

    def _norm(self, x, w, out, residual) -> None:
        eps = self.cfg.rms_norm_eps
        if self.use_triton:
            self._k["rms"].rmsnorm(x, w, eps, residual=residual, out=out)
            return
        if residual is not None:
            residual += x
            x = residual
        xf = x.float()
        out.copy_(w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))

    def _layer(self, i: int) -> None:
        L, B = self.layers[i], self.dcfg.batch_size
        kc, vc = self.cache.k[i], self.cache.v[i]  # (B, S_max, H_kv, D)
        seqlens = self.cache.seqlens
        fused = self.use_triton and L.factorized and self.gemv == "triton"  # Triton GEMVs with fused epilogues
        # attention: the first layer normalizes the embedding; later ones add the previous MLP output first
        self._norm(self.x if i == 0 else self.y, L.attn_norm, self.h, residual=None if i == 0 else self.x)
        if fused:
            self._k["qkv"].qkv_rope(self.h, L.Vqkv, L.Uq, L.Uk, L.Uv, self.cos, self.sin, kc, vc, seqlens,
                                    q_out=self.q, t=self.t[:, :sum(L.qkv_split)])
        else:
            self._qkv_torch(L, kc, vc, seqlens)
        if self.use_triton:
            self._k["attn"].decode_attention(self.q, kc, vc, seqlens, num_splits=self.num_splits, out=self.a,
                                             mid_o=self.mid_o, mid_lse=self.mid_lse)
        else:
            self._attention_torch(kc, vc, seqlens)
        self._linear(L.proj["o"], self.a.view(B, -1), self.y, fused)
        # MLP
        self._norm(self.y, L.mlp_norm, self.h, residual=self.x)
        if fused:
            self._k["gu"].gate_up(self.h, L.Vgu, L.Ug, L.Uu, out=self.m, t=self.t[:, :sum(L.gu_split)])
        else:
            if hasattr(L, "Vgu"):
                tg, tu = (self.h @ L.Vgu.t()).split(L.gu_split, dim=-1)
                g, u = tg @ L.Ug.t(), tu @ L.Uu.t()
            else:
                g, u = (self.h @ L.Wgu.t()).chunk(2, dim=-1)
            torch.mul(F.silu(g), u, out=self.m)
        self._linear(L.proj["down"], self.m, self.y, fused)
        if i == len(self.layers) - 1:
            self.x += self.y  # the last layer's MLP output joins the residual here

    def _linear(self, lin, x: torch.Tensor, out: torch.Tensor, fused: bool) -> None:
        if fused:
            self._k["ll"].lowrank_linear(x, lin.V, lin.U, out=out, t=self.t[:, :lin.rank])
        elif lin.factorized:
            torch.mm(x @ lin.V.t(), lin.U.t(), out=out)  # cuBLAS, rank vector in the activation dtype
        else:
            torch.mm(x, lin.weight.t(), out=out)

    def _qkv_torch(self, L: _Layer, kc: torch.Tensor, vc: torch.Tensor, seqlens: torch.Tensor) -> None:
        """q, k, v of the current token with cuBLAS GEMMs; RoPE and the cache write as small torch ops."""
        cfg, B = self.cfg, self.dcfg.batch_size
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if hasattr(L, "Vqkv"):
            tq, tk, tv = (self.h @ L.Vqkv.t()).split(L.qkv_split, dim=-1)
            q, k, v = tq @ L.Uq.t(), tk @ L.Uk.t(), tv @ L.Uv.t()
        else:
            q, k, v = (self.h @ L.Wqkv.t()).split([H * D, Hkv * D, Hkv * D], dim=-1)
        pos = seqlens.long()
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (B, 1, D/2) for this token's position

        def rope(t: torch.Tensor) -> torch.Tensor:  # (B, n, D) rotate_half
            t1, t2 = t.float().chunk(2, dim=-1)
            return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1).to(t.dtype)

        self.q.copy_(rope(q.view(B, H, D)))
        rows = torch.arange(B, device=q.device)
        kc[rows, pos] = rope(k.view(B, Hkv, D))  # device-side index: no host sync
        vc[rows, pos] = v.view(B, Hkv, D)

    def _attention_torch(self, kc: torch.Tensor, vc: torch.Tensor, seqlens: torch.Tensor) -> None:
        """SDPA over the whole static cache with a length mask (reads S_max keys; graph-safe)."""
        H, Hkv = self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        S = kc.shape[1]
        mask = torch.arange(S, device=kc.device)[None] <= seqlens[:, None].long()  # (B, S_max): keys up to this token
        out = F.scaled_dot_product_attention(self.q[:, :, None], kc.transpose(1, 2), vc.transpose(1, 2),
                                             attn_mask=mask[:, None, None], enable_gqa=Hkv != H)  # (B, H, 1, D)
        self.a.copy_(out[:, :, 0])

    # --- CUDA graphs -----------------------------------------------------------------------------
    def _capture(self) -> None:
        """Warm up twice (Triton compiles and autotunes outside the graph), then capture."""
        saved = self.cache.seqlens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step_body()
        torch.cuda.current_stream().wait_stream(stream)
        self.cache.seqlens.copy_(saved)  # the warm-up steps wrote one scratch token each; rewind
        pool = torch.cuda.graph_pool_handle()
        parts = [self._step_body] if self.dcfg.graph == "step" else (
            [self._embed] + [lambda i=i: self._layer(i) for i in range(len(self.layers))] + [self._finish])
        graphs = []
        for fn in parts:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                fn()
            graphs.append(g)
        self.cache.seqlens.copy_(saved)  # capture does not run the kernels, but keep the invariant explicit
        self._graphs = graphs
