"""Factorized causal prefill attention: Q, K, V are rebuilt tile by tile from rank-space activations.

Inputs are Pq = x Vqᵀ (B, S, rq), Pk (B, S, rk), Pv (B, S, rv) and per-head U blocks Uq (H, D, rq),
Uk/Uv (H_kv, D, r), so the dense (B, S, H, D) q/k/v never reach memory. Program (m-block, b, h):
  Q tile   (BLOCK_M, D) = Pq[b, m-block] @ Uq[h]ᵀ, built as its two RoPE halves, rotated in fp32;
  per key tile n-block <= m-block: Kᵀ halves = Uk[h_kv] @ Pk[b, n-block]ᵀ (rotated), V = Pv[b, n-block] @ Uv[h_kv]ᵀ,
  scores from the two half products, causal + length mask, online softmax (exp2, fp32), acc += P V.
The program of the first query head of each GQA group also writes its diagonal K/V tile (post-RoPE) into the
dense cache, so every cache row < seqlens[b] is written exactly once (BLOCK_M == BLOCK_N).

Rows are right-padded: row b holds seqlens[b] tokens at positions 0..seqlens[b]-1 (a fresh sequence, cache
rows 0..seqlens[b]-1); outputs of padding positions are zeros, cache rows >= seqlens[b] are not touched.
K/V tiles are recomputed for every query block and head of a group (FlashSVD-style): FLOPs for bytes.

Status: correct, not fast. H200, bf16, B=1, S=2048, H=32, D=128, ranks 1228: 9.5 ms, against 0.6 ms for
the unfused torch path (materialize q/k/v with three GEMMs + RoPE, then flash SDPA). Since prefill has to
write dense post-RoPE K/V to the cache anyway, the faster design is probably: GEMM Pk Ukᵀ with a RoPE
epilogue straight into the cache, then flash attention over the cache; the on-the-fly rebuild only pays
when K/V are not stored densely. BLOCK_M = 128 was 1.6x faster but wrong under triton 3.6 (see _prefill_config).
"""

import math

import torch
import triton
import triton.language as tl

from rankserve.kernels.qkv_rope import rope_ref


@triton.jit
def _prefill_kernel(Pq_ptr, Pk_ptr, Pv_ptr, Uq_ptr, Uk_ptr, Uv_ptr, cos_ptr, sin_ptr, seqlens_ptr,
                    out_ptr, k_cache_ptr, v_cache_ptr, S, rq, rk, rv, qk_scale,
                    stride_pqb, stride_pqs, stride_pkb, stride_pks, stride_pvb, stride_pvs,
                    stride_uqh, stride_uqd, stride_ukh, stride_ukd, stride_uvh, stride_uvd, stride_cos,
                    stride_ob, stride_os, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_R: tl.constexpr, WRITE_KV: tl.constexpr, DOT_PREC: tl.constexpr):
    # grid (cdiv(S, BLOCK_M), B * H); BLOCK_N == BLOCK_M so the diagonal key tile is one whole tile
    pid_m = tl.program_id(0)
    b = (tl.program_id(1) // H).to(tl.int64)  # batch offsets of a big cache overflow int32
    h = tl.program_id(1) % H
    hk = h // G
    seqlen = tl.load(seqlens_ptr + b)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seqlen
    offs_c = tl.arange(0, HALF_PAD)  # dims of one RoPE half
    mask_c = offs_c < HALF
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < D
    offs_r = tl.arange(0, BLOCK_R)
    dt = Pq_ptr.dtype.element_ty

    # Q tile as two RoPE halves: (BLOCK_M, HALF_PAD) each
    q1 = tl.zeros((BLOCK_M, HALF_PAD), dtype=tl.float32)
    q2 = tl.zeros((BLOCK_M, HALF_PAD), dtype=tl.float32)
    uq_base = Uq_ptr + h * stride_uqh
    for r0 in range(0, rq, BLOCK_R):
        rr = r0 + offs_r
        mask_r = rr < rq
        pq = tl.load(Pq_ptr + b * stride_pqb + offs_m[:, None] * stride_pqs + rr[None, :],
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_M, BLOCK_R)
        u_ptrs = uq_base + offs_c[None, :] * stride_uqd + rr[:, None]  # Uq[h, c, r] as (BLOCK_R, HALF_PAD)
        u_mask = mask_r[:, None] & mask_c[None, :]
        q1 += tl.dot(pq, tl.load(u_ptrs, mask=u_mask, other=0.0), input_precision=DOT_PREC)
        q2 += tl.dot(pq, tl.load(u_ptrs + HALF * stride_uqd, mask=u_mask, other=0.0), input_precision=DOT_PREC)
    cs_off = offs_m[:, None] * stride_cos + offs_c[None, :]
    cs_mask = mask_m[:, None] & mask_c[None, :]
    cos = tl.load(cos_ptr + cs_off, mask=cs_mask, other=1.0)  # (BLOCK_M, HALF_PAD)
    sin = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0)
    qr1 = (q1 * cos - q2 * sin).to(dt)
    qr2 = (q2 * cos + q1 * sin).to(dt)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    uk_base = Uk_ptr + hk * stride_ukh
    uv_base = Uv_ptr + hk * stride_uvh
    hi = tl.minimum(m0 + BLOCK_M, seqlen)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seqlen
        # Kᵀ halves (HALF_PAD, BLOCK_N) = Uk[hk, c, :] @ Pk[b, n, :]ᵀ
        k1 = tl.zeros((HALF_PAD, BLOCK_N), dtype=tl.float32)
        k2 = tl.zeros((HALF_PAD, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rk, BLOCK_R):
            rr = r0 + offs_r
            mask_r = rr < rk
            pkT = tl.load(Pk_ptr + b * stride_pkb + offs_n[None, :] * stride_pks + rr[:, None],
                          mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_R, BLOCK_N)
            u_ptrs = uk_base + offs_c[:, None] * stride_ukd + rr[None, :]  # (HALF_PAD, BLOCK_R)
            u_mask = mask_c[:, None] & mask_r[None, :]
            k1 += tl.dot(tl.load(u_ptrs, mask=u_mask, other=0.0), pkT, input_precision=DOT_PREC)
            k2 += tl.dot(tl.load(u_ptrs + HALF * stride_ukd, mask=u_mask, other=0.0), pkT, input_precision=DOT_PREC)
        csT_off = offs_n[None, :] * stride_cos + offs_c[:, None]
        csT_mask = mask_c[:, None] & mask_n[None, :]
        cosT = tl.load(cos_ptr + csT_off, mask=csT_mask, other=1.0)  # (HALF_PAD, BLOCK_N)
        sinT = tl.load(sin_ptr + csT_off, mask=csT_mask, other=0.0)
        kr1 = (k1 * cosT - k2 * sinT).to(dt)
        kr2 = (k2 * cosT + k1 * sinT).to(dt)
        s = (tl.dot(qr1, kr1, input_precision=DOT_PREC) + tl.dot(qr2, kr2, input_precision=DOT_PREC)) * qk_scale
        valid = (offs_n[None, :] <= offs_m[:, None]) & mask_n[None, :]
        s = tl.where(valid, s, float("-inf"))  # (BLOCK_M, BLOCK_N), log2 units; key n0 is valid for every row

        # V tile (BLOCK_N, D_PAD) = Pv[b, n, :] @ Uv[hk, d, :]ᵀ
        v = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
        for r0 in range(0, rv, BLOCK_R):
            rr = r0 + offs_r
            mask_r = rr < rv
            pv = tl.load(Pv_ptr + b * stride_pvb + offs_n[:, None] * stride_pvs + rr[None, :],
                         mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_N, BLOCK_R)
            uvT = tl.load(uv_base + offs_d[None, :] * stride_uvd + rr[:, None],
                          mask=mask_r[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_R, D_PAD)
            v += tl.dot(pv, uvT, input_precision=DOT_PREC)
        v = v.to(dt)

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=DOT_PREC)
        m_i = m_new

        if WRITE_KV:
            # diagonal tile, first head of the group: full-shape masks (scalar & block masks misbehave in the interpreter)
            zero_n = offs_n * 0
            mask_w = mask_n & ((zero_n + n0) == m0) & ((zero_n + h % G) == 0)  # (BLOCK_N,)
            k_ptrs = k_cache_ptr + b * stride_kb + offs_n[None, :] * stride_ks + hk * stride_kh + offs_c[:, None]
            kw_mask = mask_c[:, None] & mask_w[None, :]
            tl.store(k_ptrs, kr1.to(k_cache_ptr.dtype.element_ty), mask=kw_mask)
            tl.store(k_ptrs + HALF, kr2.to(k_cache_ptr.dtype.element_ty), mask=kw_mask)
            v_ptrs = v_cache_ptr + b * stride_vb + offs_n[:, None] * stride_vs + hk * stride_vh + offs_d[None, :]
            tl.store(v_ptrs, v.to(v_cache_ptr.dtype.element_ty), mask=mask_w[:, None] & mask_d[None, :])

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o = tl.where(mask_m[:, None], o, 0.0)  # padding positions -> 0
    tl.store(out_ptr + b * stride_ob + offs_m[:, None] * stride_os + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < S) & mask_d[None, :])


def prefill_attention(Pq: torch.Tensor, Pk: torch.Tensor, Pv: torch.Tensor,
                      Uq: torch.Tensor, Uk: torch.Tensor, Uv: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, seqlens: torch.Tensor, *,
                      k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a right-padded prompt batch, q/k/v rebuilt on the fly from rank space.

    Pq: (B, S, rq), Pk: (B, S, rk), Pv: (B, S, rv): x Vᵀ for each projection, bf16 (GPU) or fp32,
    unit stride on r. Uq: (H, D, rq), Uk: (H_kv, D, rk), Uv: (H_kv, D, rv): the U factors viewed per head
    (Uq.view(H, D, rq) of the (H*D, rq) checkpoint tensor), same dtype, unit stride on r.
    cos, sin: (S_max >= S, D/2) fp32 RoPE tables (HF rotate_half). seqlens: (B,) int32, valid tokens per row.
    k_cache, v_cache: optional (B, S_max, H_kv, D); if given, the post-RoPE K and V of rows 0..seqlens[b]-1
    are written there (others untouched). out: optional (B, S, H, D) Pq.dtype.
    Returns out (B, S, H, D): zeros at padding positions. One launch, no host sync.
    """
    B, S, rq = Pq.shape
    H, D, _ = Uq.shape
    H_kv = Uk.shape[0]
    rk, rv = Pk.shape[2], Pv.shape[2]
    assert D % 2 == 0 and H % H_kv == 0 and Uq.shape[2] == rq and Uk.shape == (H_kv, D, rk) \
        and Uv.shape == (H_kv, D, rv), "prefill_attention wants Uq (H, D, rq), Uk (H_kv, D, rk), Uv (H_kv, D, rv)"
    assert Pq.stride(2) == Pk.stride(2) == Pv.stride(2) == 1 and Uq.stride(2) == Uk.stride(2) == Uv.stride(2) == 1
    assert cos.stride(1) == 1 and sin.stride() == cos.stride() and cos.shape[0] >= S
    write_kv = k_cache is not None
    if write_kv:
        assert v_cache is not None and k_cache.shape[2:] == (H_kv, D) and k_cache.stride(3) == v_cache.stride(3) == 1
    if out is None:
        out = torch.empty(B, S, H, D, device=Pq.device, dtype=Pq.dtype)
    BLOCK_M, BLOCK_R, num_warps, num_stages = _prefill_config(Pq.is_cuda)
    _launch_prefill(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens, k_cache, v_cache, out,
                    BLOCK_M, BLOCK_R, num_warps, num_stages)
    return out


def _prefill_config(on_gpu: bool) -> tuple[int, int, int, int]:
    # (BLOCK_M = BLOCK_N, BLOCK_R, num_warps, num_stages); GPU values from bench/kernels_gpu.py --only prefill_sweep.
    # (128, 32, 8, 1) ran 1.6x faster on an H200 but gave WRONG outputs under triton 3.6 (err ~0.2 at S >= 512;
    # correct under the interpreter): not used until understood.
    return (64, 32, 8, 1) if on_gpu else (16, 16, 1, 1)


def _launch_prefill(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens, k_cache, v_cache, out,
                    BLOCK_M, BLOCK_R, num_warps, num_stages):
    B, S, rq = Pq.shape
    H, D, _ = Uq.shape
    H_kv = Uk.shape[0]
    write_kv = k_cache is not None
    ks, vs = (k_cache.stride(), v_cache.stride()) if write_kv else ((0,) * 4, (0,) * 4)
    if not write_kv:
        k_cache = v_cache = Pk  # dummy pointers, never stored to
    _prefill_kernel[(triton.cdiv(S, BLOCK_M), B * H)](
        Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens, out, k_cache, v_cache, S, rq, Pk.shape[2], Pv.shape[2],
        math.log2(math.e) / math.sqrt(D),
        Pq.stride(0), Pq.stride(1), Pk.stride(0), Pk.stride(1), Pv.stride(0), Pv.stride(1),
        Uq.stride(0), Uq.stride(1), Uk.stride(0), Uk.stride(1), Uv.stride(0), Uv.stride(1), cos.stride(0),
        out.stride(0), out.stride(1), out.stride(2), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        H=H, G=H // H_kv, D=D, D_PAD=max(16, triton.next_power_of_2(D)), HALF=D // 2,
        HALF_PAD=max(16, triton.next_power_of_2(D // 2)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_M, BLOCK_R=BLOCK_R,
        WRITE_KV=write_kv, DOT_PREC="ieee" if Pq.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)


def prefill_attention_ref(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens):
    """Torch reference in the inputs' dtype -> (out (B, S, H, D), k (B, S, H_kv, D) post-RoPE, v (B, S, H_kv, D)).

    Positions >= seqlens[b] are zeros in out, k and v (and their Pk/Pv rows are never read)."""
    B, S, _ = Pq.shape
    H, D, _ = Uq.shape
    G = H // Uk.shape[0]
    valid = torch.arange(S, device=Pq.device)[None, :] < seqlens.long()[:, None]  # (B, S)
    vm = valid[:, :, None]
    Pq, Pk, Pv = (torch.where(vm, P, 0) for P in (Pq, Pk, Pv))  # padding may hold anything, NaN included
    q = torch.einsum("bsr,hdr->bshd", Pq, Uq)  # (B, S, H, D)
    k = torch.einsum("bsr,hdr->bshd", Pk, Uk)  # (B, S, H_kv, D)
    v = torch.einsum("bsr,hdr->bshd", Pv, Uv)
    c, s = cos[:S].to(Pq.dtype)[None, :, None, :], sin[:S].to(Pq.dtype)[None, :, None, :]  # (1, S, 1, D/2)
    q, k = rope_ref(q, c, s), rope_ref(k, c, s)
    causal = torch.ones(S, S, dtype=torch.bool, device=Pq.device).tril()
    mask = causal[None] & valid[:, None, :]  # (B, S_q, S_k)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(G, dim=2)) / math.sqrt(D)
    p = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(G, dim=2))
    vm4 = valid[:, :, None, None]
    return torch.where(vm4, out, 0), torch.where(vm4, k, 0), torch.where(vm4, v, 0)
