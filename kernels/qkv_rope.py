"""Attention input side of one decode step: low-rank q/k/v of the current token, RoPE, KV-cache append.

Launch 1: t = x Vqkvᵀ, one GEMV over the packed input factors (rq + rk + rv rows) into an fp32 scratch.
Launch 2: one grid over (H + 2 * H_kv heads, half-head-dim chunks): each program computes the output rows
          (d, d + D/2) of one head from its U and its slice of t, so the RoPE pair is in registers,
          rotates q and k (fp32), stores q, and writes k, v into the dense cache at row cache_seqlens[b].

Convention: cache_seqlens[b] = tokens already in the cache before this step. The current token has
position cache_seqlens[b]; this kernel writes it at that index and does NOT advance cache_seqlens: the
caller does (cache_seqlens += 1) after attention, which then sees cache_seqlens[b] + 1 keys.
RoPE is HF rotate_half: out[:D/2] = x1 cos - x2 sin, out[D/2:] = x2 cos + x1 sin, cos/sin (S_max, D/2) fp32.
"""

import torch
import triton
import triton.language as tl

from rankserve.kernels.lowrank_linear import (_gemv_tile, gdc_launch_dependents, gemv, gemv_config, launch_opts,
                                              live_width, pad_rows)


@triton.jit
def _qkv_u_rope_kernel(t_ptr, Uq_ptr, Uk_ptr, Uv_ptr, cos_ptr, sin_ptr, cache_seqlens_ptr,
                       q_ptr, k_cache_ptr, v_cache_ptr, klive_ptr,
                       B, rq, rk, rv, stride_t, stride_uq, stride_uk, stride_uv, stride_cos,
                       stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                       B_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, LIVE: tl.constexpr,
                       PDL: tl.constexpr, STAGES: tl.constexpr):
    # grid (H + 2 * HKV, cdiv(HALF, BLOCK_D)); program = rows (d, d + HALF) of one q, k or v head
    # LIVE: the projection reads only its first klive[0 | 1 | 2] rank components (PARSE slots)
    if PDL:
        gdc_launch_dependents()
    pid_h = tl.program_id(0)
    is_q = pid_h < H
    is_k = (pid_h >= H) & (pid_h < H + HKV)
    is_v = pid_h >= H + HKV
    if pid_h < H:
        U_ptr = Uq_ptr
    elif pid_h < H + HKV:
        U_ptr = Uk_ptr
    else:
        U_ptr = Uv_ptr
    head = tl.where(is_q, pid_h, tl.where(is_k, pid_h - H, pid_h - H - HKV))
    r = tl.where(is_q, rq, tl.where(is_k, rk, rv))
    stride_u = tl.where(is_q, stride_uq, tl.where(is_k, stride_uk, stride_uv))
    t_off = tl.where(is_q, 0, tl.where(is_k, rq, rq + rk))  # column of this projection's slice of t
    r_run = r
    if LIVE:
        r_run = live_width(r, klive_ptr + tl.where(is_q, 0, tl.where(is_k, 1, 2)))

    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,) in [0, HALF)
    mask_d = offs_d < HALF
    rows = head * (2 * HALF) + offs_d  # rows of U for the first half of the head
    y1 = _gemv_tile(t_ptr + t_off, stride_t, U_ptr, stride_u, rows, mask_d, B, r, r_run, 0.0,
                    B_PAD, BLOCK_D, BLOCK_K, False, PDL, STAGES)  # (B_PAD, BLOCK_D) fp32, dims d
    y2 = _gemv_tile(t_ptr + t_off, stride_t, U_ptr, stride_u, rows + HALF, mask_d, B, r, r_run, 0.0,
                    B_PAD, BLOCK_D, BLOCK_K, False, False, STAGES)  # (B_PAD, BLOCK_D) fp32, dims d + HALF

    offs_b = tl.arange(0, B_PAD)
    mask_b = offs_b < B
    pos = tl.load(cache_seqlens_ptr + offs_b, mask=mask_b, other=0)  # (B_PAD,) position of the new token
    mask = mask_b[:, None] & mask_d[None, :]
    # per-segment store masks built as full tensors (a block mask & a scalar bool misbehaves in the interpreter)
    seg = pid_h + tl.zeros((B_PAD, BLOCK_D), dtype=tl.int32)
    mask_q = mask & (seg < H)
    mask_k = mask & (seg >= H) & (seg < H + HKV)
    mask_v = mask & (seg >= H + HKV)
    cs_off = pos[:, None] * stride_cos + offs_d[None, :]
    cos = tl.load(cos_ptr + cs_off, mask=mask, other=1.0)  # (B_PAD, BLOCK_D)
    sin = tl.load(sin_ptr + cs_off, mask=mask, other=0.0)
    o1 = tl.where(is_v, y1, y1 * cos - y2 * sin)
    o2 = tl.where(is_v, y2, y2 * cos + y1 * sin)

    q_off = offs_b[:, None] * stride_qb + head * stride_qh + offs_d[None, :]
    tl.store(q_ptr + q_off, o1.to(q_ptr.dtype.element_ty), mask=mask_q)
    tl.store(q_ptr + q_off + HALF, o2.to(q_ptr.dtype.element_ty), mask=mask_q)
    b64 = offs_b.to(tl.int64)[:, None]  # batch offsets of a big cache overflow int32
    k_off = b64 * stride_kb + pos[:, None] * stride_ks + head * stride_kh + offs_d[None, :]
    tl.store(k_cache_ptr + k_off, o1.to(k_cache_ptr.dtype.element_ty), mask=mask_k)
    tl.store(k_cache_ptr + k_off + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=mask_k)
    v_off = b64 * stride_vb + pos[:, None] * stride_vs + head * stride_vh + offs_d[None, :]
    tl.store(v_cache_ptr + v_off, o1.to(v_cache_ptr.dtype.element_ty), mask=mask_v)
    tl.store(v_cache_ptr + v_off + HALF, o2.to(v_cache_ptr.dtype.element_ty), mask=mask_v)


def qkv_rope(x: torch.Tensor, Vqkv: torch.Tensor, Uq: torch.Tensor, Uk: torch.Tensor, Uv: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             cache_seqlens: torch.Tensor, *, q_out: torch.Tensor | None = None,
             t: torch.Tensor | None = None, norm_eps: float | None = None, keep: torch.Tensor | None = None,
             klive: torch.Tensor | None = None, pdl: bool = False, grid_cap: int = 0, stages: int = 0,
             split: int = 1) -> torch.Tensor:
    """q of the current token, with k and v appended to the cache; all projections low-rank.

    x: (B, hidden) already RMS-normed, bf16 (GPU) or fp32. Vqkv: (rq + rk + rv, hidden), the q, k, v input
    factors stacked in that order (ranks may differ). Uq: (H * D, rq), Uk: (H_kv * D, rk), Uv: (H_kv * D, rv).
    All weights x.dtype, row-major. cos, sin: (S_max, D / 2) fp32, row p = position p.
    k_cache, v_cache: (B, S_max, H_kv, D) (flash-attn layout, unit stride on D), written in place at
    [b, cache_seqlens[b]]. cache_seqlens: (B,) int32 on device, read only (the caller advances it).
    q_out: optional (B, H, D) x.dtype; t: optional (B, rq + rk + rv) fp32 scratch.
    norm_eps: x is the raw residual stream; RMS-normalize it inside the first GEMV (the norm weight folded into
    Vqkv's columns by the caller). keep: optional (B, rq + rk + rv) 0/1 mask of each row's rank components
    (PARSE). klive: optional int32 (3,) device tensor, components in use of q, k, v (PARSE slots: each
    projection reads only its first klive[i] components, rounded up to 16; ranks must be multiples of 16).
    pdl: programmatic dependent launch (Hopper+). grid_cap: program cap of the first GEMV; stages: pipeline depth
    (see gemv). split: split-K of the first GEMV (see gemv; a given t must then hold fp32 zeros).
    Returns q (B, H, D), RoPE applied. Two launches, no host sync.
    """
    B = x.shape[0]
    _, _, HKV, D = k_cache.shape
    H = Uq.shape[0] // D
    rq, rk, rv = Uq.shape[1], Uk.shape[1], Uv.shape[1]
    assert D % 2 == 0 and Vqkv.shape[0] == rq + rk + rv and Uk.shape[0] == Uv.shape[0] == HKV * D, \
        "qkv_rope wants Vqkv (rq+rk+rv, hidden), Uq (H*D, rq), Uk/Uv (H_kv*D, r), caches (B, S_max, H_kv, D)"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert klive is None or (klive.dtype == torch.int32 and klive.numel() >= 3 and rq % 16 == rk % 16 == rv % 16 == 0), \
        "klive wants int32 (3,) and ranks that are multiples of 16"
    if t is None:
        t = (torch.zeros if split > 1 else torch.empty)(B, rq + rk + rv, device=x.device, dtype=torch.float32)
    if q_out is None:
        q_out = torch.empty(B, H, D, device=x.device, dtype=x.dtype)
    gemv(x, Vqkv, out=t, norm_eps=norm_eps, keep=keep, pdl=pdl, grid_cap=grid_cap, stages=stages,
         split=split)  # (B, rq + rk + rv) fp32
    HALF = D // 2
    BLOCK_N, BLOCK_K, num_warps, num_stages = gemv_config(B, (H + 2 * HKV) * D, x.is_cuda)
    num_stages = stages or num_stages
    BLOCK_D = max(min(BLOCK_N, triton.next_power_of_2(HALF)), 1 if B == 1 else 16)  # tl.dot wants >= 16
    _qkv_u_rope_kernel[(H + 2 * HKV, triton.cdiv(HALF, BLOCK_D))](
        t, Uq, Uk, Uv, cos, sin, cache_seqlens, q_out, k_cache, v_cache, klive if klive is not None else cache_seqlens,
        B, rq, rk, rv, t.stride(0), Uq.stride(0), Uk.stride(0), Uv.stride(0), cos.stride(0),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=H, HKV=HKV, HALF=HALF, B_PAD=pad_rows(B), BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K, LIVE=klive is not None, PDL=pdl,
        STAGES=num_stages if B == 1 else 1,
        num_warps=num_warps, num_stages=num_stages, **launch_opts(pdl))
    return q_out


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half RoPE. x (..., D); cos, sin (..., D/2) broadcastable to x[..., :D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def qkv_rope_ref(x, Vqkv, Uq, Uk, Uv, cos, sin, k_cache, v_cache, cache_seqlens) -> torch.Tensor:
    """Torch reference of qkv_rope in the inputs' dtype (cos/sin cast to it); writes the caches, returns q (B, H, D)."""
    B = x.shape[0]
    _, _, HKV, D = k_cache.shape
    rq, rk = Uq.shape[1], Uk.shape[1]
    t = x @ Vqkv.T  # (B, rq + rk + rv)
    q = (t[:, :rq] @ Uq.T).view(B, -1, D)  # (B, H, D)
    k = (t[:, rq:rq + rk] @ Uk.T).view(B, HKV, D)  # (B, H_kv, D)
    v = (t[:, rq + rk:] @ Uv.T).view(B, HKV, D)
    pos = cache_seqlens.long()
    c, s = cos[pos].to(x.dtype)[:, None, :], sin[pos].to(x.dtype)[:, None, :]  # (B, 1, D/2)
    q, k = rope_ref(q, c, s), rope_ref(k, c, s)
    rows = torch.arange(B, device=x.device)
    k_cache[rows, pos] = k.to(k_cache.dtype)
    v_cache[rows, pos] = v.to(v_cache.dtype)
    return q
