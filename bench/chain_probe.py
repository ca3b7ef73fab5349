"""Can one weight stream run across stage boundaries? (GPU diagnostics for the one-launch step)

The one-launch step (kernels/step_kernel.py) runs each stage of each layer as its own software-pipelined loop: at
every boundary a program drains its pipeline, waits for the previous stage, reads its input and fills the pipeline
again, 9 times a layer. Its stages' loops alone stream at 79-102 % of the copy bandwidth (bench/stream_probe.py),
summing to ~2.13 ms for a step that takes 2.60 ms with no waits at all and 2.82 ms with them (decode-log.md, session
14): the starts and ends cost more than the loops. This probe times the step's GEMV stages (no attention, no head)
in two shapes of the same work:

    loops   a program walks the segments (a stage of a layer) one after the other, one pipelined loop each, as the
            step does: wait for the segment it depends on, read its input once into registers, stream its items,
            count itself done (release)
    stream  one pipelined loop over all of a program's steps of all segments: the weight tiles of the next segment
            are asked for while the last steps of this one still compute, and the wait, the input read and the
            release happen inside the loop at the segment's first and last step

Both deal a segment's items to the programs as the step does (rank, rank + P, ...), read every weight with the same
(rows x width) tile, hold the input as up to 4 register tiles (down V is cut into its column blocks of 4 tiles, each
its own segment, as the step's split_down_v) and write y = W x. What a segment waits for (--deps):

    stage   the previous map's counter reaching P (down U: 3P, all of down V's blocks), as the step's stage
            counters: every program counts itself done after its last step (a CTA barrier, then a release add)
    blocks  only the column blocks of its input it reads, each the first time the program reads it in the
            segment: every item counts itself into its block of the map's output (split-K dependencies everywhere)
    none    nothing (the results are still right: every input is fixed); the stream's own cost
    data    a flag-in-data protocol: every item also writes its rows as 32-bit words, a bf16 value in the high half
            and the pass's epoch (a step's position) in the low; a consumer re-reads its input's words until all
            carry the epoch: no counter, no fence, one round trip when the data is there
    local-v the U maps and o V wait as for stage; q/k/v V, gate/up V and down V's blocks wait for nothing. This is
            the bound of a schedule where each program's V partial reads only the rows of x it wrote itself in the
            previous U map (x's slice owned, V stored by columns), so that only the partials' sum is all-to-all:
            5 dependent hops a layer instead of 8 (o V's wait stands for attention's on q/k/v U). It leaves out
            what summing the partials would cost (the local V maps have 1792-3696 rows, 264 partials each)
    local-v-sum  local-v with that sum's traffic: after each local V map (before its release) every program adds
            a partial of the map's rows into one fp32 vector a segment with relaxed atomics (1.0 a row, so the
            sums count the programs); the U map's wait then waits for the adds as well
    local-v-sum4  the same with one 16-byte vector add (red.v4.f32) for 4 rows instead of 4 scalar adds (GPU; the
            interpreter adds them one by one)

The values every variant computes with are the fixed x (the tagged words carry x's value at their row), so every
variant computes the same y, checked against torch's W x before it is timed (graph replay, cold L2, median, as
bench/kernels_gpu).

Measured on the H200 (decode-log.md, session 15; chain-probe-h200.json): without waits one loop 2.256 ms (85% of the
copy bandwidth) vs a loop a segment 2.522; with the stage counters 2.930 vs 2.997 (2%); blocks 3.73-3.80, data
3.90-4.18, spread counters 2.97-3.10, one count a warp 3.04-3.10: no protocol beats the step's; with every
program given the same items (--balanced) the waits cost as much (chain-probe-h200-balanced.json). Session 16: more
stages (--stages 4 6, or 8 and 12 with --per-sm 1) do not shorten the waits (chain-probe-h200-depth*.json); with the
counters' fences removed (--fences none: relaxed adds and polls, timing only) one loop still takes 2.706 ms against
2.244 without waits: ~1.8 us of bare round trips for each of the 8 dependent hops a layer
(chain-probe-h200-fences.json). Session 18: with q/k/v V, gate/up V and down V waiting for nothing (local-v, 5
hops a layer) one loop takes 2.699 ms against 2.911 with the step's counters, but summing the V partials with
atomics (local-v-sum, local-v-sum4) takes it to 3.09-3.11 ms (chain-probe-h200-localv*.json).

Usage: python -m rankserve.bench.chain_probe --out bench/results/chain-probe-h200.json
       python -m rankserve.bench.chain_probe --markdown bench/results/chain-probe-h200.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

PAD = tl.constexpr(32)  # int32 counters a 128-byte line apart
COLS = 16  # int64 columns of the segment table (see segments())
# what a segment waits for (see the module docstring)
DEPS = ("stage", "blocks", "none", "data", "spread", "local-v", "local-v-sum", "local-v-sum4")
SPREAD = 8  # counters a map for the spread dependency
RELEASES = ("cta", "warp")  # how a program counts itself done (Chain.run)
# the memory order of the counters (Chain.run): release adds and acquire polls (right), a relaxed add (timing only),
# relaxed polls then one acquire fence (right), relaxed adds and polls with no fence (timing only)
FENCES = ("both", "relaxed-add", "one-acquire", "none")


@dataclass
class ChainShape:
    """The step's GEMV maps of one layer (LLaMA-7B, keep 0.6, svd-llm ranks padded to 16) and the tile."""
    hidden: int = 4096
    rank_qkv: int = 1232  # each of q, k, v (q/k/v V has 3 x this many rows)
    rank_o: int = 1232
    rank_gu: int = 1792  # each of gate, up
    rank_d: int = 1792
    inter: int = 11008
    layers: int = 32
    block_n: int = 8  # rows an item
    block_k: int = 1024  # columns a tile; inputs up to 4 tiles wide are held in registers
    # 0: the step's rows; else every map's rows rounded up to a multiple of this (programs x block_n: every program
    # the same items in every segment, so a wait has no item imbalance to absorb)
    round_rows: int = 0

    def __post_init__(self) -> None:
        if max(self.hidden, self.rank_qkv, self.rank_o, 2 * self.rank_gu, self.rank_d) > 4 * self.block_k:
            raise ValueError(f"chain probe: every input but down V's must fit 4 tiles of {self.block_k}")
        if self.block_k % self.block_n:
            raise ValueError("chain probe: an item's rows must not straddle a column block of the next map")


def maps(s: ChainShape) -> list[tuple[str, int, int]]:
    """(name, rows N, columns K) of one layer's weights, in step order (q, k, v's U stacked; gate/up U as one map whose
    row n is gate's and up's row n side by side, reading both halves of t, as the step's items do)."""
    out = [("qkv V", 3 * s.rank_qkv, s.hidden), ("qkv U", 3 * s.hidden, s.rank_qkv), ("o V", s.rank_o, s.hidden),
           ("o U", s.hidden, s.rank_o), ("gate/up V", 2 * s.rank_gu, s.hidden),
           ("gate/up U", s.inter, 2 * s.rank_gu), ("down V", s.rank_d, s.inter), ("down U", s.hidden, s.rank_d)]
    if s.round_rows:
        out = [(name, -(-n // s.round_rows) * s.round_rows, k) for name, n, k in out]
    return out


def segments(s: ChainShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int, list]:
    """The segment table (n_seg, COLS) int64, the counters' targets for the blocks dependency (int32, one a
    counter), the weights' element count, y's length, and for the check (w_off, N, K, ld, y_off) a segment.

    A segment is a map of a layer (down V: a column block of 4 tiles of it, each its own segment reading its block
    of x and writing its own partial, as the step's split_down_v). Columns: 0 w_off, 1 N, 2 K, 3 row stride, 4 y_off
    (also where its tagged output goes); the stage dependency: 5 the counter waited on (-1: none, layer 0's first
    map), 6 its target / P, 7 the counter released into (one a map); the blocks dependency: 8 the first counter of
    this map's output blocks (BLOCK_K rows each), 10 the first counter of the blocks it reads (its tile kc reads
    block kc; -1: none), a block's target the number of producer items in it; the data dependency: 11 where its
    input's tagged words start (-1: none), 12 how many partials it sums (down U: down V's blocks), 13 their stride;
    the local-v dependency: 14 the counter waited on (-1: none; its target column 6, its release column 7).
    The counters: one a map, then the blocks, each PAD apart (Chain adds SPREAD a map after them)."""
    bk, bn = s.block_k, s.block_n
    n_maps = s.layers * len(maps(s))
    rows, w_off, y_off = [], 0, 0
    prev, mult = -1, 1  # the stage counter the next map waits on and its target / P
    prev_blk, prev_y, prev_n = -1, -1, 0  # the previous map's first block counter, first y_off and rows
    need: list[int] = [0] * n_maps
    for m in range(n_maps):
        name, n, k = maps(s)[m % len(maps(s))]
        own = len(need)
        need += [0] * -(-n // bk)
        parts = -(-k // (4 * bk)) if name == "down V" else 1
        first_y = y_off
        for c in range(parts):
            kc = min(4 * bk, k - c * 4 * bk)
            wait_blk = prev_blk + 4 * c if prev_blk >= 0 else -1
            tag_in = prev_y + 4 * bk * c if prev_y >= 0 else -1
            local = -1 if name in ("qkv V", "gate/up V", "down V") else prev  # the local-v dependency's wait
            rows.append([w_off + c * 4 * bk, n, kc, k, y_off, prev, mult, m, own, 0, wait_blk, tag_in, mult, prev_n,
                         local, 0])
            y_off += n
            for i in range(-(-n // bn)):  # each item of the segment counts into its block
                need[own + i * bn // bk] += 1
        prev, mult, prev_blk, prev_y, prev_n = m, parts, own, first_y, n
        w_off += n * k
    table = torch.tensor(rows, dtype=torch.int64, device=device)
    return (table, torch.tensor(need, dtype=torch.int32, device=device), w_off, y_off,
            [(r[0], r[1], r[2], r[3], r[4]) for r in rows])


@triton.jit
def _params(seg_ptr, s, rank, P, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Segment s's weight offset, rows, columns, row stride, y offset, tiles of K, and this program's steps in it
    (at least one: a program without items takes one masked step, so it passes the segment's wait and release)."""
    row = seg_ptr + s * 16
    # offsets and sizes are multiples of 16 (segments() builds them so): promised to the compiler, or every weight
    # load is a scalar 2-byte load and nothing is pipelined
    w_off = tl.multiple_of(tl.load(row), 16)
    n = tl.load(row + 1).to(tl.int32)
    k = tl.multiple_of(tl.load(row + 2).to(tl.int32), 16)
    ld = tl.multiple_of(tl.load(row + 3), 16)
    y_off = tl.load(row + 4)
    nk = tl.cdiv(k, BLOCK_K)
    mine = tl.maximum(tl.cdiv(tl.maximum(tl.cdiv(n, BLOCK_N) - rank, 0), P), 1)
    return w_off, n, k, ld, y_off, nk, mine * nk


@triton.jit
def _poll(ptr, target, FENCE: tl.constexpr = 0, ASM: tl.constexpr = False):
    """Spin until the counter at ptr reaches target (one L2 round trip a poll). FENCE 0/1: every poll an acquire;
    2: relaxed polls, then one acquire fence (GPU); 3: relaxed polls and no fence (timing only)."""
    if FENCE >= 2:
        while tl.atomic_add(ptr, 0, sem="relaxed") < target:
            pass
        if FENCE == 2 and ASM:
            tl.inline_asm_elementwise("{ fence.acq_rel.gpu; mov.u32 $0, 0; }", "=r,l", [ptr], dtype=tl.int32,
                                      is_pure=False, pack=1)
    else:
        while tl.atomic_add(ptr, 0, sem="acquire") < target:
            pass


@triton.jit
def _poll_spread(ptr, target, SPREAD: tl.constexpr):
    """Spin until the SPREAD counters from ptr (PAD apart) sum to target, then acquire: one round trip a poll, the
    SPREAD reads in parallel."""
    ptrs = ptr + tl.arange(0, SPREAD) * PAD
    got = tl.sum(tl.atomic_add(ptrs, tl.zeros((SPREAD,), dtype=tl.int32), sem="acquire"), axis=0)
    while got < target:
        got = tl.sum(tl.atomic_add(ptrs, tl.zeros((SPREAD,), dtype=tl.int32), sem="acquire"), axis=0)


@triton.jit
def _read(x_ptr, kc, K, BLOCK_K: tl.constexpr):
    """Tile kc of x[:K], fp32, from L2 (.cg: written by other programs of the launch in a real step)."""
    offs = kc * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg")


@triton.jit
def _tagged(ptr, kc, K, ep, BLOCK_K: tl.constexpr):
    """Tile kc of a tagged input (32-bit words: a bf16 value in the high half, the writer's epoch in the low) as
    read now, and how many of its words do not carry epoch ep yet."""
    offs = kc * BLOCK_K + tl.arange(0, BLOCK_K)
    m = offs < K
    wv = tl.load(ptr + offs, mask=m, other=0, volatile=True)
    return wv, tl.sum((((wv & 0xFFFF) != ep) & m).to(tl.int32), axis=0)


@triton.jit
def _read_tagged(ptr, K, ep, BLOCK_K: tl.constexpr):
    """A tagged input x[:K] as four fp32 register tiles, its four tiles read together until every word carries this
    pass's epoch ep (a 32-bit word is written and read whole, so a word with the right epoch holds the right value:
    no counter, no fence; one round trip when the data is there). The epoch has 16 bits: a word exactly 65,536 passes
    stale would pass too, far more passes than a run of the probe makes between two writes of a word."""
    w1, b1 = _tagged(ptr, 0, K, ep, BLOCK_K)
    w2, b2 = _tagged(ptr, 1, K, ep, BLOCK_K)
    w3, b3 = _tagged(ptr, 2, K, ep, BLOCK_K)
    w4, b4 = _tagged(ptr, 3, K, ep, BLOCK_K)
    bad = b1 + b2 + b3 + b4
    while bad > 0:  # (a reduction in the loop's condition fails triton 3.6's layout pass: counted in the body)
        w1, b1 = _tagged(ptr, 0, K, ep, BLOCK_K)
        w2, b2 = _tagged(ptr, 1, K, ep, BLOCK_K)
        w3, b3 = _tagged(ptr, 2, K, ep, BLOCK_K)
        w4, b4 = _tagged(ptr, 3, K, ep, BLOCK_K)
        bad = b1 + b2 + b3 + b4
    return ((w1 & -65536).to(tl.float32, bitcast=True), (w2 & -65536).to(tl.float32, bitcast=True),
            (w3 & -65536).to(tl.float32, bitcast=True), (w4 & -65536).to(tl.float32, bitcast=True))


@triton.jit
def _release(ptr, ASM: tl.constexpr, WARP: tl.constexpr, FENCE: tl.constexpr = 0):
    """Count this program's stores done (+1 at ptr, release: visible to whoever acquires it). ASM (GPU): the CTA
    barrier (4 warps) and the release as inline PTX (named barrier 1; triton's own use 0), because a
    `tl.debug_barrier()` inside a loop stops triton pipelining it (seen in the sm90 TTGIR: no async copies). WARP
    (GPU): no CTA barrier, each warp counts itself (+1 a warp after a warp barrier, which orders its threads' stores
    before its lane 0's release): the waits' targets are 4 times larger."""
    if WARP:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; bar.warp.sync -1; mov.u32 t, %laneid; setp.eq.u32 p, t, 0; "
            "@p red.release.gpu.global.add.s32 [$1], 1; mov.u32 $0, 0; }",
            "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)
    elif ASM and (FENCE == 1 or FENCE == 3):  # (timing only: the add orders nothing)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; bar.sync 1, 128; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p red.relaxed.gpu.global.add.s32 [$1], 1; mov.u32 $0, 0; }",
            "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)
    elif ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; bar.sync 1, 128; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p red.release.gpu.global.add.s32 [$1], 1; mov.u32 $0, 0; }",
            "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)
    elif FENCE == 1 or FENCE == 3:
        tl.debug_barrier()
        tl.atomic_add(ptr, 1, sem="relaxed")
    else:
        tl.debug_barrier()
        tl.atomic_add(ptr, 1, sem="release")


@triton.jit
def _count_done(ctr_ptr, sum_ptr, row, rank, spread, ASM: tl.constexpr, SPREAD: tl.constexpr, WARP: tl.constexpr,
                DEP: tl.constexpr, FENCE: tl.constexpr = 0, BLOCK_K: tl.constexpr = 1024, VEC: tl.constexpr = False):
    """The stage, local-v and spread dependencies: count this program done with the segment at table row `row`
    (local-v-sum: a local V map's partial added into the segment's sum first; VEC, GPU: 4 rows an add)."""
    if DEP == 6 or DEP == 7:
        if tl.load(row + 14) < 0:
            n = tl.load(row + 1).to(tl.int32)
            y_off = tl.load(row + 4)
            if DEP == 7 and VEC:  # 4 rows an add (n and y_off are multiples of 16: the vectors are aligned)
                for c in range(0, n, BLOCK_K):
                    q = c + 4 * tl.arange(0, BLOCK_K // 4)
                    # (1.0 passed as its bits: triton 3.6 refuses a pointer and a float operand together)
                    tl.inline_asm_elementwise(
                        "{ .reg .pred p; .reg .f32 v; mov.b32 v, $3; setp.ne.u32 p, $2, 0; "
                        "@p red.relaxed.gpu.global.add.v4.f32 [$1], {v, v, v, v}; mov.u32 $0, 0; }",
                        "=r,l,r,r", [sum_ptr + y_off + q, (q < n).to(tl.int32),
                                     tl.full((BLOCK_K // 4,), 0x3F800000, tl.int32)],
                        dtype=tl.int32, is_pure=False, pack=1)
            else:
                for c in range(0, n, BLOCK_K):
                    offs = c + tl.arange(0, BLOCK_K)
                    tl.atomic_add(sum_ptr + y_off + offs, tl.full((BLOCK_K,), 1.0, tl.float32), mask=offs < n,
                                  sem="relaxed")
    if DEP == 0 or DEP >= 5:
        _release(ctr_ptr + tl.load(row + 7) * PAD, ASM, WARP, FENCE)
    if DEP == 4:
        _release(ctr_ptr + (spread + tl.load(row + 7) * SPREAD + rank % SPREAD) * PAD, ASM, WARP, FENCE)


@triton.jit
def _tile(w_ptr, w_off, n, k, ld, r, nk, rank, P, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile of step r of a segment (rows of its item, columns of its tile; masked outside)."""
    it = r // nk
    kc = r - it * nk
    offs_n = (rank + it * P) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + w_off + offs_n[:, None].to(tl.int64) * ld + offs_k[None, :],
                   mask=(offs_n < n)[:, None] & (offs_k < k)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _body(seg_ptr, need_ptr, ctr_ptr, tag_ptr, sum_ptr, ep, spread, x_ptr, y_ptr, s, w, n, k, y_off, r, nk, steps,
          rank, P, acc, x1, x2, x3, x4, known, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEP: tl.constexpr,
          ASM: tl.constexpr, SPREAD: tl.constexpr, WARP: tl.constexpr, IN_LOOP: tl.constexpr,
          FENCE: tl.constexpr = 0):
    """Step r of segment s with its weight tile w: the dependency (DEP 0 the segment's stage counter at its first
    step, DEP 5-7 the same for the U maps and o V only; 1 the block of x this tile reads, the first time the program
    reads it in the segment; 2 none; 3 its input's tagged words, read until they carry this pass's epoch ep), the x
    tile, acc += w . x, the item's y stored at its last tile (DEP 1: counted into its block; DEP 3: also written
    tagged, the value the fixed x's at that row, so every variant computes the same y); DEP 0 and 5-7: the
    segment's release after its last step (6, 7: after its partial's adds)."""
    row = seg_ptr + s * 16
    RELS: tl.constexpr = 4 if WARP else 1  # releases a program (or an item) makes
    it = r // nk
    kc = r - it * nk
    item = rank + it * P
    offs_n = item * BLOCK_N + tl.arange(0, BLOCK_N)
    if r == 0:
        known = 0
        if DEP == 0 or DEP >= 5:
            c = tl.load(row + (14 if DEP >= 5 else 5))
            if c >= 0:
                _poll(ctr_ptr + c * PAD, tl.load(row + 6).to(tl.int32) * P * RELS, FENCE, ASM)
        if DEP == 4:
            c = tl.load(row + 5)
            if c >= 0:
                _poll_spread(ctr_ptr + (spread + c * SPREAD) * PAD, tl.load(row + 6).to(tl.int32) * P * RELS,
                             SPREAD)
        t_in = tl.load(row + 11)
        if DEP == 3 and t_in >= 0:  # the producer's tagged words (down U: each of down V's partials validated)
            x1, x2, x3, x4 = _read_tagged(tag_ptr + t_in, k, ep, BLOCK_K)
            stride = tl.load(row + 13)
            for c in range(1, tl.load(row + 12).to(tl.int32)):
                _read_tagged(tag_ptr + t_in + c * stride, k, ep, BLOCK_K)
        elif DEP != 1:  # the whole input, once a segment
            x1 = _read(x_ptr, 0, k, BLOCK_K)
            x2 = _read(x_ptr, 1, k, BLOCK_K)
            x3 = _read(x_ptr, 2, k, BLOCK_K)
            x4 = _read(x_ptr, 3, k, BLOCK_K)
    if DEP == 1:
        if (known >> kc) & 1 == 0:  # first use of this block of x in the segment: wait for its producers
            wb = tl.load(row + 10)
            if wb >= 0:
                _poll(ctr_ptr + (wb + kc) * PAD, tl.load(need_ptr + wb + kc) * RELS, FENCE, ASM)
            xn = _read(x_ptr, kc, k, BLOCK_K)
            x1 = tl.where(kc == 0, xn, x1)
            x2 = tl.where(kc == 1, xn, x2)
            x3 = tl.where(kc == 2, xn, x3)
            x4 = tl.where(kc == 3, xn, x4)
            known = known | (1 << kc)
    xk = tl.where(kc == 0, x1, tl.where(kc == 1, x2, tl.where(kc == 2, x3, x4)))
    acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    last = kc == nk - 1
    if last:
        tl.store(y_ptr + y_off + offs_n, acc, mask=offs_n < n)
        if DEP == 3:
            v = tl.load(x_ptr + offs_n % (4 * BLOCK_K)).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
            tl.store(tag_ptr + y_off + offs_n, (v << 16) | ep, mask=offs_n < n)
        if DEP == 1:
            if item * BLOCK_N < n:  # (a program's masked step has no item to count)
                _release(ctr_ptr + (tl.load(row + 8) + item * BLOCK_N // BLOCK_K) * PAD, ASM, WARP, FENCE)
    if IN_LOOP:  # (the loops kernel counts itself after its loop, as the step does)
        if r == steps - 1:
            _count_done(ctr_ptr, sum_ptr, row, rank, spread, ASM, SPREAD, WARP, DEP, FENCE, BLOCK_K, ASM)
    return tl.where(last, 0.0, acc), x1, x2, x3, x4, known


@triton.jit
def _no_input(BLOCK_K: tl.constexpr):
    """The four register tiles of a segment's input before its first step reads them."""
    z = tl.zeros((BLOCK_K,), dtype=tl.float32)
    return z, z, z, z


@triton.jit
def _loops_kernel(w_ptr, seg_ptr, need_ptr, tot_ptr, x_ptr, y_ptr, ctr_ptr, tag_ptr, sum_ptr, ep_ptr,
                  n_seg, spread,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, DEP: tl.constexpr,
                  ASM: tl.constexpr = False, SPREAD: tl.constexpr = 8, WARP: tl.constexpr = False,
                  FENCE: tl.constexpr = 0):
    """A pipelined loop a segment, as the step's stages: the dependency and the input read inside it (its
    prologue's tiles already asked for, as the step's wait_in_loop)."""
    rank = tl.program_id(0)
    P = tl.num_programs(0)
    ep = tl.load(ep_ptr) & 0xFFFF  # this pass's epoch (the tagged words' low half)
    for s in range(n_seg):
        w_off, n, k, ld, y_off, nk, steps = _params(seg_ptr, s, rank, P, BLOCK_N, BLOCK_K)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        x1, x2, x3, x4 = _no_input(BLOCK_K)
        known = 0
        for r in tl.range(0, steps, num_stages=STAGES):
            w = _tile(w_ptr, w_off, n, k, ld, r, nk, rank, P, BLOCK_N, BLOCK_K)
            acc, x1, x2, x3, x4, known = _body(seg_ptr, need_ptr, ctr_ptr, tag_ptr, sum_ptr, ep, spread, x_ptr,
                                               y_ptr, s, w, n, k, y_off, r, nk, steps, rank, P, acc, x1, x2, x3, x4,
                                               known, BLOCK_N, BLOCK_K, DEP, ASM, SPREAD, WARP, False, FENCE)
        _count_done(ctr_ptr, sum_ptr, seg_ptr + s * 16, rank, spread, False, SPREAD, WARP, DEP, FENCE, BLOCK_K,
                    ASM)


@triton.jit
def _stream_kernel(w_ptr, seg_ptr, need_ptr, tot_ptr, x_ptr, y_ptr, ctr_ptr, tag_ptr, sum_ptr, ep_ptr,
                  n_seg, spread,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, DEP: tl.constexpr,
                   ASM: tl.constexpr = False, SPREAD: tl.constexpr = 8, WARP: tl.constexpr = False,
                   FENCE: tl.constexpr = 0):
    """One pipelined loop over all of this program's steps (tot_ptr[rank] of them): the segment advances inside
    the loop, so the weight tiles run STAGES - 1 steps ahead across segment boundaries."""
    rank = tl.program_id(0)
    P = tl.num_programs(0)
    ep = tl.load(ep_ptr) & 0xFFFF  # this pass's epoch (the tagged words' low half)
    total = tl.load(tot_ptr + rank)
    s = 0
    w_off, n, k, ld, y_off, nk, steps = _params(seg_ptr, 0, rank, P, BLOCK_N, BLOCK_K)
    start = 0
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x1, x2, x3, x4 = _no_input(BLOCK_K)
    known = 0
    for j in tl.range(0, total, num_stages=STAGES):
        if j == start + steps:  # next segment
            s += 1
            start = j
            w_off, n, k, ld, y_off, nk, steps = _params(seg_ptr, s, rank, P, BLOCK_N, BLOCK_K)
        r = j - start
        w = _tile(w_ptr, w_off, n, k, ld, r, nk, rank, P, BLOCK_N, BLOCK_K)
        acc, x1, x2, x3, x4, known = _body(seg_ptr, need_ptr, ctr_ptr, tag_ptr, sum_ptr, ep, spread, x_ptr, y_ptr,
                                           s, w, n, k, y_off, r, nk, steps, rank, P, acc, x1, x2, x3, x4, known,
                                           BLOCK_N, BLOCK_K, DEP, ASM, SPREAD, WARP, True, FENCE)


MODES = ("loops", "stream")


class Chain:
    """The probe's buffers for one shape on one device: weights (random bf16), the fixed input x, y, the segment
    table, each program's step count, and the counters."""

    def __init__(self, shape: ChainShape, programs: int, device: torch.device, seed: int = 0) -> None:
        self.shape, self.programs = shape, programs
        self.table, self.need, n_w, n_y, self.segs = segments(shape, device)
        g = torch.Generator(device=device).manual_seed(seed)
        self.w = torch.randn(n_w, generator=g, device=device, dtype=torch.bfloat16)  # (7.8 GB at the 7B shape)
        # bf16-exact, so the tagged words (bf16 values) carry it unchanged
        self.x = torch.randn(4 * shape.block_k, generator=g, device=device).bfloat16().float()
        self.y = torch.zeros(n_y, dtype=torch.float32, device=device)
        # the stage counters, the blocks' counters, then SPREAD counters a map (the spread dependency)
        self.ctr = torch.zeros((len(self.need) + SPREAD * shape.layers * len(maps(shape))) * PAD.value,
                               dtype=torch.int32, device=device)
        self.tag = torch.zeros(n_y, dtype=torch.int32, device=device)  # the data dependency's tagged outputs
        self.sums = torch.zeros(n_y, dtype=torch.float32, device=device)  # local-v-sum's partial sums, a segment
        self.ep = torch.zeros(1, dtype=torch.int32, device=device)  # its epoch, advanced a pass (as a step's position)
        self.total = torch.tensor([self.steps(rk) for rk in range(programs)], dtype=torch.int32, device=device)
        self.nbytes = n_w * 2
        self.fits: dict = {}  # (mode, depth, dep) -> programs resident at once (GPU, checked at the first run)

    def steps(self, rank: int) -> int:
        """Program rank's steps over all segments (as _params counts them)."""
        s, P, out = self.shape, self.programs, 0
        for _, n, k, _, _ in self.segs:
            items = -(-n // s.block_n)
            out += max(-(-max(items - rank, 0) // P), 1) * -(-k // s.block_k)
        return out

    def run(self, mode: str, stages: int, dep: str, release: str = "cta", fence: str = "both") -> torch.Tensor:
        """One pass: y for every segment (counters zeroed first: one memset, one launch). release: how a program
        counts itself done, "cta" (a CTA barrier, then one add) or "warp" (each warp after a warp barrier; GPU
        only). fence: the counters' memory order (FENCES; the relaxed ones order nothing, which the probe's fixed
        inputs make harmless: they time what the fences cost)."""
        if mode not in MODES or dep not in DEPS or release not in RELEASES or fence not in FENCES:
            raise ValueError(f"chain probe: mode {mode!r} / dependency {dep!r} / release {release!r} / fence "
                             f"{fence!r}: one of {MODES} / {DEPS} / {RELEASES} / {FENCES} wanted")
        if release == "warp" and not self.w.is_cuda:
            raise ValueError("chain probe: the warp release is inline PTX (GPU only)")
        self.ctr.zero_()
        if dep.startswith("local-v-sum"):
            self.sums.zero_()
        self.ep.add_(1)
        kern = _loops_kernel if mode == "loops" else _stream_kernel
        on_gpu = self.w.is_cuda
        args = (self.w, self.table, self.need, self.total, self.x, self.y, self.ctr, self.tag, self.sums, self.ep,
                len(self.segs), len(self.need))
        consts = dict(BLOCK_N=self.shape.block_n, BLOCK_K=self.shape.block_k, STAGES=stages if on_gpu else 1,
                      DEP=DEPS.index(dep), ASM=on_gpu, SPREAD=SPREAD, WARP=release == "warp",
                      FENCE=FENCES.index(fence),
                      num_warps=4 if on_gpu else 1)
        key = (mode, stages, dep, release, fence)
        if on_gpu and dep != "none" and key not in self.fits:  # a program waits on others: all resident at once
            from rankserve.kernels.step_kernel import resident_programs
            k = kern.warmup(*args, grid=(self.programs,), **consts)  # compiled, not run
            k._init_handles()  # loads it: n_regs is known from then on
            sms = torch.cuda.get_device_properties(self.w.device).multi_processor_count
            self.fits[key] = resident_programs(k.n_regs, k.metadata.shared, 4, self.w.device) * sms
            if self.fits[key] < self.programs:
                raise RuntimeError(f"chain probe: {self.programs} programs wanted, {self.fits[key]} fit "
                                   "at once: the waits would deadlock")
        kern[(self.programs,)](*args, **consts)
        return self.y

    def reference(self) -> torch.Tensor:
        """torch's W x for every segment, fp32."""
        ref = torch.empty_like(self.y)
        for w_off, n, k, ld, y_off in self.segs:
            w = self.w[w_off:w_off + (n - 1) * ld + k].float()
            w = torch.as_strided(w, (n, k), (ld, 1))
            ref[y_off:y_off + n] = w @ self.x[:k].float()
        return ref


def check(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error of y against the reference, relative to the largest |ref|."""
    return float((y - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def markdown(res: dict) -> str:
    """The probe's rows as a markdown table: ms of one pass, TB/s and the share of the copy bandwidth."""
    lines = [f"{res['gpu']}, triton {res.get('triton', '?')}, copy bandwidth {res['copy_bw'] / 1e12:.2f} TB/s, "
             f"{res['programs']} programs; one pass over {res['shape']['layers']} layers' GEMV weights "
             f"({res['bytes'] / 1e9:.2f} GB, tiles {res['shape']['block_n']} x {res['shape']['block_k']}"
             + (f", every map's rows rounded up to a multiple of {res['shape']['round_rows']}: the same items for "
                "every program" if res['shape'].get('round_rows') else "")
             + "; graph replays, median; a cell a round)", "",
             "| loop | depth | waits for | ms | TB/s (of copy) |", "| --- | --- | --- | --- | --- |"]

    def key(r: dict) -> tuple:
        return r["mode"], r["stages"], r["dep"], r.get("release", "cta"), r.get("fence", "both")
    keys = list(dict.fromkeys(key(r) for r in res["rows"]))
    said = {"stage": "the previous segment", "blocks": "the blocks of x it reads", "none": "nothing",
            "data": "its input's tagged words", "spread": f"the previous segment, over {SPREAD} counters",
            "local-v": "the previous segment, U maps and o V only (5 hops a layer; a bound)",
            "local-v-sum": "the previous segment, U maps and o V only, the V partials' sums added atomically",
            "local-v-sum4": "the previous segment, U maps and o V only, the V partials' sums added 4 rows an add"}
    fenced = {"relaxed-add": ", relaxed adds (timing only)", "one-acquire": ", relaxed polls and one acquire fence",
              "none": ", no memory order (timing only)"}
    for mode, stages, dep, release, fence in keys:
        rows = [r for r in res["rows"] if key(r) == (mode, stages, dep, release, fence)]
        ms = " / ".join("error" if "error" in r else f"{r['ms']:.3f}" for r in rows)
        bw = " / ".join("error" if "error" in r else f"{r['TB_s']:.2f} ({r['of_copy_bw']:.0%})" for r in rows)
        rel = (" (a count a warp)" if release == "warp" else "") + fenced.get(fence, "")
        lines.append(f"| {'a loop a segment' if mode == 'loops' else 'one loop'} | {stages} | {said[dep]}{rel} | "
                     f"{ms} | {bw} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.chain_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/chain-probe.json")
    ap.add_argument("--rep-ms", type=int, default=200, help="time spent timing each variant (ms)")
    ap.add_argument("--stages", type=int, nargs="+", default=[3], help="pipeline depths to time")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--deps", nargs="+", default=list(DEPS), choices=DEPS,
                    help="what a segment waits for: the previous one (as the step), the blocks of x it reads, nothing, "
                         "tagged data, spread counters, or the previous one for U maps and o V only (local-v; "
                         "local-v-sum(4) with the V partials' atomic sums, 1 or 4 rows an add)")
    ap.add_argument("--releases", nargs="+", default=["cta"], choices=RELEASES,
                    help="how a program counts itself done: a CTA barrier then one add, or one add a warp")
    ap.add_argument("--fences", nargs="+", default=["both"], choices=FENCES,
                    help="the counters' memory order: release adds and acquire polls (the step's), a relaxed add, "
                         "relaxed polls then one acquire fence, or no order at all (relaxed-add and none: timing only)")
    ap.add_argument("--tile", default="8x1024", help="rows x columns of a weight tile (powers of two)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--per-sm", type=int, default=2,
                    help="programs an SM (the step runs 2; 1 leaves a program the shared memory of deeper pipelines)")
    ap.add_argument("--balanced", action="store_true",
                    help="round every map's rows up to a multiple of programs x tile rows (no item imbalance)")
    ap.add_argument("--rounds", type=int, default=2, help="time every variant this many times, interleaved")
    ap.add_argument("--markdown", metavar="JSON", help="render a result JSON as a markdown table and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        import json
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    try:
        bn, bk = (int(v) for v in args.tile.lower().split("x"))
        if bn < 1 or bk < 1 or bn & (bn - 1) or bk & (bk - 1):
            raise ValueError
        shape = ChainShape(layers=args.layers, block_n=bn, block_k=bk)
    except ValueError as e:
        print(f"error: --tile {args.tile!r}: rows x columns, powers of two, 4 tiles covering 4096 ({e})",
              file=sys.stderr)
        return 2
    if args.per_sm < 1:
        print(f"error: --per-sm {args.per_sm}: at least 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench chain_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    from rankserve.bench.decode import copy_bandwidth, write_json
    from rankserve.bench.stream_probe import measure
    dev = torch.device("cuda")
    programs = args.per_sm * torch.cuda.get_device_properties(dev).multi_processor_count  # all resident: checked
    if args.balanced:
        shape.round_rows = programs * shape.block_n
    chain = Chain(shape, programs, dev)
    ref = chain.reference()
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_bw=copy_bandwidth("cuda"), programs=programs, shape=asdict(shape), bytes=chain.nbytes, rows=[])
    print(f"{res['gpu']}: copy {res['copy_bw'] / 1e12:.2f} TB/s, {programs} programs, {chain.nbytes / 1e9:.2f} GB",
          flush=True)
    for rnd in range(args.rounds):
        for mode in args.modes:
            for stages in args.stages:
                for dep, release, fence in [(d, r, f) for d in args.deps for r in args.releases
                                            for f in args.fences]:
                    if (release != "cta" or fence != "both") and dep in ("none", "data"):  # (nothing to count)
                        continue
                    row = dict(mode=mode, stages=stages, dep=dep, release=release, fence=fence, round=rnd,
                               bytes=chain.nbytes)
                    try:
                        def fn(mode=mode, stages=stages, dep=dep, release=release, fence=fence):
                            return chain.run(mode, stages, dep, release, fence)
                        if rnd == 0:
                            chain.y.zero_()
                            row["rel_err"] = check(fn(), ref)
                        measure(row, fn, res["copy_bw"], args.rep_ms)
                    except Exception as e:  # one variant that does not compile must not lose the others
                        row["error"] = repr(e)[-1500:]  # (a compile error says what failed at its end)
                    res["rows"].append(row)
                    print(row, flush=True)
                    write_json(Path(args.out), res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
