"""The whole decode step of a fully factorized model for B = 2..16 rows in one persistent launch.

The B = 1 step (step_kernel.py) runs every stage of every layer in one launch, ordered by device counters; the B > 1
step was ~290 kernels in one CUDA graph, and at B = 8 a GEMV of the 7B shape streamed its weights at ~2 TB/s, half
the copy bandwidth, most of it each kernel's ramp and tail (bench/results/decode-log.md). This is the same schedule
for B rows: per layer

    Vqkv·norm(x) -> Uq/Uk/Uv + RoPE + K/V into each row's cache -> attention over each (row, kv head, split) ->
    Vo a -> x += Uo t -> Vgu·norm(x) -> SiLU(Ug t)·(Uu t) -> Vd m -> x += Ud t;  then the head.

Each weight tile is read once a step for all rows: its items are blocks of weight rows (RowsConfig), multiplied on
tensor cores with the rows' activations (tl.dot; the B rows zero-padded to 16, the activation rounded to the weights'
dtype as the per-kernel B > 1 path and a bf16 GEMM do). The rows' activations (B x a tile) are read from L2 every step
of the pipelined loop, so tiles of many weight rows pay (RowsConfig's sweep).

Measured on the H200 (bench/results/decode-h200-s27-rows.json, LLaMA-7B shape, random factors, prompt 128, one run
with the per-kernel step as baseline): svd-llm keep 0.6 B = 2 / 4 / 8 3.460 / 3.572 / 3.605 ms a step against
3.959 / 4.016 / 4.099 (-11 to -13 %), dobi 3.747 vs 4.200, basis-sharing 4.132 vs 4.551, prompt 2048 at B = 8 5.254
vs 5.890; keep 0.8 4.904 vs 4.894 (even). The V stages split their reduction into chunks so every program has an item,
the partials (and the RMSNorm's sums of squares) added with atomics into zeroed fp32 buffers; the U stage after a
normed V stage scales its output by 1 / rms. PARSE slots (keep masks, live widths) run through it too, the default
at B > 1 since session 28: at B = 8 with a routed union of 1.04 K 3.849 ms against 4.405 for their per-kernel step
and 3.532 static (bench/results/parse-speed-h200-s29.json; random subsets, a union of 2 K, 5.957 vs 6.517).
Where the step's time goes, stage by stage: bench/rows_trace.py (RowsConfig.trace).

Scheduling and coherence are step_kernel.py's: items dealt by rank from an atomic ticket, a done counter a stage
(acquire / release), every program resident at once (RowsStepKernel caps the grid at the compiled occupancy; one
program under the CPU interpreter), activations read around L1 (.cg). Each row decodes at its own position
(seqlens[b]): its RoPE angle, its cache slot and its keys.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rankserve.kernels.decode_attention import attend, merge_group
from rankserve.kernels.step_kernel import (PAD, SLOTS, _leave, _mine, _offset, _position, _qkv_item, _rank, _stamp,
                                           _stamp_sm, _wait, _weight, check_aligned, layer_weights, resident_programs)

Tile = tuple[int, int]  # (weight rows an item, columns a step of the reduction)
META_ROW = tl.constexpr(22)  # a layer's table row: 11 weight offsets, 7 ranks, 4 keep columns (PARSE slots)
LIVE_ROW = tl.constexpr(7)  # PARSE slots: a layer's live widths (q, k, v, o, gate, up, down) in one (L, 7) int32 tensor


@dataclass
class RowsConfig:
    """Tiles of the B > 1 one-launch step (GPU; the CPU interpreter takes small ones): (weight rows an item, columns
    a step). From bench/rows_sweep.py on the H200 at B = 8 (LLaMA-7B shape, svd-llm keep 0.6; per-kernel step 4.09-4.12
    ms in each run): many weight rows a step pay, since every step also reads the rows' activations and feeds the
    tensor cores a 16-row operand: V tiles of 16 / 32 / 64 / 128 rows (U 16-32) 7.36 / 5.64 / 4.73 / 3.81 ms; then
    per stage, U (o, down) 16 / 32 / 64 rows 3.49 / 3.53 / 3.67, gate/up U 32 / 64 / 128 rows 3.78 / 3.53 / 4.15 (one
    program an SM), q/k/v U 64 / 32 dims 3.81 / 3.67; 256 columns instead of 128 4.16 (one program an SM), a 2-deep
    pipeline 4.30, 8 warps slower (bench/results/rows-sweep-h200-*.json)."""

    programs_per_sm: int = 2
    v: Tile = (128, 128)  # the V stages and the head (bf16 input of the hidden / intermediate size)
    u: Tile = (16, 128)  # o U and down U (fp32 input: the rank vector)
    stages: int = 3  # software-pipeline depth of every stage's loop (tiles in flight + 1)
    num_warps: int = 4
    min_tiles: int = 2  # the V stages split their reduction so every program has an item, down to this many tiles
    gu: Tile | None = (64, 128)  # gate/up U (two tiles a step); None = u
    qkv: Tile | None = (32, 128)  # q/k/v U: (dims of a half-head, columns); None = u
    # diagnostics (GPU): every program stamps the global timer as it reaches each stage, into RowsStepKernel.trace
    # (programs x stages + 2, the B = 1 step's layout); bench/rows_trace.py turns the stamps into per-stage spans
    trace: bool = False

    def __post_init__(self) -> None:
        for name in ("v", "u", "gu", "qkv"):
            if getattr(self, name) is None:
                setattr(self, name, self.u)
            rows, width = getattr(self, name)
            if rows < 16 or rows & (rows - 1) or width < 16 or width & (width - 1):
                raise ValueError(f"rows-step {name} tile {rows} x {width}: powers of two, >= 16 rows and columns")
        if min(self.stages, self.programs_per_sm, self.min_tiles) < 1:
            raise ValueError("rows-step pipeline depth, programs per SM and tiles a chunk must be >= 1")

    def constexprs(self, on_gpu: bool) -> dict:
        v, u, gu, qkv = (self.v, self.u, self.gu, self.qkv) if on_gpu else ((16, 32), (16, 16), (16, 16), (16, 16))
        return dict(BN_V=v[0], BK_V=v[1], BN_U=u[0], BK_U=u[1], BN_GU=gu[0], BK_GU=gu[1], BN_QKV=qkv[0],
                    BK_QKV=qkv[1], STAGES=self.stages if on_gpu else 1, MIN_TILES=self.min_tiles,
                    TRACE=self.trace and on_gpu)


@triton.jit
def _dot(x, wT, acc):
    """acc + x @ wT on tensor cores: x (B_PAD, K) rounded to wT's dtype (fp32 weights: full precision)."""
    if wT.dtype == tl.float32:
        return tl.dot(x.to(tl.float32), wT, acc, input_precision="ieee")
    return tl.dot(x.to(wT.dtype), wT, acc)


@triton.jit
def _tile(w_ptr, K, offs_n, mask_n, offs_k, mask_k, x_ptr, stride_x, offs_b, mask_b, acc, ss, NORM: tl.constexpr):
    """One step of a V / U loop: acc (B_PAD, BLOCK_N) += x[rows, offs_k] @ w[offs_n, offs_k]ᵀ (w: rows of K, streamed
    past L1; the rows' x from L2: .cg); NORM: ss (B_PAD,) += the rows' sum of squares over offs_k."""
    wT = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0,
                 eviction_policy="evict_first")  # (BLOCK_K, BLOCK_N)
    xk = tl.load(x_ptr + offs_b[:, None] * stride_x + offs_k[None, :], mask=mask_b[:, None] & mask_k[None, :],
                 other=0.0, cache_modifier=".cg")  # (B_PAD, BLOCK_K)
    acc = _dot(xk, wT, acc)
    if NORM:
        xf = xk.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    return acc, ss


@triton.jit(noinline=True)
def _rows_gemv(ctr_ptr, rank, P, sid, prev, target, x_ptr, stride_x, w_ptr, y_ptr, stride_y, N, K, K_run, B, eps,
               NORM: tl.constexpr, RESIDUAL: tl.constexpr, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """y[b, n] (+)= sum_k w[n, k] x[b, k] for k < K_run (NORM: / rms(x[b])) for rows b < B and n < N (w: rows of
    K), BLOCK_N weight rows an item: one software-pipelined loop over (this program's items x tiles of K_run), the
    weight tile and the rows' tile of x (from L2: .cg) a step. K_run < K: PARSE slots' live width (the union)."""
    nk = tl.cdiv(K_run, BLOCK_K)
    mine = _mine(tl.cdiv(N, BLOCK_N), rank, P)
    _wait(ctr_ptr, prev, target, mine > 0)
    offs_b = tl.arange(0, B_PAD)
    mask_b = offs_b < B
    acc = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
    ss = tl.zeros((B_PAD,), dtype=tl.float32)
    for j in tl.range(0, mine * nk, num_stages=STAGES):
        i, kc, last = _position(j, nk, rank, P)
        offs_n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mask_k = offs_k < K_run
        acc, ss = _tile(w_ptr, K, offs_n, mask_n, offs_k, mask_k, x_ptr, stride_x, offs_b, mask_b, acc, ss, NORM)
        if last:
            y = acc
            if NORM:
                y = y / tl.sqrt(ss / K + eps)[:, None]
            ptrs = y_ptr + offs_b[:, None] * stride_y + offs_n[None, :]
            mask = mask_b[:, None] & mask_n[None, :]
            if RESIDUAL:  # each element has one owner
                y += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)
        acc = tl.where(last, 0.0, acc)
        ss = tl.where(last, 0.0, ss)
    _leave(ctr_ptr, sid)


@triton.jit(noinline=True)
def _rows_v_split(ctr_ptr, rank, P, sid, prev, target, x_ptr, stride_x, w_ptr, t_ptr, stride_t, ss_ptr, s1, s2, l0,
                  l1, l2, K, B, cover, keep_ptr, stride_keep, NORM: tl.constexpr, B_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, MIN_TILES: tl.constexpr,
                  KEEP: tl.constexpr):
    """t[b, n] += sum_k w[n, k] x[b, k] for the rows n of up to three segments, [0, l0), [s1, s1 + l1) and
    [s2, s2 + l2) (a packed matrix's projections; PARSE slots: the live rows of each), over items (block of BLOCK_N
    rows of a segment, chunk of the reduction): the reduction is split into as many chunks as give `cover` programs
    (the grid) at most one item each (few-row V stages: o V and down V have 10 / 14 blocks of 128 rows at the 7B shape
    against 264 programs), at least MIN_TILES tiles a chunk. At most one: a program with two items doubles the stage's
    tail (a PARSE union of 1.04 K gave down V 15 blocks x 18 chunks = 270 items for 264 programs, a span of 520 against
    414 us a step; bench/results/rows-trace-h200-s29.md). Each item adds its partial into t (fp32, zeroed before the
    step) with relaxed atomics. NORM: the items of row block 0 also add their chunk's sum of squares of x[b] into
    ss[b]; the consuming U stage scales by 1 / rms (t is linear in x). KEEP (PARSE slots): t[b, n] only where
    keep[b, n] (row b's components); the segments are the live rows (the batch's union), so every block is some
    row's."""
    nk = tl.cdiv(K, BLOCK_K)
    b0 = tl.cdiv(l0, BLOCK_N)
    b1 = tl.cdiv(l1, BLOCK_N)
    nrb = b0 + b1 + tl.cdiv(l2, BLOCK_N)
    split = tl.maximum(1, tl.minimum(cover // nrb, nk // MIN_TILES))  # nrb * split <= cover where it can be
    ck = tl.cdiv(nk, split)  # tiles a chunk
    split = tl.cdiv(nk, ck)  # chunks, none empty
    mine = _mine(nrb * split, rank, P)
    _wait(ctr_ptr, prev, target, mine > 0)
    offs_b = tl.arange(0, B_PAD)
    mask_b = offs_b < B
    acc = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
    ss = tl.zeros((B_PAD,), dtype=tl.float32)
    for j in tl.range(0, mine * ck, num_stages=STAGES):
        it = j // ck
        kt = j - it * ck
        i = rank + it * P
        rb = i // split
        kc = (i - rb * split) * ck + kt
        last = kt == ck - 1
        start = tl.where(rb < b0, rb * BLOCK_N, tl.where(rb < b0 + b1, s1 + (rb - b0) * BLOCK_N,
                                                        s2 + (rb - b0 - b1) * BLOCK_N))
        end = tl.where(rb < b0, l0, tl.where(rb < b0 + b1, s1 + l1, s2 + l2))
        offs_n = tl.multiple_of(start, 16) + tl.arange(0, BLOCK_N)  # segments start at multiples of 16
        offs_k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_n = offs_n < end
        mask_k = offs_k < K  # the last chunk may hold fewer tiles: the rest masked (no traffic)
        acc, ss = _tile(w_ptr, K, offs_n, mask_n, offs_k, mask_k, x_ptr, stride_x, offs_b, mask_b, acc, ss, NORM)
        if last:
            if KEEP:  # (B_PAD, BLOCK_N) 0/1, read once an item: a weight load whose mask waited on it would not
                # pipeline (measured 6.05 vs 3.54 ms static at B = 8, session 27); read before the item's tiles, or
                # as the atomic's mask, it was slower (bench/results/rows-trace-h200-s29-{prefetch,epilogue}-*.json)
                acc = acc * tl.load(keep_ptr + offs_b[:, None] * stride_keep + offs_n[None, :],
                                    mask=mask_b[:, None] & mask_n[None, :], other=0.0,
                                    eviction_policy="evict_last").to(tl.float32)
            tl.atomic_add(t_ptr + offs_b[:, None] * stride_t + offs_n[None, :], acc,
                          mask=mask_b[:, None] & mask_n[None, :], sem="relaxed")
            if NORM:
                first = (rb + tl.zeros((B_PAD,), dtype=tl.int32)) == 0  # (a tensor & scalar bool: interpreter)
                tl.atomic_add(ss_ptr + offs_b, ss, mask=mask_b & first, sem="relaxed")
        acc = tl.where(last, 0.0, acc)
        ss = tl.where(last, 0.0, ss)
    _leave(ctr_ptr, sid)


@triton.jit
def _inv_rms(ss_ptr, K, eps, B, B_PAD: tl.constexpr):
    """(B_PAD,) 1 / rms of each row from its sum of squares over K (written by the V stage: .cg)."""
    offs_b = tl.arange(0, B_PAD)
    ss = tl.load(ss_ptr + offs_b, mask=offs_b < B, other=0.0, cache_modifier=".cg")
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit(noinline=True)
def _rows_gate_up(ctr_ptr, rank, P, sid, prev, target, t_ptr, stride_t, ss_ptr, hidden, eps, ug_ptr, uu_ptr, m_ptr,
                  stride_m, N, rg, ru, lg, lu, B, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr):
    """m[b, n] = silu(Ug[n] . t[b, :rg] / rms_b) * (Uu[n] . t[b, rg:] / rms_b) for rows b < B, n < N (pipelined as
    _rows_gemv; rms_b from gate/up V's sum of squares); lg <= rg, lu <= ru: the components read (PARSE slots)."""
    nk = tl.cdiv(tl.maximum(lg, lu), BLOCK_K)
    mine = _mine(tl.cdiv(N, BLOCK_N), rank, P)
    _wait(ctr_ptr, prev, target, mine > 0)
    offs_b = tl.arange(0, B_PAD)
    mask_b = offs_b < B
    g = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
    u = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
    for j in tl.range(0, mine * nk, num_stages=STAGES):
        i, kc, last = _position(j, nk, rank, P)
        offs_n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mg = offs_k < lg
        mu = offs_k < lu
        wg = tl.load(ug_ptr + offs_n[None, :] * rg + offs_k[:, None], mask=mg[:, None] & mask_n[None, :], other=0.0,
                     eviction_policy="evict_first")
        wu = tl.load(uu_ptr + offs_n[None, :] * ru + offs_k[:, None], mask=mu[:, None] & mask_n[None, :], other=0.0,
                     eviction_policy="evict_first")
        row = t_ptr + offs_b[:, None] * stride_t
        tg = tl.load(row + offs_k[None, :], mask=mask_b[:, None] & mg[None, :], other=0.0, cache_modifier=".cg")
        tu = tl.load(row + rg + offs_k[None, :], mask=mask_b[:, None] & mu[None, :], other=0.0, cache_modifier=".cg")
        g = _dot(tg, wg, g)
        u = _dot(tu, wu, u)
        if last:
            inv = _inv_rms(ss_ptr, hidden, eps, B, B_PAD)[:, None]
            g = g * inv
            out = g / (1.0 + tl.exp(-g)) * (u * inv)
            tl.store(m_ptr + offs_b[:, None] * stride_m + offs_n[None, :], out.to(m_ptr.dtype.element_ty),
                     mask=mask_b[:, None] & mask_n[None, :])
        g = tl.where(last, 0.0, g)
        u = tl.where(last, 0.0, u)
    _leave(ctr_ptr, sid)


@triton.jit(noinline=True)
def _rows_qkv_u(ctr_ptr, rank, P, sid, prev, target, t_ptr, stride_t, ss_ptr, hidden, eps, w_ptr, off_q, off_k,
                off_v, rq, rk, rv, lq, lk, lv,
                cos_ptr, sin_ptr, seqlens_ptr, q_ptr, kc_ptr, vc_ptr, stride_kb, stride_ks, stride_kh, B,
                H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, B_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Item (head p of q|k|v, chunk of BLOCK_D dims of each half): rows (d, d + HALF) of that head for every row b,
    RoPE on q and k at the row's position seqlens[b], q stored, k and v written into row b's cache at that position
    (kc/vc: this layer's). Pipelined as _rows_gemv over the largest of the three ranks (masked beyond each's own);
    the output scaled by 1 / rms of x (q/k/v V's sum of squares). lq, lk, lv: the components read (PARSE slots)."""
    NC: tl.constexpr = (HALF + BLOCK_D - 1) // BLOCK_D
    nk = tl.cdiv(tl.maximum(tl.maximum(lq, lk), lv), BLOCK_K)
    mine = _mine((H + 2 * HKV) * NC, rank, P)
    _wait(ctr_ptr, prev, target, mine > 0)
    offs_b = tl.arange(0, B_PAD)
    mask_b = offs_b < B
    y1 = tl.zeros((B_PAD, BLOCK_D), dtype=tl.float32)
    y2 = tl.zeros((B_PAD, BLOCK_D), dtype=tl.float32)
    for j in tl.range(0, mine * nk, num_stages=STAGES):
        i, kc, last = _position(j, nk, rank, P)
        u_ptr, r, t_off, head, offs_d, p = _qkv_item(i, w_ptr, off_q, off_k, off_v, rq, rk, rv, H, HKV, BLOCK_D, NC)
        rows = head * (2 * HALF) + offs_d  # dims d of the head; their RoPE partners are rows + HALF
        mask_d = offs_d < HALF
        offs_k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < tl.where(p < H, lq, tl.where(p < H + HKV, lk, lv))
        mask_w = mask_k[:, None] & mask_d[None, :]
        w1 = tl.load(u_ptr + rows[None, :] * r + offs_k[:, None], mask=mask_w, other=0.0,
                     eviction_policy="evict_first")  # (BLOCK_K, BLOCK_D)
        w2 = tl.load(u_ptr + (rows + HALF)[None, :] * r + offs_k[:, None], mask=mask_w, other=0.0,
                     eviction_policy="evict_first")
        tk = tl.load(t_ptr + offs_b[:, None] * stride_t + t_off + offs_k[None, :],
                     mask=mask_b[:, None] & mask_k[None, :], other=0.0, cache_modifier=".cg")  # (B_PAD, BLOCK_K)
        y1 = _dot(tk, w1, y1)  # dims d
        y2 = _dot(tk, w2, y2)  # dims d + HALF
        if last:
            inv = _inv_rms(ss_ptr, hidden, eps, B, B_PAD)[:, None]
            y1 = y1 * inv
            y2 = y2 * inv
            pos = tl.load(seqlens_ptr + offs_b, mask=mask_b, other=0)  # (B_PAD,) each row's position
            mask_bd = mask_b[:, None] & mask_d[None, :]
            trig = pos[:, None] * HALF + offs_d[None, :]
            cos = tl.load(cos_ptr + trig, mask=mask_bd, other=1.0)
            sin = tl.load(sin_ptr + trig, mask=mask_bd, other=0.0)
            seg = p + tl.zeros((B_PAD, BLOCK_D), dtype=tl.int32)  # full-tensor masks (interpreter)
            is_v = seg >= H + HKV
            o1 = tl.where(is_v, y1, y1 * cos - y2 * sin)
            o2 = tl.where(is_v, y2, y2 * cos + y1 * sin)
            mask_q = mask_bd & (seg < H)
            mask_kc = mask_bd & (seg >= H) & (seg < H + HKV)
            mask_v = mask_bd & is_v
            q_at = q_ptr + offs_b[:, None] * (H * 2 * HALF) + rows[None, :]
            tl.store(q_at, o1.to(q_ptr.dtype.element_ty), mask=mask_q)
            tl.store(q_at + HALF, o2.to(q_ptr.dtype.element_ty), mask=mask_q)
            c_off = (offs_b.to(tl.int64)[:, None] * stride_kb + pos.to(tl.int64)[:, None] * stride_ks
                     + head * stride_kh + offs_d[None, :])
            tl.store(kc_ptr + c_off, o1.to(kc_ptr.dtype.element_ty), mask=mask_kc)
            tl.store(kc_ptr + c_off + HALF, o2.to(kc_ptr.dtype.element_ty), mask=mask_kc)
            tl.store(vc_ptr + c_off, o1.to(vc_ptr.dtype.element_ty), mask=mask_v)
            tl.store(vc_ptr + c_off + HALF, o2.to(vc_ptr.dtype.element_ty), mask=mask_v)
        y1 = tl.where(last, 0.0, y1)
        y2 = tl.where(last, 0.0, y2)
    _leave(ctr_ptr, sid)


@triton.jit(noinline=True)
def _rows_attention(ctr_ptr, rank, P, sid, prev, target, q_ptr, kc_ptr, vc_ptr, stride_kb, stride_ks, stride_kh,
                    seqlens_ptr, a_ptr, mid_o_ptr, mid_lse_ptr, head_ctr_ptr, qk_scale, B, G: tl.constexpr,
                    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                    DOT_PREC: tl.constexpr):
    """Item (row b, kv head hk, split): the head's query heads over the split's keys of row b (seqlens[b] + 1 of them);
    one split writes a[b] directly, several write partials mid_o (B, H, NUM_SPLITS, D) / mid_lse (B, H, NUM_SPLITS)
    and the last of a (row, kv head)'s splits to finish merges them (a counter each, head_ctr_ptr[b * HKV + hk])."""
    n = B * HKV * NUM_SPLITS
    i = rank
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < D
    offs_g = tl.arange(0, BLOCK_H)
    mask_g = offs_g < G
    mask = mask_g[:, None] & mask_d[None, :]
    _wait(ctr_ptr, prev, target, i < n)
    while i < n:
        b = i // (HKV * NUM_SPLITS)
        hk = (i // NUM_SPLITS) % HKV
        split = i % NUM_SPLITS
        seqlen = tl.load(seqlens_ptr + b) + 1
        split_len = tl.cdiv(tl.cdiv(seqlen, NUM_SPLITS), BLOCK_N) * BLOCK_N
        offs_h = hk * G + offs_g  # (BLOCK_H,) query heads of this kv head
        q = tl.load(q_ptr + b * (H * D) + offs_h[:, None] * D + offs_d[None, :], mask=mask, other=0.0,
                    cache_modifier=".cg")  # (BLOCK_H, D_PAD)
        start = split * split_len
        row = b.to(tl.int64) * stride_kb + hk * stride_kh
        o, lse = attend(q, kc_ptr + row, vc_ptr + row, stride_ks, stride_ks, start,
                        tl.minimum(start + split_len, seqlen), offs_d, mask_d, qk_scale, BLOCK_H, D_PAD, BLOCK_N,
                        DOT_PREC)
        a_at = a_ptr + b * (H * D) + offs_h[:, None] * D + offs_d[None, :]
        if NUM_SPLITS == 1:
            tl.store(a_at, o.to(a_ptr.dtype.element_ty), mask=mask)
        else:
            mo = mid_o_ptr + b * (H * NUM_SPLITS * D)
            ml = mid_lse_ptr + b * (H * NUM_SPLITS)
            tl.store(mo + (offs_h[:, None] * NUM_SPLITS + split) * D + offs_d[None, :], o, mask=mask)
            tl.store(ml + offs_h * NUM_SPLITS + split, lse, mask=mask_g)
            tl.debug_barrier()  # this item's partial stores issued before the counter's release
            if tl.atomic_add(head_ctr_ptr + b * HKV + hk, 1, sem="acq_rel") == NUM_SPLITS - 1:
                out = merge_group(mo, ml, NUM_SPLITS * D, D, NUM_SPLITS, offs_h, mask_g, offs_d, mask_d, BLOCK_H,
                                  D_PAD, NUM_SPLITS, SPLITS_PAD)
                tl.store(a_at, out.to(a_ptr.dtype.element_ty), mask=mask)
        i += P
    _leave(ctr_ptr, sid)


@triton.jit
def _live(lp, j, r):
    """Components in use of projection j (PROJS order) from the layer's live widths, at most its slot width r."""
    return tl.multiple_of(tl.minimum(tl.load(lp + j, eviction_policy="evict_last"), r), 16)


@triton.jit
def _rows_kernel(w_ptr, meta_ptr, head_ptr, x_ptr, tz_ptr, q_ptr, a_ptr, m_ptr, logits_ptr, kc_ptr, vc_ptr,
                 seqlens_ptr, cos_ptr, sin_ptr, mid_o_ptr, mid_lse_ptr, ctr_ptr, keep_ptr, live_ptr, trace_ptr,
                 B, L, hidden, inter, vocab, rmax, cover, stride_keep, stride_kl, stride_kb, stride_ks, stride_kh, eps,
                 qk_scale,
                 H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, D_PAD: tl.constexpr, B_PAD: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                 ATT_BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, BN_V: tl.constexpr, BK_V: tl.constexpr,
                 BN_U: tl.constexpr, BK_U: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr,
                 BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, STAGES: tl.constexpr, MIN_TILES: tl.constexpr,
                 MASKED: tl.constexpr, TRACE: tl.constexpr):
    D: tl.constexpr = 2 * HALF
    NS = L * SLOTS + 1  # stages: SLOTS a layer (slot 3 unused), then the head
    P = tl.num_programs(0)
    rank = tl.atomic_add(ctr_ptr, 1, sem="relaxed")  # items by arrival order (all P are resident)
    _stamp_sm(trace_ptr, rank, NS, TRACE)
    ss_base = tz_ptr + L * 4 * B * rmax  # (L, 2, B_PAD) sums of squares after the (L, 4, B, rmax) V outputs
    for layer in range(L):
        mp = meta_ptr + layer * META_ROW
        rq, rk, rv = _rank(mp, 11, True), _rank(mp, 12, True), _rank(mp, 13, True)
        ro, rg, ru, rd = _rank(mp, 14, True), _rank(mp, 15, True), _rank(mp, 16, True), _rank(mp, 17, True)
        if MASKED:  # PARSE slots: the components in use (the batch's union, stored first), keep columns per group
            lp = live_ptr + layer * LIVE_ROW  # not through the table: no load waits on another
            lq, lk, lv = _live(lp, 0, rq), _live(lp, 1, rk), _live(lp, 2, rv)
            lo, lg, lu, ld = _live(lp, 3, ro), _live(lp, 4, rg), _live(lp, 5, ru), _live(lp, 6, rd)
            k_qkv, k_o = keep_ptr + _offset(mp, 18, True), keep_ptr + _offset(mp, 19, True)
            k_gu, k_d = keep_ptr + _offset(mp, 20, True), keep_ptr + _offset(mp, 21, True)
            n_q, n_k, n_v, n_g, n_u = lq, lk, lv, lg, lu  # V rows per segment: the live ones
        else:
            lq, lk, lv, lo, lg, lu, ld = rq, rk, rv, ro, rg, ru, rd
            k_qkv, k_o, k_gu, k_d = keep_ptr, keep_ptr, keep_ptr, keep_ptr
            n_q, n_k, n_v, n_g, n_u = rq + rk + rv, 0, 0, rg + ru, 0  # one segment: a packed matrix's rows at once
        s0 = layer * SLOTS
        lay = tl.cast(layer, tl.int64)
        kc = kc_ptr + lay * stride_kl
        vc = vc_ptr + lay * stride_kl
        tz = tz_ptr + lay * (4 * B * rmax)  # this layer's V outputs: q/k/v, o, gate/up, down; fp32, zeroed
        t_qkv, t_o, t_gu, t_d = tz, tz + B * rmax, tz + 2 * B * rmax, tz + 3 * B * rmax
        ss_qkv = ss_base + layer * (2 * B_PAD)
        ss_gu = ss_qkv + B_PAD
        _stamp(trace_ptr, rank, s0, NS, TRACE)
        _rows_v_split(ctr_ptr, rank, P, s0, tl.maximum(s0 - 1, 0), tl.where(layer == 0, 0, P), x_ptr, hidden,
                      _weight(w_ptr, mp, 0, True), t_qkv, rmax, ss_qkv, rq, rq + rk, n_q, n_k, n_v, hidden, B, cover,
                      k_qkv, stride_keep, True, B_PAD, BN_V, BK_V, STAGES, MIN_TILES, MASKED)
        _stamp(trace_ptr, rank, s0 + 1, NS, TRACE)
        _rows_qkv_u(ctr_ptr, rank, P, s0 + 1, s0, P, t_qkv, rmax, ss_qkv, hidden, eps, w_ptr, _offset(mp, 1, True),
                    _offset(mp, 2, True), _offset(mp, 3, True), rq, rk, rv, lq, lk, lv, cos_ptr, sin_ptr, seqlens_ptr,
                    q_ptr, kc, vc, stride_kb, stride_ks, stride_kh, B, H, HKV, HALF, B_PAD, BN_QKV, BK_QKV, STAGES)
        _stamp(trace_ptr, rank, s0 + 2, NS, TRACE)
        _rows_attention(ctr_ptr, rank, P, s0 + 2, s0 + 1, P, q_ptr, kc, vc, stride_kb, stride_ks, stride_kh,
                        seqlens_ptr, a_ptr, mid_o_ptr, mid_lse_ptr, ctr_ptr + (L * SLOTS + 2) * PAD + layer * B * HKV,
                        qk_scale, B, H // HKV, H, HKV, D, D_PAD, BLOCK_H, ATT_BLOCK_N, NUM_SPLITS, SPLITS_PAD,
                        DOT_PREC)
        _stamp(trace_ptr, rank, s0 + 4, NS, TRACE)
        _rows_v_split(ctr_ptr, rank, P, s0 + 4, s0 + 2, P, a_ptr, H * D, _weight(w_ptr, mp, 4, True), t_o, rmax,
                      ss_qkv, 0, 0, lo, 0, 0, H * D, B, cover, k_o, stride_keep, False, B_PAD, BN_V, BK_V, STAGES,
                      MIN_TILES, MASKED)
        _stamp(trace_ptr, rank, s0 + 5, NS, TRACE)
        _rows_gemv(ctr_ptr, rank, P, s0 + 5, s0 + 4, P, t_o, rmax, _weight(w_ptr, mp, 5, True), x_ptr, hidden,
                   hidden, ro, lo, B, eps, False, True, B_PAD, BN_U, BK_U, STAGES)
        _stamp(trace_ptr, rank, s0 + 6, NS, TRACE)
        _rows_v_split(ctr_ptr, rank, P, s0 + 6, s0 + 5, P, x_ptr, hidden, _weight(w_ptr, mp, 6, True), t_gu, rmax,
                      ss_gu, rg, 0, n_g, n_u, 0, hidden, B, cover, k_gu, stride_keep, True, B_PAD, BN_V, BK_V, STAGES,
                      MIN_TILES, MASKED)
        _stamp(trace_ptr, rank, s0 + 7, NS, TRACE)
        _rows_gate_up(ctr_ptr, rank, P, s0 + 7, s0 + 6, P, t_gu, rmax, ss_gu, hidden, eps, _weight(w_ptr, mp, 7, True),
                      _weight(w_ptr, mp, 8, True), m_ptr, inter, inter, rg, ru, lg, lu, B, B_PAD, BN_GU, BK_GU, STAGES)
        _stamp(trace_ptr, rank, s0 + 8, NS, TRACE)
        _rows_v_split(ctr_ptr, rank, P, s0 + 8, s0 + 7, P, m_ptr, inter, _weight(w_ptr, mp, 9, True), t_d, rmax, ss_gu,
                      0, 0, ld, 0, 0, inter, B, cover, k_d, stride_keep, False, B_PAD, BN_V, BK_V, STAGES, MIN_TILES,
                      MASKED)
        _stamp(trace_ptr, rank, s0 + 9, NS, TRACE)
        _rows_gemv(ctr_ptr, rank, P, s0 + 9, s0 + 8, P, t_d, rmax, _weight(w_ptr, mp, 10, True), x_ptr, hidden,
                   hidden, rd, ld, B, eps, False, True, B_PAD, BN_U, BK_U, STAGES)
    # final norm (folded into the head's columns) + LM head, fp32 logits: items walk the whole row (the norm rides
    # along), enough of them at a real vocabulary
    _stamp(trace_ptr, rank, NS - 1, NS, TRACE)
    _rows_gemv(ctr_ptr, rank, P, NS - 1, NS - 2, P, x_ptr, hidden, head_ptr, logits_ptr, vocab, vocab, hidden, hidden,
               B, eps, True, False, B_PAD, BN_V, BK_V, STAGES)
    _stamp(trace_ptr, rank, NS, NS, TRACE)


class RowsStepKernel:
    """The one-launch step for B = 2..8 rows over a FastDecoder's packed layers (norms folded) and buffers; `run()`
    is two memsets (the counters, the V outputs) and one launch, no host sync or allocation. Layers of PARSE slots
    (workers/parse_decode.py: keep masks and live widths, views of one buffer each) run masked: each row computes
    with its own components, and only the union's are read."""

    def __init__(self, layers: list, head_n: torch.Tensor, bufs: dict, cfg, num_splits: int, batch_size: int,
                 rcfg: RowsConfig | None = None) -> None:
        self.rcfg = rcfg or RowsConfig()
        if not 2 <= batch_size <= 16:
            raise ValueError(f"the rows step runs 2..16 rows, got {batch_size}")
        if not all(getattr(l, "folded", False) for l in layers):
            raise ValueError("the one-launch step needs every layer factorized with fused norms (fuse_norm)")
        base = layers[0].Vqkv
        dev, dt, es = base.device, base.dtype, base.element_size()
        rows = []
        for L in layers:
            ws, ranks = layer_weights(L)
            for w in ws:
                if w.dtype != dt or not w.is_contiguous():
                    raise ValueError(f"the one-launch step wants contiguous {dt} weights")
            if dev.type == "cuda":
                check_aligned(ws, ranks)
            rows.append([(w.data_ptr() - base.data_ptr()) // es for w in ws] + ranks)
        self.masked = layers[0].keep_qkv is not None
        groups = ("keep_qkv", "keep_o", "keep_gu", "keep_down")
        self.keep, self.live = (layers[0].keep_qkv, layers[0].live) if self.masked else (None, None)
        for i, (L, row) in enumerate(zip(layers, rows)):  # keep columns of each group (views of one (B, cols) buffer)
            if self.masked != (L.keep_qkv is not None) or (self.masked and any(getattr(L, g) is None for g in groups)
                                                            or self.masked and L.live is None):
                raise ValueError("the rows step wants every layer masked (PARSE slots: keep and live) or none")
            if self.masked:
                row += [(getattr(L, g).data_ptr() - self.keep.data_ptr()) // self.keep.element_size() for g in groups]
                if (L.live.data_ptr() - self.live.data_ptr()) // L.live.element_size() != i * LIVE_ROW.value:
                    raise ValueError(f"the rows step reads layer i's live widths at row i of one (L, {LIVE_ROW.value}) "
                                     f"tensor; layer {i}'s are elsewhere")
            row += [0] * (META_ROW.value - len(row))
        self.meta = torch.tensor(rows, dtype=torch.int64, device=dev)  # (L, META_ROW)
        self.base, self.head_n, self.b, self.cfg, self.B = base, head_n, bufs, cfg, batch_size
        self.num_splits = num_splits
        self.on_gpu = dev.type == "cuda"
        H, HKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # counter 0: rank tickets; a done counter a stage, PAD apart; then a merge counter per (layer, row, kv head)
        self.ctr = torch.zeros((len(layers) * SLOTS + 2) * PAD + len(layers) * batch_size * HKV, dtype=torch.int32,
                               device=dev)
        # the V stages' outputs, split-K partial sums added with atomics: (L, 4, B, rmax) fp32 (q/k/v, o, gate/up,
        # down), then (L, 2, B_PAD) sums of squares of x (q/k/v V, gate/up V); zeroed before each step
        self.rmax = bufs["t"].shape[1]
        b_pad = max(16, triton.next_power_of_2(batch_size))
        self.tz = torch.zeros(len(layers) * (4 * batch_size * self.rmax + 2 * b_pad), dtype=torch.float32, device=dev)
        k = self.rcfg
        self.consts = dict(
            H=H, HKV=HKV, HALF=D // 2, D_PAD=triton.next_power_of_2(D), B_PAD=b_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            BLOCK_H=max(16, triton.next_power_of_2(H // HKV)), ATT_BLOCK_N=64 if self.on_gpu else 16,
            DOT_PREC="ieee" if bufs["k_cache"].dtype == torch.float32 else "tf32", **k.constexprs(self.on_gpu),
            MASKED=self.masked, num_warps=k.num_warps if self.on_gpu else 1)
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if self.on_gpu else 1
        # trace (RowsConfig.trace, GPU): (programs, stages + 2) int64 global-timer stamps, then each program's SM;
        # untraced, the kernel never touches it and gets the counters as a placeholder pointer
        stages = len(layers) * SLOTS + 1
        self.trace = (torch.zeros(self.sms * 32, stages + 2, dtype=torch.int64, device=dev)
                      if self.consts["TRACE"] else self.ctr)
        self.grid = (self.sms,)  # one program an SM until the compiled occupancy is known (interpreter: one program)
        self.cover = 0  # programs the V stages' split aims to give an item (0: the grid; tests set more)
        self.resident: int | None = None

    def run(self) -> None:
        cfg, b, k = self.cfg, self.b, self.rcfg
        kc, vc = b["k_cache"], b["v_cache"]  # (L, B, S_max, H_kv, D)
        self.ctr.zero_()
        self.tz.zero_()
        kernel = _rows_kernel[self.grid](
            self.base, self.meta, self.head_n, b["x"], self.tz, b["q"], b["a"], b["m"], b["logits"], kc, vc,
            b["seqlens"], b["cos"], b["sin"], b["mid_o"], b["mid_lse"], self.ctr,
            self.keep if self.masked else self.ctr, self.live if self.masked else self.ctr, self.trace,
            self.B, len(self.meta), cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, self.rmax,
            self.cover or self.grid[0], self.keep.stride(0) if self.masked else 0,
            kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3), float(cfg.rms_norm_eps),
            math.log2(math.e) / math.sqrt(cfg.head_dim), **self.consts)
        if self.on_gpu and self.resident is None:  # every program resident at once: cap the grid at what fits
            self.resident = resident_programs(kernel.n_regs, kernel.metadata.shared, k.num_warps, kc.device)
            self.grid = (self.sms * min(k.programs_per_sm, self.resident),)
