"""The LLaMA decoder rankserve runs: RMSNorm, RoPE, grouped-query attention, SwiGLU, factorized linears.

Everything a checkpoint holds maps one-to-one onto a module attribute here, so the state dict names
are the native checkpoint's tensor names (`layers.3.attn.q.U`, `layers.3.mlp_norm.weight`, ...).

One forward serves prefill, chunked prefill and decode: new tokens are appended to the dense KV cache
at each row's `cache.seqlens[b]`, and a row attends to every cached key at or before its own position.
Rows are right-padded; `lengths[b]` says how many of the S new tokens of row b are real.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right

from rankserve.workers.config import ROPE_TYPES, ModelConfig
from rankserve.workers.kv_cache import KVCache

PROJS = ("q", "k", "v", "o", "gate", "up", "down")
ATTN_PROJS = ("q", "k", "v", "o")


CAUSAL = torch.ones(0, dtype=torch.bool)  # sentinel key mask: causal attention over the new tokens only


def proj_name(layer: int, proj: str) -> str:
    """Canonical name of a decoder projection: `layers.{i}.attn.q`, `layers.{i}.mlp.down`."""
    return f"layers.{layer}.{'attn' if proj in ATTN_PROJS else 'mlp'}.{proj}"


class FactorizedLinear(nn.Module):
    """y = U (V x), with U [out, r] and V [r, in]; or y = W x when `rank` is None (dense fallback).

    Members of a Basis Sharing group are built with the same `V` Parameter object (same storage).
    """

    def __init__(self, in_features: int, out_features: int, rank: int | None = None,
                 V: nn.Parameter | None = None, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        kw = dict(device=device, dtype=dtype)
        if rank is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
            return
        self.U = nn.Parameter(torch.empty(out_features, rank, **kw))
        self.V = V if V is not None else nn.Parameter(torch.empty(rank, in_features, **kw))
        self.mask: torch.Tensor | None = None  # PARSE: (B, r) 0/1 per row, the rank components each request uses
        # PARSE slots: only the first `live` components are in use (the batch's union); the rest are masked padding
        self.live: int | None = None

    @property
    def factorized(self) -> bool:
        return self.rank is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank is None:
            return F.linear(x, self.weight)
        V, U, mask = self.V, self.U, self.mask
        if self.live is not None and self.live < self.rank:  # read only the components in use
            V, U, mask = V[:self.live], U[:, :self.live], None if mask is None else mask[:, :self.live]
        t = F.linear(x, V)  # (B, S, in) -> (B, S, r)
        if mask is not None:  # keep only each row's selected components
            t = t * mask[:, None, :].to(t.dtype)
        return F.linear(t, U)  # (B, S, r) -> (B, S, out)

    def dense_weight(self) -> torch.Tensor:
        """W [out, in] (multiplied out for a factorized layer)."""
        return self.weight if self.rank is None else self.U @ self.V

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # fp32 statistics, as HF does
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) fp32 after `rope_scaling`, computed exactly as transformers does."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind, factor = sc.get("rope_type", sc.get("type", "default")), float(sc.get("factor", 1.0))  # "type": legacy
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / factor
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    # llama3: scale long wavelengths by 1/factor, keep short ones, interpolate in between
    low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    old_len = float(sc.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, max_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (max_len, D) fp32 in the rotate_half layout (frequencies repeated twice)."""
    t = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(cfg))  # (S, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (S, D)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, D); cos/sin (B, S, D) fp32 for each token's own position."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, :, None].to(x.dtype)) + (rot * sin[:, :, None].to(x.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ranks: dict[str, int | None], bases: dict[str, nn.Parameter],
                 device=None, dtype=None) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        shapes = cfg.linear_shapes()
        for p in ATTN_PROJS:
            out, inp = shapes[p]
            setattr(self, p, FactorizedLinear(inp, out, ranks[p], bases.get(p), device, dtype))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                cache: KVCache | None, pos: torch.Tensor, valid: torch.Tensor,
                key_mask: torch.Tensor | CausalBias) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.n_heads, self.head_dim)  # (B, S, H, D)
        k = self.k(x).view(B, S, self.n_kv, self.head_dim)  # (B, S, H_kv, D)
        v = self.v(x).view(B, S, self.n_kv, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # write the new keys at each row's positions, then read the cache up to the longest row
            cache.write(layer, pos, k, v, valid)
            n = S if key_mask is CAUSAL else key_mask.seq_len_kv if isinstance(key_mask, CausalBias) else \
                key_mask.shape[-1]
            k, v = cache.k[layer][:, :n], cache.v[layer][:, :n]  # (B, S_k, H_kv, D)
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=2) if rep > 1 else k  # (B, S_k, H, D)
        v = v.repeat_interleave(rep, dim=2) if rep > 1 else v
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
        if key_mask is CAUSAL:  # plain causal prefill from position 0: flash kernels apply
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif isinstance(key_mask, CausalBias):  # a chunk after the cached positions (bottom-right causal)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None])  # key_mask (B, S, S_k)
        out = out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)
        return self.o(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ranks: dict[str, int | None], bases: dict[str, nn.Parameter],
                 device=None, dtype=None) -> None:
        super().__init__()
        shapes = cfg.linear_shapes()
        for p in ("gate", "up", "down"):
            out, inp = shapes[p]
            setattr(self, p, FactorizedLinear(inp, out, ranks[p], bases.get(p), device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ranks: dict[str, int | None], bases: dict[str, nn.Parameter],
                 device=None, dtype=None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.attn = Attention(cfg, ranks, bases, device, dtype)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = MLP(cfg, ranks, bases, device, dtype)

    def forward(self, x, cos, sin, layer, cache, pos, valid, key_mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, layer, cache, pos, valid, key_mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """LLaMA decoder with factorized projections.

    `ranks[name]` gives each projection's rank (None = dense), names from `proj_name`.
    `groups[group] = [names]` makes those projections share one V Parameter (Basis Sharing).
    """

    def __init__(self, cfg: ModelConfig, ranks: dict[str, int | None] | None = None,
                 groups: dict[str, list[str]] | None = None, device=None, dtype=None) -> None:
        super().__init__()
        self.cfg = cfg
        ranks = ranks or {}
        groups = groups or {}
        shapes = cfg.linear_shapes()
        # one Parameter per shared basis, handed to every member at construction
        self.bases = nn.ParameterDict()
        member_base: dict[str, nn.Parameter] = {}
        for g, members in groups.items():
            proj = members[0].rsplit(".", 1)[1]
            r = ranks[members[0]]
            self.bases[_group_key(g)] = nn.Parameter(torch.empty(r, shapes[proj][1], device=device, dtype=dtype))
            for m in members:
                member_base[m] = self.bases[_group_key(g)]
        self.groups = {g: list(m) for g, m in groups.items()}
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            lr = {p: ranks.get(proj_name(i, p)) for p in PROJS}
            lb = {p: member_base[proj_name(i, p)] for p in PROJS if proj_name(i, p) in member_base}
            self.layers.append(Block(cfg, lr, lb, device, dtype))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                      device=device, dtype=dtype)
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # (S_max, D) fp32
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # .to()/.cuda() may replace Parameters one module at a time: point every member back at its group's basis
        out = super()._apply(fn, recurse)
        self.tie_bases()
        return out

    def tie_bases(self) -> None:
        """Make every Basis Sharing member hold its group's one V Parameter (same storage)."""
        projs = self.projections()
        for g, members in self.groups.items():
            for m in members:
                projs[m].V = self.bases[_group_key(g)]

    # --- introspection ---------------------------------------------------------------------------
    def projections(self) -> dict[str, FactorizedLinear]:
        out = {}
        for i, blk in enumerate(self.layers):
            for p in PROJS:
                out[proj_name(i, p)] = getattr(blk.attn if p in ATTN_PROJS else blk.mlp, p)
        return out

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    # --- forward ---------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                lengths: torch.Tensor | None = None, last_only: bool = False, head: bool = True,
                fresh: bool = False, at: int | None = None) -> torch.Tensor:
        """tokens (B, S) -> logits (B, S, V) fp32, or (B, V) at each row's last real token if `last_only`;
        `head=False`: the final normed hidden states instead (B, S, hidden), for callers that apply the head in
        pieces.

        Without a cache every row starts at position 0. With a cache, row b's tokens go to positions
        cache.seqlens[b] .. + lengths[b] - 1, and the cache advances by `lengths` (default S).
        `fresh`: the caller guarantees every row starts at position 0 and fits the cache (a prefill into emptied
        rows): nothing is read back to the host, so a CUDA graph can capture the call (workers/prefill_graph.py).
        Right-padded rows then attend causally: a real token's earlier keys are all real.
        `at`: every row continues from position `at` (cache.seqlens holds it) and at + S fits the cache: the next
        chunk of a long prompt (workers/prefill_graph.py `ChunkedPrefill`). No host sync either; the keys are the
        cache's first at + S positions, causal from the bottom right (flash kernels apply), so right padding's
        stale keys come after every real query.
        """
        B, S = tokens.shape
        dev = tokens.device
        if lengths is None:
            lengths = torch.full((B,), S, dtype=torch.int32, device=dev)
        t = torch.arange(S, device=dev)
        valid = t[None] < lengths[:, None]  # (B, S) real tokens, the rest is right padding
        if fresh:
            pos = t[None].expand(B, S)  # (B, S)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (B, S, D)
            key_mask = CAUSAL
        elif at is not None:
            pos = (at + t)[None].expand(B, S)  # (B, S) absolute positions
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (B, S, D)
            key_mask = causal_lower_right(S, at + S)
        else:
            start = cache.seqlens.to(torch.int64) if cache is not None else torch.zeros(B, dtype=torch.int64,
                                                                                          device=dev)
            pos = start[:, None] + t[None]  # (B, S) absolute positions
            end = int((start + lengths).max())  # host sync: validated here (`fresh` and the decode graphs skip it)
            limit = min(self.rope_cos.shape[0], cache.max_seq_len if cache is not None else end)
            if end > limit:
                raise ValueError(f"sequence of {end} tokens exceeds the context limit of {limit} tokens")
            pos = pos.clamp(max=self.rope_cos.shape[0] - 1)  # padding past the end reads any valid table row
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (B, S, D)
            if int(start.max()) == 0 and int(lengths.min()) == S:  # every row starts at 0, no padding
                key_mask = CAUSAL
            elif int(start.max()) == 0:  # only the new tokens are keys
                key_mask = (t[None, None] <= t[None, :, None]) & valid[:, None, :]  # (B, S, S) causal, no padding keys
            else:
                kpos = torch.arange(end, device=dev)
                key_mask = kpos[None, None] <= pos[:, :, None]  # (B, S, end): causal over the cache
        x = self.embed(tokens)
        for i, blk in enumerate(self.layers):
            x = blk(x, cos, sin, i, cache, pos, valid, key_mask)
        if cache is not None:
            cache.seqlens += lengths.to(cache.seqlens.dtype)
        if last_only:
            x = x[torch.arange(B, device=dev), (lengths.to(torch.int64) - 1).clamp(min=0)]  # (B, hidden)
        x = self.norm(x)
        return F.linear(x, self.head_weight()).float() if head else x


def _group_key(group: str) -> str:
    """ParameterDict keys may not contain '.'."""
    return group.replace(".", "_")
