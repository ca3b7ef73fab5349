"""Split-K (flash-decoding) attention of one new query token per row over the contiguous dense KV cache.

Keys attended: indices 0 .. cache_seqlens[b] INCLUSIVE, i.e. cache_seqlens[b] + 1 keys. That is the state
right after qkv_rope wrote the current token at index cache_seqlens[b] and before the caller advances
cache_seqlens (see qkv_rope.py).

Stage 1, grid (B, H_kv, num_splits): each program takes one kv head and its whole GQA group of
H / H_kv query heads (padded to BLOCK_H >= 16 rows for tl.dot), so each K/V tile is loaded once per group;
it walks its slice of the row's keys in BLOCK_N tiles with an online softmax (exp2, fp32) and writes the
normalized partial output and its log2-sum-exp to an fp32 scratch. Slices are per row:
cdiv(seqlen, num_splits) rounded up to BLOCK_N, so short rows leave trailing splits empty (lse = -inf).
Stage 2, grid (B, H): merges the num_splits partials with the log-sum-exp rescale. With one split (short
caches: default_num_splits gives 1 up to 256 keys) stage 1 writes the output itself and stage 2 is not launched.
num_splits is a launcher argument fixed per captured graph (default_num_splits picks it from S_max), so the
grid never depends on data. Template: SGLang / LightLLM `_fwd_grouped_kernel_stage1/2`.

Measured on an H200 (bf16, H=32, D=128, CUDA-graph replay, cold L2), vs torch SDPA (flash backend):
  B=1 MHA  L=2048 20.4 us (SDPA 21.0), L=32768 146 us = 87% of copy bandwidth (SDPA 136)
  B=1 GQA8 L=2048 13.9 us (SDPA 12.9), L=32768 50 us (SDPA 48);  B=8 MHA L=2048 77 us (SDPA 76)
"""

import math

import torch
import triton
import triton.language as tl

from rankserve.kernels.lowrank_linear import gdc_launch_dependents, gdc_wait, launch_opts

try:  # optional: flash_attn_decode uses it when present
    from flash_attn import flash_attn_with_kvcache as _flash_attn_with_kvcache
except ImportError:
    _flash_attn_with_kvcache = None


@triton.jit
def attend(q, k_base, v_base, stride_ks, stride_vs, start, end, offs_d, mask_d, qk_scale,
           BLOCK_H: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax of q (BLOCK_H, D_PAD) over keys [start, end) of one kv head (k_base, v_base: its key 0);
    -> (o (BLOCK_H, D_PAD) fp32 normalized, lse (BLOCK_H,) log2-sum-exp, -inf for an empty range)."""
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, D_PAD), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kT = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None],
                     mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # (D_PAD, BLOCK_N)
        s = tl.dot(q, kT, input_precision=DOT_PREC) * qk_scale  # (BLOCK_H, BLOCK_N), log2 units
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds >= 1 valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_N, D_PAD)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    nonempty = l_i > 0.0  # False for an empty split
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))  # (BLOCK_H,)
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    return o, lse


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, cache_seqlens_ptr, mid_o_ptr, mid_lse_ptr, qk_scale,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                         counter_ptr, out_ptr, stride_ob, stride_oh,
                         G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr,
                         PDL: tl.constexpr, FUSED_MERGE: tl.constexpr, SPLITS_PAD: tl.constexpr):
    if PDL:  # q and the newest key come from the previous kernel: wait for it before any load
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0).to(tl.int64)  # batch offsets of a big cache overflow int32
    hk = tl.program_id(1)
    split = tl.program_id(2)
    seqlen = tl.load(cache_seqlens_ptr + b) + 1  # keys 0..cache_seqlens[b] inclusive
    split_len = tl.cdiv(tl.cdiv(seqlen, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seqlen)

    offs_g = tl.arange(0, BLOCK_H)
    mask_g = offs_g < G
    offs_h = hk * G + offs_g  # (BLOCK_H,) query heads of this kv head
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < D
    q = tl.load(q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_H, D_PAD)

    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    o, lse = attend(q, k_base, v_base, stride_ks, stride_vs, start, end, offs_d, mask_d, qk_scale,
                    BLOCK_H, D_PAD, BLOCK_N, DOT_PREC)
    if NUM_SPLITS == 1:  # the only split holds every key: its normalized output is the answer (no merge)
        tl.store(out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
        return
    tl.store(mid_o_ptr + b * stride_mb + offs_h[:, None] * stride_mh + split * stride_ms + offs_d[None, :], o,
             mask=mask_g[:, None] & mask_d[None, :])
    tl.store(mid_lse_ptr + b * stride_lb + offs_h * stride_lh + split, lse, mask=mask_g)
    if FUSED_MERGE:
        # the last split to finish for this (row, kv head) merges the group's partials (no second launch).
        # Barrier: all of this program's partial stores are issued before its counter increment (acq_rel).
        tl.debug_barrier()
        cnt_ptr = counter_ptr + b * tl.num_programs(1) + hk
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
        if done == NUM_SPLITS - 1:
            merged = merge_group(mid_o_ptr + b * stride_mb, mid_lse_ptr + b * stride_lb, stride_mh, stride_ms,
                                 stride_lh, offs_h, mask_g, offs_d, mask_d, BLOCK_H, D_PAD, NUM_SPLITS, SPLITS_PAD)
            tl.store(out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
                     merged.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
            tl.atomic_xchg(cnt_ptr, 0)  # ready for the next step


@triton.jit
def merge_group(o_ptr, lse_ptr, stride_oh, stride_os, stride_lh, offs_h, mask_g, offs_d, mask_d,
                BLOCK_H: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Outputs of query heads offs_h (BLOCK_H,) from their splits' partials: o at o_ptr + h * stride_oh + s *
    stride_os, lse at lse_ptr + h * stride_lh + s -> (BLOCK_H, D_PAD) fp32. Other programs wrote the partials: read
    from L2 (.cg). Split 0 is never empty."""
    offs_s = tl.arange(0, SPLITS_PAD)
    mask_s = offs_s < NUM_SPLITS
    lse_all = tl.load(lse_ptr + offs_h[:, None] * stride_lh + offs_s[None, :], mask=mask_g[:, None] & mask_s[None, :],
                      other=float("-inf"), cache_modifier=".cg")  # (BLOCK_H, SPLITS_PAD)
    m = tl.where(mask_g, tl.max(lse_all, axis=1), 0.0)
    w = tl.exp2(lse_all - m[:, None])  # 0 for empty splits
    merged = tl.zeros((BLOCK_H, D_PAD), dtype=tl.float32)
    for s in range(NUM_SPLITS):
        o_s = tl.load(o_ptr + offs_h[:, None] * stride_oh + s * stride_os + offs_d[None, :],
                      mask=mask_g[:, None] & mask_d[None, :], other=0.0, cache_modifier=".cg")
        w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), axis=1)  # (BLOCK_H,)
        merged += w_s[:, None] * o_s
    return merged / tl.where(mask_g, tl.sum(w, axis=1), 1.0)[:, None]


@triton.jit
def _decode_merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                         stride_ob, stride_oh, D: tl.constexpr, D_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    # grid (B, H): out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    offs_h = tl.program_id(1) + tl.arange(0, 1)  # one query head a program: a group of 1
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < D
    out = merge_group(mid_o_ptr + b * stride_mb, mid_lse_ptr + b * stride_lb, stride_mh, stride_ms, stride_lh, offs_h,
                      offs_h >= 0, offs_d, mask_d, 1, D_PAD, NUM_SPLITS, SPLITS_PAD)  # (1, D_PAD)
    tl.store(out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_d[None, :])


def default_num_splits(S_max: int, B: int, H_kv: int, num_sms: int = 132, min_keys: int = 256) -> int:
    """Splits per row for decode_attention: about two waves of programs at full length, >= min_keys keys a split.

    Depends on shapes only (fixed per captured graph); num_sms defaults to an H100/H200.
    """
    waves = triton.cdiv(2 * num_sms, B * H_kv)
    return max(1, min(waves, triton.cdiv(S_max, min_keys), 64))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                     *, num_splits: int, out: torch.Tensor | None = None, mid_o: torch.Tensor | None = None,
                     mid_lse: torch.Tensor | None = None, pdl: bool = False,
                     counter: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per row over keys 0..cache_seqlens[b] inclusive, scale 1/sqrt(D).

    q: (B, H, D) bf16 (GPU) or fp32, unit stride on D. k_cache, v_cache: (B, S_max, H_kv, D), same dtype,
    unit stride on D; H a multiple of H_kv (GQA/MQA/MHA). cache_seqlens: (B,) int32 on device.
    num_splits: fixed split-K factor (default_num_splits(S_max, B, H_kv)).
    out: optional (B, H, D) q.dtype. mid_o (B, H, num_splits, D) and mid_lse (B, H, num_splits): optional
    fp32 scratch. pdl: programmatic dependent launch (Hopper+).
    counter: optional (B, H_kv) int32 zeros: one launch instead of two, the last split program of each (row, kv head)
    merges the partials (an atomic counter it resets to 0 afterwards, so the buffer is reusable across steps).
    Returns out. No host sync.
    """
    B, H, D = q.shape
    _, S_max, H_kv, _ = k_cache.shape
    assert H % H_kv == 0 and k_cache.shape[3] == D and v_cache.shape == k_cache.shape, \
        "decode_attention wants q (B, H, D), caches (B, S_max, H_kv, D) with H % H_kv == 0"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    G = H // H_kv
    if out is None:
        out = torch.empty_like(q)
    if mid_o is None:
        mid_o = torch.empty(B, H, num_splits, D, device=q.device, dtype=torch.float32)
    if mid_lse is None:
        mid_lse = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32)
    BLOCK_N, num_warps, num_stages = _decode_config(G, D, q.is_cuda)
    if counter is not None:
        assert counter.shape == (B, H_kv) and counter.dtype == torch.int32 and counter.is_contiguous(), \
            "counter wants (B, H_kv) int32 zeros"
    _launch_decode(q, k_cache, v_cache, cache_seqlens, out, mid_o, mid_lse, BLOCK_N, num_warps, num_stages, pdl,
                   counter)
    return out


def _decode_config(G: int, D: int, on_gpu: bool) -> tuple[int, int, int]:
    # (BLOCK_N, num_warps, num_stages) of stage 1; from bench/kernels_gpu.py --only decode_sweep on an H200: all
    # tried configs sit within ~10% of the best except a few outliers, so keep two simple ones
    if not on_gpu:
        return 16, 1, 1
    return (64, 4, 2) if G == 1 else (128, 8, 2)


def _launch_decode(q, k_cache, v_cache, cache_seqlens, out, mid_o, mid_lse, BLOCK_N, num_warps, num_stages,
                   pdl: bool = False, counter: torch.Tensor | None = None):
    B, H, D = q.shape
    H_kv = k_cache.shape[2]
    G = H // H_kv
    num_splits = mid_o.shape[2]
    D_PAD = max(16, triton.next_power_of_2(D))  # tl.dot wants K >= 16 on the GPU (head_dim 8: stories260K)
    _decode_split_kernel[(B, H_kv, num_splits)](
        q, k_cache, v_cache, cache_seqlens, mid_o, mid_lse, math.log2(math.e) / math.sqrt(D),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        counter if counter is not None else cache_seqlens, out, out.stride(0), out.stride(1),
        G=G, D=D, D_PAD=D_PAD, BLOCK_H=max(16, triton.next_power_of_2(G)), BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl,
        FUSED_MERGE=counter is not None, SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=num_warps, num_stages=num_stages, **launch_opts(pdl))
    if counter is not None or num_splits == 1:  # merged in the first launch, or nothing to merge
        return
    _decode_merge_kernel[(B, H)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), D=D, D_PAD=D_PAD, NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits), PDL=pdl, num_warps=4 if q.is_cuda else 1, **launch_opts(pdl))


def flash_attn_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                      *, num_splits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention through flash_attn.flash_attn_with_kvcache when flash_attn imports, else the Triton kernel.

    Same arguments and semantics as decode_attention (keys 0..cache_seqlens[b] inclusive). The flash-attn path
    allocates cache_seqlens + 1 (4 bytes a row) and its output, then copies into out if given.
    """
    if _flash_attn_with_kvcache is None or not q.is_cuda:
        return decode_attention(q, k_cache, v_cache, cache_seqlens, num_splits=num_splits, out=out)
    o = _flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=cache_seqlens + 1,
                                 softmax_scale=1.0 / math.sqrt(q.shape[-1]), causal=True,
                                 num_splits=num_splits).squeeze(1)  # (B, H, D)
    if out is None:
        return o
    return out.copy_(o)


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         cache_seqlens: torch.Tensor) -> torch.Tensor:
    """Torch reference of decode_attention in the inputs' dtype -> (B, H, D)."""
    B, H, D = q.shape
    S_max, H_kv = k_cache.shape[1], k_cache.shape[2]
    k = k_cache.repeat_interleave(H // H_kv, dim=2)  # (B, S_max, H, D)
    v = v_cache.repeat_interleave(H // H_kv, dim=2)
    valid = torch.arange(S_max, device=q.device)[None, :] <= cache_seqlens.long()[:, None]  # (B, S_max)
    # zero the invalid keys first: the cache beyond a row's length may hold anything, NaN included
    k = torch.where(valid[:, :, None, None], k, 0)
    v = torch.where(valid[:, :, None, None], v, 0)
    s = torch.einsum("bhd,bshd->bhs", q, k) / math.sqrt(D)  # (B, H, S_max)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhs,bshd->bhd", torch.softmax(s, dim=-1), v)

