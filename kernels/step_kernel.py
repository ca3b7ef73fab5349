"""The whole B = 1 decode step of a fully factorized model in one persistent launch.

The per-kernel step (fast_decode.py: ~9 launches a layer) pays ~3 us of fixed cost per kernel at B = 1 even
with CUDA graphs and programmatic dependent launch: each kernel waits for the previous grid to drain, then for its
own first weight bytes (decode.md). Here one launch walks every stage of every layer:

    per layer: Vqkv·norm(x) -> Uq/Uk/Uv + RoPE + K/V into the cache -> attention over each kv head (-> merge of
    the splits) -> Vo a -> x += Uo t -> Vgu·norm(x) -> SiLU(Ug t)·(Uu t) -> Vd m -> x += Ud t;  then the head.

A stage is a list of items (a block of weight rows, a RoPE head chunk, a kv head). Programs take items from the
stage's counter (`grab`, an atomic ticket), so an item only ever waits on items that a running program already
holds: no deadlock for any grid size, and under the CPU interpreter, which runs programs one after the other,
program 0 simply does every item in order. Before its first item of a stage a program loads that item's first
weight tile, then waits until the previous stage's `done` counter reaches its item count (acquire), so the
weight stream of the next stage starts while the last items of the previous one finish. When a program runs out
of items it adds its count to the stage's `done` (release).

Hazards: every stage reads what the previous one wrote; a buffer reused by a later stage (t, a) is rewritten only
after a stage in between completed, so all its readers are done. Counters: int32 (2, stages), zeroed every step.
Weights are addressed as element offsets from one base tensor (int64 table per layer), so the kernel needs no
pointer table and layers may have different ranks (Dobi-SVD) or shared bases packed per layer (Basis Sharing).
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rankserve.kernels.decode_attention import attend, merge_splits

PAD = tl.constexpr(32)  # int32 counters a 128-byte line apart (no false sharing between stages)
SLOTS = tl.constexpr(10)  # stage slots a layer: qkv V, qkv U, attention, merge, o V, o U, gate/up V, gate/up U, down V, down U
META = ("Vqkv", "Uq", "Uk", "Uv", "Vo", "Uo", "Vgu", "Ug", "Uu", "Vd", "Ud")  # offsets, then the 7 ranks


@dataclass
class StepKernelConfig:
    programs_per_sm: int = 2  # grid = SMs * this, capped at the kernel's occupancy (CPU interpreter: 1 program)
    # items of the stages that reduce over the hidden / intermediate size (V stages, the head): weight rows an item
    # and tile width; and of the stages that reduce over a rank (U stages; RoPE items take u_rows dims of each
    # half-head). An item's first tile, and the next item's, are in flight while the current one is reduced.
    v_rows: int = 2
    v_width: int = 4096
    u_rows: int = 4
    u_width: int = 2048
    num_warps: int = 4
    maxnreg: int = 0  # cap on registers a thread (more programs fit an SM); 0 = the compiler's choice
    backoff_ns: int = 0  # sleep between polls of a stage counter (GPU); 0 = spin


@triton.jit
def _wait(ctr_ptr, prev, prev_items, first, BACKOFF: tl.constexpr):
    """Before a program's first item of a stage: spin until stage prev's done counter reaches prev_items, then
    acquire its items' writes. BACKOFF > 0 (GPU only): sleep that many ns between polls, so the pollers do not
    flood the counter's L2 slice."""
    if first:
        done_ptr = ctr_ptr + (prev + 1) * PAD
        while tl.load(done_ptr, volatile=True) < prev_items:
            if BACKOFF > 0:
                tl.inline_asm_elementwise("nanosleep.u32 $1;\n mov.u32 $0, 0;", "=r,r",
                                          [tl.full([1], BACKOFF, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        tl.atomic_add(done_ptr, 0, sem="acquire")


@triton.jit
def _leave(ctr_ptr, sid, n_done):
    """Count this program's items of stage sid as done (release: its stores are visible to the acquirers)."""
    if n_done > 0:
        tl.debug_barrier()  # every thread's stores issued before the release
        tl.atomic_add(ctr_ptr + (sid + 1) * PAD, n_done, sem="release")


@triton.jit
def _tile(w_ptr, i, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first (BLOCK_N, BLOCK_K) tile of item i's weight rows (row-major, row length K); no traffic if i is
    past the stage's last item."""
    offs_n = i * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :],
                   mask=(offs_n < N)[:, None] & (offs_k < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _rows(w, x_ptr, w_ptr, offs_n, mask_n, K, eps, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N,) fp32 sum_k w[n, k] x[k], the first tile w already loaded; NORM: times rsqrt(mean(x^2) + eps).
    x was written by another program in this launch: read from L2 (.cg)."""
    offs_k = tl.arange(0, BLOCK_K)
    xk = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    ss = tl.sum(xk * xk, axis=0)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        wk = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                     other=0.0, eviction_policy="evict_first")
        xk = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0, cache_modifier=".cg").to(tl.float32)
        acc += tl.sum(wk.to(tl.float32) * xk[None, :], axis=1)
        if NORM:
            ss += tl.sum(xk * xk, axis=0)
    if NORM:
        acc = acc / tl.sqrt(ss / K + eps)
    return acc


@triton.jit
def _gemv_stage(ctr_ptr, rank, P, sid, prev, prev_items, x_ptr, w_ptr, y_ptr, N, K, eps,
                NORM: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BACKOFF: tl.constexpr):
    """y[n] (+)= sum_k w[n, k] x[k] for n < N, BLOCK_N rows an item; RESIDUAL adds into y (each row one owner).
    Items rank, rank + P, ...; the next item's first tile is loaded before the current one is reduced."""
    n = tl.cdiv(N, BLOCK_N)
    i = rank
    w = _tile(w_ptr, i, N, K, BLOCK_N, BLOCK_K)
    _wait(ctr_ptr, prev, prev_items, i < n, BACKOFF)
    n_done = 0
    while i < n:
        w_next = _tile(w_ptr, i + P, N, K, BLOCK_N, BLOCK_K)
        offs_n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = _rows(w, x_ptr, w_ptr, offs_n, mask_n, K, eps, NORM, BLOCK_K)
        if RESIDUAL:
            acc += tl.load(y_ptr + offs_n, mask=mask_n, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)
        n_done += 1
        w = w_next
        i += P
    _leave(ctr_ptr, sid, n_done)


@triton.jit
def _gate_up_stage(ctr_ptr, rank, P, sid, prev, prev_items, t_ptr, ug_ptr, uu_ptr, m_ptr, N, rg, ru,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BACKOFF: tl.constexpr):
    """m[n] = silu(Ug[n] . t[:rg]) * (Uu[n] . t[rg:]) for n < N."""
    n = tl.cdiv(N, BLOCK_N)
    i = rank
    wg = _tile(ug_ptr, i, N, rg, BLOCK_N, BLOCK_K)
    wu = _tile(uu_ptr, i, N, ru, BLOCK_N, BLOCK_K)
    _wait(ctr_ptr, prev, prev_items, i < n, BACKOFF)
    n_done = 0
    while i < n:
        wg_next = _tile(ug_ptr, i + P, N, rg, BLOCK_N, BLOCK_K)
        wu_next = _tile(uu_ptr, i + P, N, ru, BLOCK_N, BLOCK_K)
        offs_n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        g = _rows(wg, t_ptr, ug_ptr, offs_n, mask_n, rg, 0.0, False, BLOCK_K)
        u = _rows(wu, t_ptr + rg, uu_ptr, offs_n, mask_n, ru, 0.0, False, BLOCK_K)
        tl.store(m_ptr + offs_n, (g / (1.0 + tl.exp(-g)) * u).to(m_ptr.dtype.element_ty), mask=mask_n)
        n_done += 1
        wg = wg_next
        wu = wu_next
        i += P
    _leave(ctr_ptr, sid, n_done)


@triton.jit
def _qkv_item(i, w_ptr, off_q, off_k, off_v, rq, rk, rv, H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """Item i of the q/k/v U stage = (head p of q|k|v, chunk of BLOCK_D dims of each half): its U, rank, slice of
    t, dims, and the first tiles of its rows d and d + HALF (masked off past the last item)."""
    NC: tl.constexpr = (HALF + BLOCK_D - 1) // BLOCK_D
    p = i // NC
    is_q = p < H
    is_k = (p >= H) & (p < H + HKV)
    head = tl.where(is_q, p, tl.where(is_k, p - H, p - H - HKV))
    r = tl.where(is_q, rq, tl.where(is_k, rk, rv))
    u_ptr = w_ptr + tl.where(is_q, off_q, tl.where(is_k, off_k, off_v))
    t_off = tl.where(is_q, 0, tl.where(is_k, rq, rq + rk))
    offs_d = (i % NC) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = (offs_d < HALF) & ((p + tl.zeros((BLOCK_D,), dtype=tl.int32)) < H + 2 * HKV)
    rows = head * (2 * HALF) + offs_d
    offs_k = tl.arange(0, BLOCK_K)
    mask_w = mask_d[:, None] & (offs_k < r)[None, :]
    w1 = tl.load(u_ptr + rows[:, None] * r + offs_k[None, :], mask=mask_w, other=0.0, eviction_policy="evict_first")
    w2 = tl.load(u_ptr + (rows + HALF)[:, None] * r + offs_k[None, :], mask=mask_w, other=0.0,
                 eviction_policy="evict_first")
    return p, head, r, u_ptr, t_off, offs_d, mask_d, rows, w1, w2


@triton.jit
def _qkv_u_stage(ctr_ptr, rank, P, sid, prev, prev_items, t_ptr, w_ptr, off_q, off_k, off_v, rq, rk, rv,
                 cos_ptr, sin_ptr, pos, q_ptr, kc_ptr, vc_ptr, stride_ks, stride_kh,
                 H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_K: tl.constexpr, BACKOFF: tl.constexpr):
    """Rows (d, d + HALF) of a q/k/v head from its U and its slice of t, RoPE on q and k at position pos, q
    stored, k and v written into the cache at pos (kc/vc: this layer's, row 0)."""
    NC: tl.constexpr = (HALF + BLOCK_D - 1) // BLOCK_D
    n = (H + 2 * HKV) * NC
    i = rank
    p, head, r, u_ptr, t_off, offs_d, mask_d, rows, w1, w2 = _qkv_item(i, w_ptr, off_q, off_k, off_v, rq, rk, rv,
                                                                       H, HKV, HALF, BLOCK_D, BLOCK_K)
    _wait(ctr_ptr, prev, prev_items, i < n, BACKOFF)
    n_done = 0
    while i < n:
        p2, head2, r2, u_ptr2, t_off2, offs_d2, mask_d2, rows2, w1n, w2n = _qkv_item(
            i + P, w_ptr, off_q, off_k, off_v, rq, rk, rv, H, HKV, HALF, BLOCK_D, BLOCK_K)
        y1 = _rows(w1, t_ptr + t_off, u_ptr, rows, mask_d, r, 0.0, False, BLOCK_K)  # dims d
        y2 = _rows(w2, t_ptr + t_off, u_ptr, rows + HALF, mask_d, r, 0.0, False, BLOCK_K)  # dims d + HALF
        cos = tl.load(cos_ptr + pos * HALF + offs_d, mask=mask_d, other=1.0)
        sin = tl.load(sin_ptr + pos * HALF + offs_d, mask=mask_d, other=0.0)
        is_v = p >= H + HKV
        o1 = tl.where(is_v, y1, y1 * cos - y2 * sin)
        o2 = tl.where(is_v, y2, y2 * cos + y1 * sin)
        seg = p + tl.zeros((BLOCK_D,), dtype=tl.int32)  # full-tensor masks (block mask & scalar bool trips the interpreter)
        mask_q = mask_d & (seg < H)
        mask_k = mask_d & (seg >= H) & (seg < H + HKV)
        mask_v = mask_d & (seg >= H + HKV)
        q_off = head * (2 * HALF) + offs_d
        tl.store(q_ptr + q_off, o1.to(q_ptr.dtype.element_ty), mask=mask_q)
        tl.store(q_ptr + q_off + HALF, o2.to(q_ptr.dtype.element_ty), mask=mask_q)
        c_off = pos.to(tl.int64) * stride_ks + head * stride_kh + offs_d
        tl.store(kc_ptr + c_off, o1.to(kc_ptr.dtype.element_ty), mask=mask_k)
        tl.store(kc_ptr + c_off + HALF, o2.to(kc_ptr.dtype.element_ty), mask=mask_k)
        tl.store(vc_ptr + c_off, o1.to(vc_ptr.dtype.element_ty), mask=mask_v)
        tl.store(vc_ptr + c_off + HALF, o2.to(vc_ptr.dtype.element_ty), mask=mask_v)
        n_done += 1
        p, head, r, u_ptr, t_off, offs_d, mask_d, rows, w1, w2 = p2, head2, r2, u_ptr2, t_off2, offs_d2, mask_d2, \
            rows2, w1n, w2n
        i += P
    _leave(ctr_ptr, sid, n_done)


@triton.jit
def _attention_stage(ctr_ptr, rank, P, sid, prev, prev_items, q_ptr, kc_ptr, vc_ptr, stride_ks, stride_kh, seqlen,
                     a_ptr, mid_o_ptr, mid_lse_ptr, qk_scale, G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                     D_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     DOT_PREC: tl.constexpr, BACKOFF: tl.constexpr):
    """Item (kv head hk, split): its query heads over the split's keys; one split writes a (H, D) directly,
    several write partials mid_o (H, NUM_SPLITS, D) fp32 and mid_lse (H, NUM_SPLITS) for the merge stage."""
    i = rank
    _wait(ctr_ptr, prev, prev_items, i < HKV * NUM_SPLITS, BACKOFF)
    n_done = 0
    split_len = tl.cdiv(tl.cdiv(seqlen, NUM_SPLITS), BLOCK_N) * BLOCK_N
    while i < HKV * NUM_SPLITS:
        hk = i // NUM_SPLITS
        split = i % NUM_SPLITS
        offs_g = tl.arange(0, BLOCK_H)
        mask_g = offs_g < G
        offs_h = hk * G + offs_g  # (BLOCK_H,) query heads of this kv head
        offs_d = tl.arange(0, D_PAD)
        mask_d = offs_d < D
        q = tl.load(q_ptr + offs_h[:, None] * D + offs_d[None, :], mask=mask_g[:, None] & mask_d[None, :],
                    other=0.0, cache_modifier=".cg")  # (BLOCK_H, D_PAD)
        start = split * split_len
        o, lse = attend(q, kc_ptr + hk * stride_kh, vc_ptr + hk * stride_kh, stride_ks, stride_ks, start,
                        tl.minimum(start + split_len, seqlen), offs_d, mask_d, qk_scale, BLOCK_H, D_PAD, BLOCK_N,
                        DOT_PREC)
        mask = mask_g[:, None] & mask_d[None, :]
        if NUM_SPLITS == 1:
            tl.store(a_ptr + offs_h[:, None] * D + offs_d[None, :], o.to(a_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(mid_o_ptr + (offs_h[:, None] * NUM_SPLITS + split) * D + offs_d[None, :], o, mask=mask)
            tl.store(mid_lse_ptr + offs_h * NUM_SPLITS + split, lse, mask=mask_g)
        n_done += 1
        i += P
    _leave(ctr_ptr, sid, n_done)


@triton.jit
def _merge_stage(ctr_ptr, rank, P, sid, prev, prev_items, mid_o_ptr, mid_lse_ptr, a_ptr, H: tl.constexpr,
                 D: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BACKOFF: tl.constexpr):
    """Item h: head h's output from its splits' partials."""
    i = rank
    _wait(ctr_ptr, prev, prev_items, i < H, BACKOFF)
    n_done = 0
    while i < H:
        offs_d = tl.arange(0, D_PAD)
        out = merge_splits(mid_o_ptr + i * NUM_SPLITS * D, mid_lse_ptr + i * NUM_SPLITS, D, offs_d, offs_d < D,
                           NUM_SPLITS, SPLITS_PAD)
        tl.store(a_ptr + i * D + offs_d, out.to(a_ptr.dtype.element_ty), mask=offs_d < D)
        n_done += 1
        i += P
    _leave(ctr_ptr, sid, n_done)


@triton.jit
def _step_kernel(w_ptr, meta_ptr, head_ptr, x_ptr, t_ptr, q_ptr, a_ptr, m_ptr, logits_ptr, kc_ptr, vc_ptr,
                 seqlens_ptr, cos_ptr, sin_ptr, mid_o_ptr, mid_lse_ptr, ctr_ptr,
                 L, hidden, inter, vocab, stride_kl, stride_ks, stride_kh, eps, qk_scale,
                 H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, D_PAD: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                 ATT_BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                 BN_V: tl.constexpr, BK_V: tl.constexpr, BN_U: tl.constexpr, BK_U: tl.constexpr, BACKOFF: tl.constexpr):
    D: tl.constexpr = 2 * HALF
    NS = L * SLOTS + 1  # stages: SLOTS a layer, then the head
    P = tl.num_programs(0)
    rank = tl.atomic_add(ctr_ptr, 1, sem="relaxed")  # items by arrival order (see StepKernel: all P are resident)
    pos = tl.load(seqlens_ptr)  # the current token's position (row 0)
    hidden_items = tl.cdiv(hidden, BN_U)  # the U stages that write x
    NC: tl.constexpr = (HALF + BN_U - 1) // BN_U
    for layer in range(L):
        mp = meta_ptr + layer * 18
        rq = tl.load(mp + 11).to(tl.int32)
        rk = tl.load(mp + 12).to(tl.int32)
        rv = tl.load(mp + 13).to(tl.int32)
        ro = tl.load(mp + 14).to(tl.int32)
        rg = tl.load(mp + 15).to(tl.int32)
        ru = tl.load(mp + 16).to(tl.int32)
        rd = tl.load(mp + 17).to(tl.int32)
        s0 = layer * SLOTS
        lay = tl.cast(layer, tl.int64)  # a layer of a long cache is > 2^31 elements in
        kc = kc_ptr + lay * stride_kl
        vc = vc_ptr + lay * stride_kl
        # x (normed, the norm weight folded into Vqkv) -> t = Vqkv x; layer 0 waits for nothing
        _gemv_stage(ctr_ptr, rank, P, s0, tl.maximum(s0 - 1, 0), tl.where(layer == 0, 0, hidden_items), x_ptr,
                    w_ptr + tl.load(mp + 0), t_ptr, rq + rk + rv, hidden, eps, True, False, BN_V, BK_V, BACKOFF)
        _qkv_u_stage(ctr_ptr, rank, P, s0 + 1, s0, tl.cdiv(rq + rk + rv, BN_V), t_ptr, w_ptr, tl.load(mp + 1),
                     tl.load(mp + 2), tl.load(mp + 3), rq, rk, rv, cos_ptr, sin_ptr, pos, q_ptr, kc, vc,
                     stride_ks, stride_kh, H, HKV, HALF, BN_U, BK_U, BACKOFF)
        _attention_stage(ctr_ptr, rank, P, s0 + 2, s0 + 1, (H + 2 * HKV) * NC, q_ptr, kc, vc, stride_ks, stride_kh,
                         pos + 1, a_ptr, mid_o_ptr, mid_lse_ptr, qk_scale, H // HKV, HKV, D, D_PAD, BLOCK_H,
                         ATT_BLOCK_N, NUM_SPLITS, DOT_PREC, BACKOFF)
        if NUM_SPLITS > 1:
            _merge_stage(ctr_ptr, rank, P, s0 + 3, s0 + 2, HKV * NUM_SPLITS, mid_o_ptr, mid_lse_ptr, a_ptr, H, D, D_PAD,
                         NUM_SPLITS, SPLITS_PAD, BACKOFF)
            o_prev = s0 + 3
            o_prev_items = H
        else:
            o_prev = s0 + 2
            o_prev_items = HKV
        _gemv_stage(ctr_ptr, rank, P, s0 + 4, o_prev, o_prev_items, a_ptr, w_ptr + tl.load(mp + 4), t_ptr, ro, H * D,
                    eps, False, False, BN_V, BK_V, BACKOFF)
        _gemv_stage(ctr_ptr, rank, P, s0 + 5, s0 + 4, tl.cdiv(ro, BN_V), t_ptr, w_ptr + tl.load(mp + 5), x_ptr,
                    hidden, ro, eps, False, True, BN_U, BK_U, BACKOFF)
        _gemv_stage(ctr_ptr, rank, P, s0 + 6, s0 + 5, hidden_items, x_ptr, w_ptr + tl.load(mp + 6), t_ptr, rg + ru,
                    hidden, eps, True, False, BN_V, BK_V, BACKOFF)
        _gate_up_stage(ctr_ptr, rank, P, s0 + 7, s0 + 6, tl.cdiv(rg + ru, BN_V), t_ptr, w_ptr + tl.load(mp + 7),
                       w_ptr + tl.load(mp + 8), m_ptr, inter, rg, ru, BN_U, BK_U, BACKOFF)
        _gemv_stage(ctr_ptr, rank, P, s0 + 8, s0 + 7, tl.cdiv(inter, BN_U), m_ptr, w_ptr + tl.load(mp + 9), t_ptr,
                    rd, inter, eps, False, False, BN_V, BK_V, BACKOFF)
        _gemv_stage(ctr_ptr, rank, P, s0 + 9, s0 + 8, tl.cdiv(rd, BN_V), t_ptr, w_ptr + tl.load(mp + 10), x_ptr,
                    hidden, rd, eps, False, True, BN_U, BK_U, BACKOFF)
    # final norm (folded into the head's columns) + LM head, fp32 logits
    _gemv_stage(ctr_ptr, rank, P, NS - 1, NS - 2, hidden_items, x_ptr, head_ptr, logits_ptr, vocab, hidden, eps, True,
                False, BN_V, BK_V, BACKOFF)


class StepKernel:
    """The one-launch B = 1 step over a FastDecoder's packed layers and buffers (see the module docstring).

    layers: fast_decode._Layer list, every layer factorized with the norms folded (fuse_norm). Weights must share
    one dtype and be row-major. The buffers (x, t, q, a, m, logits, caches, cos/sin, mid_o/mid_lse) are the
    decoder's own; `run()` adds one memset (the counters) and one launch, no host sync or allocation.
    """

    def __init__(self, layers: list, head_n: torch.Tensor, bufs: dict, cfg, num_splits: int,
                 kcfg: StepKernelConfig | None = None) -> None:
        self.kcfg = kcfg or StepKernelConfig()
        if not all(getattr(l, "folded", False) for l in layers):
            raise ValueError("the one-launch step needs every layer factorized with fused norms (fuse_norm)")
        base = layers[0].Vqkv
        dev, dt, es = base.device, base.dtype, base.element_size()
        rows = []
        for L in layers:
            ws = [L.Vqkv, L.Uq, L.Uk, L.Uv, L.proj["o"].V, L.proj["o"].U, L.Vgu, L.Ug, L.Uu, L.proj["down"].V,
                  L.proj["down"].U]
            for name, w in zip(META, ws):
                if w.dtype != dt or not w.is_contiguous():
                    raise ValueError(f"the one-launch step wants contiguous {dt} weights; {name} is {w.dtype}")
            offs = [(w.data_ptr() - base.data_ptr()) // es for w in ws]
            assert all((w.data_ptr() - base.data_ptr()) % es == 0 for w in ws), "weights must be element-aligned"
            ranks = [*L.qkv_split, L.proj["o"].rank, *L.gu_split, L.proj["down"].rank]
            rows.append(offs + ranks)
        self.meta = torch.tensor(rows, dtype=torch.int64, device=dev)  # (L, 18)
        self.base, self.head_n, self.b, self.cfg = base, head_n, bufs, cfg
        self.num_splits = num_splits
        # counter 0: rank tickets; then one done counter per stage, PAD apart
        self.ctr = torch.zeros((len(layers) * SLOTS + 2) * PAD, dtype=torch.int32, device=dev)
        self.on_gpu = dev.type == "cuda"
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if self.on_gpu else 1
        # one program an SM until the compiled kernel's occupancy is known (the first run); the interpreter runs
        # programs one after the other, so there a single program does every item
        self.grid = (self.sms,)
        self.resident: int | None = None

    def run(self) -> None:
        cfg, b, k = self.cfg, self.b, self.kcfg
        H, HKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kc, vc = b["k_cache"], b["v_cache"]  # (L, 1, S_max, H_kv, D)
        on_gpu = kc.is_cuda
        self.ctr.zero_()
        kernel = _step_kernel[self.grid](
            self.base, self.meta, self.head_n, b["x"], b["t"], b["q"], b["a"], b["m"], b["logits"], kc, vc,
            b["seqlens"], b["cos"], b["sin"], b["mid_o"], b["mid_lse"], self.ctr,
            len(self.meta), cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
            kc.stride(0), kc.stride(2), kc.stride(3), float(cfg.rms_norm_eps), math.log2(math.e) / math.sqrt(D),
            H=H, HKV=HKV, HALF=D // 2, D_PAD=triton.next_power_of_2(D), NUM_SPLITS=self.num_splits,
            SPLITS_PAD=triton.next_power_of_2(self.num_splits), BLOCK_H=max(16, triton.next_power_of_2(H // HKV)),
            ATT_BLOCK_N=64 if on_gpu else 16, DOT_PREC="ieee" if kc.dtype == torch.float32 else "tf32",
            BN_V=k.v_rows if on_gpu else 16, BK_V=k.v_width if on_gpu else 64,
            BN_U=min(k.u_rows if on_gpu else 16, triton.next_power_of_2(D // 2)), BK_U=k.u_width if on_gpu else 64,
            BACKOFF=k.backoff_ns if on_gpu else 0, num_warps=k.num_warps if on_gpu else 1, **({"maxnreg": k.maxnreg} if k.maxnreg and on_gpu else {}))
        if on_gpu and self.resident is None:
            # items are dealt to programs statically, so a program may wait on any other's items: every program
            # must be resident at once. Cap the grid at what fits (registers, shared memory, warps per SM).
            self.resident = resident_programs(kernel.n_regs, kernel.metadata.shared, k.num_warps, kc.device)
            self.grid = (self.sms * min(k.programs_per_sm, self.resident),)


def resident_programs(n_regs: int, shared: int, num_warps: int, device: torch.device) -> int:
    """Programs of a kernel that fit on one SM at once (CUDA occupancy: registers, shared memory, threads)."""
    p = torch.cuda.get_device_properties(device)
    regs_per_warp = -(-n_regs * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = (65536 // regs_per_warp) // num_warps  # 64 K registers an SM on every CUDA GPU since Kepler
    by_smem = p.shared_memory_per_multiprocessor // (shared + 1024) if shared else 32  # 1 KB reserved a block
    by_threads = p.max_threads_per_multi_processor // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))
