"""The whole B = 1 decode step of a fully factorized model in one persistent launch.

The per-kernel step (fast_decode.py: ~9 launches a layer) pays ~3 us of fixed cost per kernel at B = 1 even
with CUDA graphs and programmatic dependent launch: each kernel waits for the previous grid to drain, then for its
own first weight bytes (decode-log.md). Here one launch walks every stage of every layer:

    per layer: Vqkv·norm(x) -> Uq/Uk/Uv + RoPE + K/V into the cache -> attention over each kv head (-> merge of
    the splits) -> Vo a -> x += Uo t -> Vgu·norm(x) -> SiLU(Ug t)·(Uu t) -> Vd m -> x += Ud t;  then the head.

Scheduling. A stage is a list of items (a block of weight rows, a RoPE head chunk, a kv head), dealt to programs by
rank: rank r takes items r, r + P, r + 2P, ... (P programs; ranks drawn from an atomic ticket as programs start). A
program with items in a stage first asks L2 for its first weight tiles, then waits until the previous stage's done
counter reaches P (an acquiring read), then runs one software-pipelined loop over (its items x tiles of K), so the
weight stream stays `stages - 1` tiles ahead through shared memory across item boundaries (the V stages with a
hidden-size input, and o U and down U, read it once into registers and wait at the loop's first step instead: the
loop's prologue copies their first weight tiles into shared memory before the wait); at the end every program, items
or not, adds 1 to the stage's done counter (release). With several attention splits the last split of a kv head to
finish merges the head's partials (a counter per layer and kv head), not a stage. Down V (split_down_v) has no stage
wait: gate/up U deals each program a contiguous run of items and, when done, counts them per column block of down V;
down V's items (a column block x rows) wait for their block's count, so the programs without gate/up U's extra item
stream down V's complete blocks while the others finish, each block's partial stored apart and summed by down U as
it reads them (no atomics: the step is bitwise reproducible run to run). A program may wait on any other's items, so
all P must be resident at once: StepKernel caps P at the compiled kernel's occupancy (registers, shared memory), and
under the CPU interpreter, which runs programs one after the other, P = 1. Other work on the GPU only delays
programs (they start as it drains); a GPU whose SMs are partitioned (MPS limits) could keep some from ever starting:
use the per-kernel step there (DecodeConfig.one_launch=False).

Coherence. Activations (x, t, q, a, m) are rewritten by other programs of the same launch, so they are read
around L1: `.cg` loads, and in the pipelined loops 16-byte `cp.async.cg` copies. Triton issues L1-allocating
`cp.async.ca` for narrower per-thread vectors, which read stale lines (measured: wrong logits with 512-wide bf16
tiles at 4 warps), hence StepKernelConfig's minimum tile widths; tests/test_kernels_ptx.py checks the compiled
kernel has no `cp.async.ca`. Every stage reads what the previous one wrote; a buffer reused by a later stage
(t, a, down V's partials td) is rewritten only after a stage in between completed, so all its readers are done.

Code. Each stage is a function call (`noinline`), not inlined into one ~18K-instruction kernel: the V stages with
the same constants (q/k/v V, gate/up V, the head) share one body, and each stage's code is allocated registers on
its own (146 registers a thread vs ~250). Inlined, code added anywhere slowed every stage: three never-executed
stage copies inside the layer loop took the step from 2.901 to 3.307 ms, wider U steps measured 2.993 inlined vs
2.901 as calls (bench/results/step-trace-h200-s10-{inline,dead,noinline}.json); as calls, 2.888 vs 2.901 ms.

Addressing. Weights are element offsets from one base tensor (an int64 table a layer), so layers may have
different ranks (Dobi-SVD) or shared bases packed per layer (Basis Sharing); ranks and offsets are promised to
the compiler as multiples of 16 (checked at build), without which every weight load is a scalar 2-byte load.

Measured on the H200 (decode-log.md, LLaMA-7B shape, bf16, B = 1, graph replay, greedy argmax in the graph):
svd-llm keep 0.6 2.822 vs 3.222 ms/token for the per-kernel step, dobi 2.943 vs 3.273, basis-sharing 3.308 vs 3.610,
prompt 2048 3.073 vs 3.473 (session 11, decode-h200-s11.json). The V stages read x once and wait inside their
pipelined loop, so its prologue's weight tiles are asked for before the wait (x_once, wait_in_loop); down V goes by
column blocks as gate/up U completes them (split_down_v); o U and down U read their input once into registers and
wait in their loop too (u_once). Fusing each U map with the next V map by row blocks (6 stages a layer instead of 9)
was measured slower (3.40 ms at best) and reverted: a stage's time follows its programs' pipelined steps more than
its barrier (decode-log.md); so were deeper pipelines, 8 warps and asking L2 for later stages' weights ahead. What the
counters cost, measured with them weakened (bench/sync_probe.py; results then wrong): without the release fences
2.740 vs 2.821 ms, without any wait 2.599 (decode-log.md, session 11).
Where the time goes, stage by stage: bench/step_trace.py (StepKernelConfig.trace).
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rankserve.kernels.decode_attention import attend, merge_group

PAD = tl.constexpr(32)  # int32 counters a 128-byte line apart (no false sharing between stages)
# stage slots a layer: qkv V, qkv U, attention, (3: unused; the splits merge inside the attention stage), o V, o U,
# gate/up V, gate/up U, down V, down U
SLOTS = tl.constexpr(10)
META = ("Vqkv", "Uq", "Uk", "Uv", "Vo", "Uo", "Vgu", "Ug", "Uu", "Vd", "Ud")  # offsets, then the 7 ranks


Tile = tuple[int, int]  # (weight rows an item, columns a tile of the reduction)
V_STAGES = ("qkv_v", "o_v", "gate_up_v", "down_v", "head")  # reduce over the hidden / intermediate size (bf16 input)
U_STAGES = ("qkv_u", "o_u", "gate_up_u", "down_u")  # reduce over a rank (fp32 t); qkv_u rows: dims of a half-head
XO_STAGES = ("QKV_V", "O_V", "GATE_UP_V", "HEAD")  # the V stages whose input has the hidden size (x_once)


@dataclass
class StepKernelConfig:
    programs_per_sm: int = 2  # grid = SMs * this, capped at the kernel's occupancy (CPU interpreter: 1 program)
    # item tiles per stage (GPU). A stage takes as long as its busiest program, and a program's pipelined loop
    # costs about the same per step whatever the tile (bench/step_trace.py): tiles of ~16 KB and item counts
    # without a ragged last round. Measured on the H200 (decode-log.md).
    qkv_v: Tile = (2, 4096)
    qkv_u: Tile = (8, 512)
    o_v: Tile = (2, 4096)
    o_u: Tile = (16, 512)
    gate_up_v: Tile = (2, 4096)
    gate_up_u: Tile = (8, 1024)  # two tiles a step (gate and up)
    down_v: Tile = (2, 4096)
    down_u: Tile = (8, 1024)
    head: Tile = (2, 4096)
    # software-pipeline depths (tiles in flight + 1, through shared memory): the V stages but down V, the U stages
    # but gate/up, gate/up U (two tiles a step), down V (input wider than a tile). Deeper is slower on the H200 even
    # where shared memory allows it (V stages 5 / 6 deep: 3.065 / 3.114 ms, U 5 deep 3.069, vs 2.973 at 3;
    # bench/results/step-trace-h200-s9-depth.json)
    stages: int = 3
    u_stages: int = 3
    gu_stages: int = 3
    dv_stages: int = 3
    # V stages whose input fits one tile (K <= its width: all but down V at the 7B shape) read it once a stage into
    # registers instead of once a step through the pipeline's shared memory (measured: 2.989 -> 2.973 ms a step,
    # q/k/v V 308 -> 295 us, o V 152 -> 145, the head 68 -> 63; step-trace-h200-s9-depth.json)
    x_once: bool = True
    # x_once (and u_once) stages wait for the previous stage inside their pipelined loop (at its first step), so the
    # loop's prologue (its first STAGES - 1 weight tiles into shared memory) is issued before the wait, while the
    # previous stage still runs (measured: 2.970 -> 2.948 ms a step, twice in one run, step-trace-h200-s9-wil.json).
    # q/k/v U and gate/up U read their input a tile a step through the same pipeline, which must not start before
    # the wait.
    wait_in_loop: bool = True
    # down V by column blocks of its tile width, started block by block as gate/up U completes them (per-block
    # counters instead of the stage barrier; _down_v_blocks). Measured with atomic adds into one output: 2.950 ->
    # 2.909 ms a step, twice in one run (down V's span 408 -> 365 us; step-trace-h200-s9-splitdv2.json)
    split_down_v: bool = True
    # (split_down_v's column blocks each store their partial of down V's output, summed by down U as it reads them:
    # no atomics, the step bitwise reproducible. Atomic adds into one vector instead were measured slower, 2.898 /
    # 2.903 vs 2.846 / 2.858 ms, step-trace-h200-s10-det.json; removed in session 11)
    # o U and down U read their rank vector once a stage into registers (up to 4 tiles of their width; larger ranks
    # read it a step) and, with wait_in_loop, wait inside their loop as the V stages do, so their first weight tiles
    # are on their way before the wait. Measured (svd-llm 0.6): 2.844 / 2.857 -> 2.831 / 2.834 ms a step, alternated
    # in one run (o U 196 -> 166 us, down U 240 -> 202, o V 106 -> 130: the early tiles compete with its
    # stragglers; step-trace-h200-s10-uonce.json). Session 9's inlined kernel lost with the same change (2.946 ->
    # 2.967): every stage slowed as the code grew (see Code in the module docstring)
    u_once: bool = True
    # (the same for gate/up U and q/k/v U was measured no gain, 2.828 / 2.839 vs 2.831 / 2.834 ms,
    # step-trace-h200-s11-once.json; removed, code in commit 68d6540)
    # GPU: the attention stage asks L2 for its first item's first tile of cached keys and values (att_block_n keys)
    # before its wait (the step's own K/V row excepted). Measured 2-4 us a step faster in each of four runs of session
    # 11 (2.828 vs 2.831 / 2.834, 2.832 vs 2.835 / 2.835, 2.814 vs 2.816 / 2.818, 2.829 vs 2.831 / 2.832 ms;
    # step-trace-h200-s11-*.json). 2 / 3 / 4 tiles: 2.830 / 2.833 / 2.834 vs 2.824 / 2.828 / 2.827 for one
    # (step-trace-h200-s12-attpf.json, code in commit 0ddab14: at prompt 128 each of the 4 splits holds one tile)
    att_prefetch: bool = True
    num_warps: int = 4  # 8 warps measured slower: 3.54 ms at one program an SM, 3.95-4.13 with registers capped for
    # two (spills; step-trace-h200-s9-warps.json)
    # GPU: the first tiles of a program's (items x tiles of K) sequence of a stage asked of L2 before it waits for
    # the previous stage (measured, decode-log.md: 1 tile 3.158 ms vs 2 tiles 3.221 in one run, 2 / 4 / 8 tiles
    # 3.18 / 3.35 / 4.00 in another: asking for more competes with the stage's stragglers)
    prefetch: int = 1
    # GPU: cap on registers a thread (ptxas .maxnreg); None = the compiler's choice (254 for this kernel: 2
    # programs an SM). Lower caps let more programs share an SM at the cost of spills (measured slower).
    maxnreg: int | None = None
    att_block_n: int = 64  # GPU: keys a tile in the attention stage (its tl.dot tiles set the shared memory)
    # diagnostics: every program stamps the global timer (ns) as it reaches each stage, and its SM, into
    # StepKernel.trace (programs x stages + 2); bench/step_trace.py turns the stamps into per-stage span / work / tail
    trace: bool = False

    def __post_init__(self) -> None:
        # activations written in this launch must be read around L1 (cp.async.cg: 16 bytes a thread); narrower
        # tiles make triton fall back to L1-allocating 4/8-byte copies, which read stale lines (measured: wrong logits)
        for name in V_STAGES + U_STAGES:
            rows, width = getattr(self, name)
            least = (256 if name in V_STAGES else 128) * self.num_warps
            if rows < 1 or rows & (rows - 1) or width & (width - 1):
                raise ValueError(f"one-launch {name} tile {rows} x {width}: powers of two wanted")
            if width < least:
                raise ValueError(f"one-launch {name} tile too narrow for {self.num_warps} warps: width >= {least} "
                                 f"needed, got {width}")
        if min(self.stages, self.u_stages, self.gu_stages, self.dv_stages) < 1:
            raise ValueError("one-launch pipeline depths must be >= 1")
        if self.split_down_v and self.down_v[1] % self.gate_up_u[0]:
            raise ValueError(f"split_down_v: gate/up U items of {self.gate_up_u[0]} rows must tile down V's "
                             f"{self.down_v[1]}-column blocks")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 tiles, got {self.prefetch}")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"maxnreg must be in [24, 255] or None, got {self.maxnreg}")

    def constexprs(self, on_gpu: bool, half_head: int) -> dict:
        """The kernel's tile constants: this config on the GPU; small tiles for the CPU interpreter (one program,
        uneven item sizes across stages so the per-stage item counts are exercised)."""
        if on_gpu:
            tiles = {n: getattr(self, n) for n in V_STAGES + U_STAGES}
        else:
            tiles = dict(qkv_v=(16, 64), qkv_u=(16, 64), o_v=(8, 64), o_u=(16, 64), gate_up_v=(16, 64),
                         gate_up_u=(16, 64), down_v=(4, 64), down_u=(8, 64), head=(16, 64))
            if self.u_once:  # 4-wide tiles: the test ranks (<= 16) take several register tiles
                tiles.update(o_u=(16, 4), down_u=(8, 4))
        out = {}
        for n, (rows, width) in tiles.items():
            if n == "qkv_u":  # RoPE chunks: at most half a head's dims
                rows = min(rows, triton.next_power_of_2(half_head))
            out[f"BN_{n.upper()}"], out[f"BK_{n.upper()}"] = rows, width
        return out


@triton.jit
def _wait(ctr_ptr, prev, target, first):
    """Before a program's first item of a stage: spin until stage prev's done counter reaches target (the
    programs, P; 0: wait for nothing), then acquire their writes."""
    if first:
        done_ptr = ctr_ptr + (prev + 1) * PAD
        # an acquiring read (one thread; the add of 0 compiles to ld.acquire.gpu): one L2 round trip a poll
        while tl.atomic_add(done_ptr, 0, sem="acquire") < target:
            pass


@triton.jit
def _leave(ctr_ptr, sid):
    """Count this program done with stage sid (release: its stores are visible to the acquirers). Every program
    counts itself, items or not: a stage is complete when its counter reaches P."""
    tl.debug_barrier()  # every thread's stores issued before the release
    tl.atomic_add(ctr_ptr + (sid + 1) * PAD, 1, sem="release")


@triton.jit
def _l2_prefetch(w_ptr, rank, P, mine, nk, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 TILES: tl.constexpr):
    """Ask L2 for the first TILES tiles (BLOCK_N rows x BLOCK_K columns of w, row-major with K columns) of this
    program's pipelined sequence (its items x tiles of K, _position order), one `prefetch.global.L2` per 128-byte
    line (inline PTX: GPU only). Issued before a stage's wait, so the first tiles come from L2 and a program that
    finished the previous stage early keeps memory busy meanwhile (measured: 3.175 -> 3.122 ms a step, one tile)."""
    for j in tl.static_range(TILES):
        i, kc, _ = _position(j, nk, rank, P)
        offs_n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        _prefetch_tile(w_ptr, offs_n, (offs_n < N) & (j < mine * nk), K, kc * BLOCK_K, BLOCK_K)


@triton.jit
def _prefetch_tile(w_ptr, rows, ok, K, k0, BLOCK_K: tl.constexpr):
    """`prefetch.global.L2` of columns [k0, k0 + BLOCK_K) (clipped to K) of the rows of w (K columns) where ok."""
    STEP: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements a 128-byte line
    cols = tl.minimum(k0 + tl.arange(0, BLOCK_K // STEP) * STEP, tl.maximum(K - STEP, 0))
    ptrs = w_ptr + tl.where(ok, rows, 0)[:, None] * K + cols[None, :]  # masked rows: row 0 again (in L2 by then)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _position(j, nk, rank, P):
    """Step j of a program's pipelined loop over (its items x nk tiles of K): (the item, the tile, whether it is the
    item's last tile)."""
    it = j // nk
    kc = j - it * nk
    return rank + it * P, kc, kc == nk - 1


@triton.jit
def _mine(n, rank, P):
    """How many of a stage's n items are this program's: items rank, rank + P, rank + 2P, ..."""
    return tl.cdiv(tl.maximum(n - rank, 0), P)


@triton.jit(noinline=True)
def _gemv_stage(ctr_ptr, rank, P, sid, prev, target, x_ptr, w_ptr, y_ptr, N, K, eps,
                NORM: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                STAGES: tl.constexpr, PREFETCH: tl.constexpr, X_ONCE: tl.constexpr = False,
                WAIT_IN_LOOP: tl.constexpr = False, PARTS: tl.constexpr = 1, U_TILES: tl.constexpr = 0):
    """y[n] (+)= sum_k w[n, k] x[k] for n < N, BLOCK_N rows an item; RESIDUAL adds into y (each row one owner).
    One software-pipelined loop over (this program's items x tiles of K): the weight stream stays STAGES - 1
    tiles ahead across item boundaries, through shared memory, not registers. x was written by other programs
    of this launch: read from L2 (.cg). PARTS > 1 (not with X_ONCE): x is the sum of PARTS vectors of K, one after
    the other (the column blocks' partials of down V), added as they are read. U_TILES > 0 (K <= U_TILES *
    BLOCK_K <= 4 * BLOCK_K, the U stages): x read once a stage into U_TILES register tiles, a step using its tile's,
    and with WAIT_IN_LOOP the wait inside the loop as for X_ONCE."""
    nk = tl.cdiv(K, BLOCK_K)
    mine = _mine(tl.cdiv(N, BLOCK_N), rank, P)
    EARLY: tl.constexpr = (X_ONCE or U_TILES > 0) and WAIT_IN_LOOP
    if PREFETCH > 0 and not EARLY:
        _l2_prefetch(w_ptr, rank, P, mine, nk, N, K, BLOCK_N, BLOCK_K, PREFETCH)
    if not EARLY:
        _wait(ctr_ptr, prev, target, mine > 0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ss = 0.0
    offs_x = tl.arange(0, BLOCK_K)
    x1 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    inv = 1.0
    x2 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    x3 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    x4 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if X_ONCE and not EARLY:  # K <= BLOCK_K: x read once a stage, outside the pipelined loop (only weights go
        # through shared memory)
        x1, inv = _read_once(x_ptr, offs_x, K, eps, NORM)
    if U_TILES > 0 and not EARLY:
        x1, x2, x3, x4 = _read_tiles(x_ptr, K, PARTS, BLOCK_K, U_TILES)
    for j in tl.range(0, mine * nk, num_stages=STAGES):
        if EARLY:  # the wait inside the loop: the pipeline's prologue (its first weight tiles into shared
            # memory) is issued before it, while the previous stage still runs; x is read after it, once
            if j == 0:
                _wait(ctr_ptr, prev, target, True)
                if U_TILES > 0:
                    x1, x2, x3, x4 = _read_tiles(x_ptr, K, PARTS, BLOCK_K, U_TILES)
                else:
                    x1, inv = _read_once(x_ptr, offs_x, K, eps, NORM)
        i, kc, last = _position(j, nk, rank, P)
        offs_n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mask_k = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0, eviction_policy="evict_first")
        if X_ONCE:
            acc += tl.sum(w.to(tl.float32) * x1[None, :], axis=1)
        elif U_TILES > 0:  # this step's tile of the register-held x
            xk = tl.where(kc == 0, x1, tl.where(kc == 1, x2, tl.where(kc == 2, x3, x4)))
            acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
        else:
            xk = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0, cache_modifier=".cg").to(tl.float32)
            for c in tl.static_range(1, PARTS):
                xk += tl.load(x_ptr + c * K + offs_k, mask=mask_k, other=0.0, cache_modifier=".cg").to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
            if NORM:
                ss += tl.sum(xk * xk, axis=0)
        if last:
            y = acc
            if X_ONCE:
                if NORM:
                    y = y * inv
            elif NORM:
                y = y / tl.sqrt(ss / K + eps)
            if RESIDUAL:  # (asked for at the item's first tile instead: o U 183 -> 194 us,
                # step-trace-h200-s8-early.json)
                y += tl.load(y_ptr + offs_n, mask=mask_n, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)
        acc = tl.where(last, 0.0, acc)
        ss = tl.where(last, 0.0, ss)
    _leave(ctr_ptr, sid)


@triton.jit
def _read_tiles(x_ptr, K, PARTS: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr):
    """x[:K] (from L2: .cg; the sum of PARTS vectors of K one after the other) in fp32 as four tiles of BLOCK_K, the
    first TILES read, the rest zeros."""
    x1 = _read_tile(x_ptr, 0, K, PARTS, BLOCK_K)
    x2 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    x3 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    x4 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if TILES > 1:
        x2 = _read_tile(x_ptr, 1, K, PARTS, BLOCK_K)
    if TILES > 2:
        x3 = _read_tile(x_ptr, 2, K, PARTS, BLOCK_K)
    if TILES > 3:
        x4 = _read_tile(x_ptr, 3, K, PARTS, BLOCK_K)
    return x1, x2, x3, x4


@triton.jit
def _read_tile(x_ptr, kt, K, PARTS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile kt (BLOCK_K wide) of x[:K], the sum of PARTS vectors of K one after the other, fp32, from L2 (.cg)."""
    offs = kt * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    for c in tl.static_range(1, PARTS):
        x += tl.load(x_ptr + c * K + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return x


@triton.jit
def _read_once(x_ptr, offs_x, K, eps, NORM: tl.constexpr):
    """x[:K] (offs_x wide, from L2: .cg) in fp32 and, if NORM, RMSNorm's 1/rms of it (else 1)."""
    x = tl.load(x_ptr + offs_x, mask=offs_x < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    inv = 1.0
    if NORM:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    return x, inv


@triton.jit(noinline=True)
def _gate_up_stage(ctr_ptr, rank, P, sid, prev, target, t_ptr, ug_ptr, uu_ptr, m_ptr, N, rg, ru, blk_ptr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
                   BK_BLK: tl.constexpr = 0):
    """m[n] = silu(Ug[n] . t[:rg]) * (Uu[n] . t[rg:]) for n < N (pipelined as _gemv_stage). BK_BLK > 0: m is read
    by blocks of BK_BLK rows (_down_v_blocks): each program takes a contiguous run of items (the first n mod P programs
    one more) and, after its loop, adds its items of each block to the block's counter (blk_ptr, PAD apart,
    release). Counting inside the loop (a barrier and an atomic at block changes) stopped triton pipelining it."""
    nk = tl.cdiv(tl.maximum(rg, ru), BLOCK_K)
    n = tl.cdiv(N, BLOCK_N)
    if BK_BLK > 0:
        q = n // P
        first = rank * q + tl.minimum(rank, n - q * P)  # this program's items: first .. first + mine - 1
        mine = q + (rank < n - q * P).to(tl.int32)
    else:
        first = rank
        mine = _mine(n, rank, P)
    if PREFETCH > 0 and BK_BLK == 0:
        _l2_prefetch(ug_ptr, rank, P, mine, nk, N, rg, BLOCK_N, BLOCK_K, PREFETCH)
        _l2_prefetch(uu_ptr, rank, P, mine, nk, N, ru, BLOCK_N, BLOCK_K, PREFETCH)
    elif PREFETCH > 0:  # the first tile of the run
        rows = first * BLOCK_N + tl.arange(0, BLOCK_N)
        _prefetch_tile(ug_ptr, rows, (rows < N) & (mine > 0), rg, 0, BLOCK_K)
        _prefetch_tile(uu_ptr, rows, (rows < N) & (mine > 0), ru, 0, BLOCK_K)
    _wait(ctr_ptr, prev, target, mine > 0)
    g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.range(0, mine * nk, num_stages=STAGES):
        if BK_BLK > 0:
            it = j // nk
            kc = j - it * nk
            i = first + it
            last = kc == nk - 1
        else:
            i, kc, last = _position(j, nk, rank, P)
        offs_n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        wg = tl.load(ug_ptr + offs_n[:, None] * rg + offs_k[None, :], mask=mask_n[:, None] & (offs_k < rg)[None, :],
                     other=0.0, eviction_policy="evict_first")
        wu = tl.load(uu_ptr + offs_n[:, None] * ru + offs_k[None, :], mask=mask_n[:, None] & (offs_k < ru)[None, :],
                     other=0.0, eviction_policy="evict_first")
        tg = tl.load(t_ptr + offs_k, mask=offs_k < rg, other=0.0, cache_modifier=".cg")
        tu = tl.load(t_ptr + rg + offs_k, mask=offs_k < ru, other=0.0, cache_modifier=".cg")
        g += tl.sum(wg.to(tl.float32) * tg[None, :], axis=1)
        u += tl.sum(wu.to(tl.float32) * tu[None, :], axis=1)
        if last:
            tl.store(m_ptr + offs_n, (g / (1.0 + tl.exp(-g)) * u).to(m_ptr.dtype.element_ty), mask=mask_n)
        g = tl.where(last, 0.0, g)
        u = tl.where(last, 0.0, u)
    if BK_BLK > 0:
        if mine > 0:
            tl.debug_barrier()  # every thread's m stores issued before the releases
            per: tl.constexpr = BK_BLK // BLOCK_N  # items a block
            for b in range(first // per, (first + mine - 1) // per + 1):
                cnt = tl.minimum(first + mine, (b + 1) * per) - tl.maximum(first, b * per)
                tl.atomic_add(blk_ptr + b * PAD, cnt, sem="release")
    _leave(ctr_ptr, sid)


@triton.jit(noinline=True)
def _down_v_blocks(ctr_ptr, blk_ptr, rank, P, sid, m_ptr, w_ptr, td_ptr, N, K, BN_GU: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """td[c * N + n] = sum_k w[n, k] m[k] over the columns k of block c (BLOCK_K of them), for n < N, by items
    (block c, BLOCK_N rows), one step an item: each block's partial stored apart, summed by down U as it reads them
    (each item has one owner: plain stores, no atomics, the sum's order fixed). No stage wait:
    before its first item of block c a program waits until gate/up U's items of that block are all counted
    (blk_ptr[c * PAD], acquire), so a program done with gate/up U works on the blocks already complete while the
    stage's stragglers finish the last one; the pipelined weight stream runs ahead across those waits. Blocks are
    visited from the second on (block 0, where gate/up U's programs with an extra item work, last) and items dealt
    from the last rank down, so those programs (the first ranks) are the last to get an extra one here."""
    nr = tl.cdiv(N, BLOCK_N)
    nb = tl.cdiv(K, BLOCK_K)
    me = P - 1 - rank
    mine = _mine(nb * nr, me, P)
    offs_x = tl.arange(0, BLOCK_K)
    x1 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    cur = -1
    for j in tl.range(0, mine, num_stages=STAGES):
        k = me + j * P
        c = k // nr
        rb = k - c * nr
        c = (c + 1) % nb  # block 0 last: gate/up U's programs with an extra item all work in it
        if c != cur:
            need = tl.cdiv(tl.minimum(BLOCK_K, K - c * BLOCK_K), BN_GU)
            while tl.atomic_add(blk_ptr + c * PAD, 0, sem="acquire") < need:
                pass
            offs = c * BLOCK_K + offs_x
            x1 = tl.load(m_ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg").to(tl.float32)
            cur = c
        offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = c * BLOCK_K + offs_x
        mask_n = offs_n < N
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :],
                    other=0.0, eviction_policy="evict_first")
        tl.store(td_ptr + c * N + offs_n, tl.sum(w.to(tl.float32) * x1[None, :], axis=1), mask=mask_n)
    _leave(ctr_ptr, sid)


@triton.jit(noinline=True)
def _qkv_u_stage(ctr_ptr, rank, P, sid, prev, target, t_ptr, w_ptr, off_q, off_k, off_v, rq, rk, rv,
                 cos_ptr, sin_ptr, pos, q_ptr, kc_ptr, vc_ptr, stride_ks, stride_kh,
                 H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    """Item (head p of q|k|v, chunk of BLOCK_D dims of each half): rows (d, d + HALF) of that head from its U and
    its slice of t, RoPE on q and k at position pos, q stored, k and v written into the cache at pos (kc/vc: this
    layer's, row 0). Pipelined as _gemv_stage over the largest of the three ranks (masked beyond each's own)."""
    NC: tl.constexpr = (HALF + BLOCK_D - 1) // BLOCK_D
    nk = tl.cdiv(tl.maximum(tl.maximum(rq, rk), rv), BLOCK_K)
    mine = _mine((H + 2 * HKV) * NC, rank, P)
    for j in tl.static_range(PREFETCH):
        i, kc, _ = _position(j, nk, rank, P)
        u_ptr, r, t_off, head, offs_d, p = _qkv_item(i, w_ptr, off_q, off_k, off_v, rq, rk, rv, H, HKV, BLOCK_D, NC)
        rows = head * (2 * HALF) + offs_d
        ok = (offs_d < HALF) & (j < mine * nk)
        _prefetch_tile(u_ptr, rows, ok, r, kc * BLOCK_K, BLOCK_K)
        _prefetch_tile(u_ptr, rows + HALF, ok, r, kc * BLOCK_K, BLOCK_K)
    _wait(ctr_ptr, prev, target, mine > 0)
    y1 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    y2 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    cos = tl.zeros((BLOCK_D,), dtype=tl.float32)
    sin = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.range(0, mine * nk, num_stages=STAGES):
        i, kc, last = _position(j, nk, rank, P)
        u_ptr, r, t_off, head, offs_d, p = _qkv_item(i, w_ptr, off_q, off_k, off_v, rq, rk, rv, H, HKV, BLOCK_D, NC)
        rows = head * (2 * HALF) + offs_d  # dims d of the head; their RoPE partners are rows + HALF
        mask_d = offs_d < HALF
        if kc == 0:  # asked for at the item's first tile, used after its last (the round trip overlaps the tiles;
            # measured twice against the kernel without it: q/k/v U 400 -> 386 us, the step 2.998 -> 2.985 ms,
            # bench/results/step-trace-h200-s8-cos*.json vs -base-c*.json)
            cos = tl.load(cos_ptr + pos * HALF + offs_d, mask=mask_d, other=1.0)
            sin = tl.load(sin_ptr + pos * HALF + offs_d, mask=mask_d, other=0.0)
        offs_k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < r
        mask_w = mask_d[:, None] & mask_k[None, :]
        w1 = tl.load(u_ptr + rows[:, None] * r + offs_k[None, :], mask=mask_w, other=0.0, eviction_policy="evict_first")
        w2 = tl.load(u_ptr + (rows + HALF)[:, None] * r + offs_k[None, :], mask=mask_w, other=0.0,
                     eviction_policy="evict_first")
        tk = tl.load(t_ptr + t_off + offs_k, mask=mask_k, other=0.0, cache_modifier=".cg")
        y1 += tl.sum(w1.to(tl.float32) * tk[None, :], axis=1)  # dims d
        y2 += tl.sum(w2.to(tl.float32) * tk[None, :], axis=1)  # dims d + HALF
        if last:
            is_v = p >= H + HKV
            o1 = tl.where(is_v, y1, y1 * cos - y2 * sin)
            o2 = tl.where(is_v, y2, y2 * cos + y1 * sin)
            seg = p + tl.zeros((BLOCK_D,), dtype=tl.int32)  # full-tensor masks (block & scalar bool: interpreter)
            mask_q = mask_d & (seg < H)
            mask_kc = mask_d & (seg >= H) & (seg < H + HKV)
            mask_v = mask_d & (seg >= H + HKV)
            tl.store(q_ptr + rows, o1.to(q_ptr.dtype.element_ty), mask=mask_q)
            tl.store(q_ptr + rows + HALF, o2.to(q_ptr.dtype.element_ty), mask=mask_q)
            c_off = pos.to(tl.int64) * stride_ks + head * stride_kh + offs_d
            tl.store(kc_ptr + c_off, o1.to(kc_ptr.dtype.element_ty), mask=mask_kc)
            tl.store(kc_ptr + c_off + HALF, o2.to(kc_ptr.dtype.element_ty), mask=mask_kc)
            tl.store(vc_ptr + c_off, o1.to(vc_ptr.dtype.element_ty), mask=mask_v)
            tl.store(vc_ptr + c_off + HALF, o2.to(vc_ptr.dtype.element_ty), mask=mask_v)
        y1 = tl.where(last, 0.0, y1)
        y2 = tl.where(last, 0.0, y2)
    _leave(ctr_ptr, sid)


@triton.jit
def _qkv_item(i, w_ptr, off_q, off_k, off_v, rq, rk, rv, H: tl.constexpr, HKV: tl.constexpr, BLOCK_D: tl.constexpr,
              NC: tl.constexpr):
    """Item i of the q/k/v U stage (NC chunks a half-head): its U, rank, offset into t, head, the chunk's dims d of
    the half-head and part p (q heads, then k, then v)."""
    p = i // NC
    is_q = p < H
    is_k = (p >= H) & (p < H + HKV)
    head = tl.where(is_q, p, tl.where(is_k, p - H, p - H - HKV))
    r = tl.where(is_q, rq, tl.where(is_k, rk, rv))
    u_ptr = w_ptr + tl.where(is_q, off_q, tl.where(is_k, off_k, off_v))
    t_off = tl.where(is_q, 0, tl.where(is_k, rq, rq + rk))
    return u_ptr, r, t_off, head, (i % NC) * BLOCK_D + tl.arange(0, BLOCK_D), p


@triton.jit(noinline=True)
def _attention_stage(ctr_ptr, rank, P, sid, prev, target, q_ptr, kc_ptr, vc_ptr, stride_ks, stride_kh, seqlen,
                     a_ptr, mid_o_ptr, mid_lse_ptr, head_ctr_ptr, qk_scale, G: tl.constexpr, HKV: tl.constexpr,
                     D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                     NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
                     PREFETCH: tl.constexpr = False):
    """Item (kv head hk, split): its query heads over the split's keys; one split writes a (H, D) directly,
    several write partials mid_o (H, NUM_SPLITS, D) fp32 and mid_lse (H, NUM_SPLITS), and the last of a kv head's
    splits to finish (a per-head counter, head_ctr_ptr[hk]) merges them into a: no merge stage (measured on the
    H200 against one: 3.036 -> 3.000 ms a step, bench/results/step-trace-h200-s7b.json). PREFETCH (GPU): the first
    item's first BLOCK_N keys and values already in the cache (all but the current token's, which q/k/v U writes)
    asked of L2 before the wait."""
    i = rank
    split_len = tl.cdiv(tl.cdiv(seqlen, NUM_SPLITS), BLOCK_N) * BLOCK_N
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < D
    if PREFETCH:
        if i < HKV * NUM_SPLITS:
            keys = (i % NUM_SPLITS) * split_len + tl.arange(0, BLOCK_N)
            ok = keys < seqlen - 1
            _prefetch_tile(kc_ptr + (i // NUM_SPLITS) * stride_kh, keys, ok, stride_ks, 0, D_PAD)
            _prefetch_tile(vc_ptr + (i // NUM_SPLITS) * stride_kh, keys, ok, stride_ks, 0, D_PAD)
    _wait(ctr_ptr, prev, target, i < HKV * NUM_SPLITS)
    while i < HKV * NUM_SPLITS:
        hk = i // NUM_SPLITS
        split = i % NUM_SPLITS
        offs_g = tl.arange(0, BLOCK_H)
        mask_g = offs_g < G
        offs_h = hk * G + offs_g  # (BLOCK_H,) query heads of this kv head
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
            tl.debug_barrier()  # this item's partial stores issued before the counter's release
            if tl.atomic_add(head_ctr_ptr + hk, 1, sem="acq_rel") == NUM_SPLITS - 1:
                out = merge_group(mid_o_ptr, mid_lse_ptr, NUM_SPLITS * D, D, NUM_SPLITS, offs_h, mask_g, offs_d, mask_d,
                                  BLOCK_H, D_PAD, NUM_SPLITS, SPLITS_PAD)
                tl.store(a_ptr + offs_h[:, None] * D + offs_d[None, :], out.to(a_ptr.dtype.element_ty), mask=mask)
        i += P
    _leave(ctr_ptr, sid)


@triton.jit
def _stamp(trace_ptr, rank, s, NS, TRACE: tl.constexpr):
    """Diagnostics (TRACE): the global timer (ns) when program rank reaches stage s, at trace[rank, s] (rows of
    NS + 2: the stamps, then the program's SM)."""
    if TRACE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [rank], dtype=tl.int64, is_pure=False,
                                      pack=1)
        tl.store(trace_ptr + rank * (NS + 2) + s, t)


@triton.jit
def _stamp_sm(trace_ptr, rank, NS, TRACE: tl.constexpr):
    """Diagnostics (TRACE): the SM program rank runs on, at trace[rank, NS + 1]."""
    if TRACE:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [rank], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(trace_ptr + rank * (NS + 2) + NS + 1, sm.to(tl.int64))


@triton.jit
def _offset(mp, j, IN_L2: tl.constexpr = False):
    """Element offset from the base of weight j (META order) of the layer whose table row is at mp. Offsets and ranks
    are multiples of 16 (StepKernel checks): promised to the compiler, or every weight load is a scalar 2-byte load
    (measured: the whole step then streamed at ~1.3 TB/s). IN_L2: read with evict_last, so the table stays in L2 across
    steps while the weights stream through with evict_first (the B > 1 step: 0.6 % a step at B = 8, session 29)."""
    if IN_L2:
        v = tl.load(mp + j, eviction_policy="evict_last")
    else:
        v = tl.load(mp + j)
    return tl.multiple_of(v, 16)


@triton.jit
def _weight(w_ptr, mp, j, IN_L2: tl.constexpr = False):
    return w_ptr + _offset(mp, j, IN_L2)


@triton.jit
def _rank(mp, j, IN_L2: tl.constexpr = False):
    return tl.multiple_of(_offset(mp, j, IN_L2).to(tl.int32), 16)


@triton.jit
def _step_kernel(w_ptr, meta_ptr, head_ptr, x_ptr, t_ptr, q_ptr, a_ptr, m_ptr, logits_ptr, kc_ptr, vc_ptr,
                 seqlens_ptr, cos_ptr, sin_ptr, mid_o_ptr, mid_lse_ptr, ctr_ptr, trace_ptr, td_ptr,
                 L, hidden, inter, vocab, stride_kl, stride_ks, stride_kh, eps, qk_scale, blk_off,
                 H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, D_PAD: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                 ATT_BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                 BN_QKV_V: tl.constexpr, BK_QKV_V: tl.constexpr, BN_QKV_U: tl.constexpr, BK_QKV_U: tl.constexpr,
                 BN_O_V: tl.constexpr, BK_O_V: tl.constexpr, BN_O_U: tl.constexpr, BK_O_U: tl.constexpr,
                 BN_GATE_UP_V: tl.constexpr, BK_GATE_UP_V: tl.constexpr, BN_GATE_UP_U: tl.constexpr,
                 BK_GATE_UP_U: tl.constexpr, BN_DOWN_V: tl.constexpr, BK_DOWN_V: tl.constexpr,
                 BN_DOWN_U: tl.constexpr, BK_DOWN_U: tl.constexpr, BN_HEAD: tl.constexpr, BK_HEAD: tl.constexpr,
                 STAGES: tl.constexpr, STAGES_U: tl.constexpr, STAGES_GU: tl.constexpr, STAGES_DV: tl.constexpr,
                 XO_HIDDEN: tl.constexpr, WIL: tl.constexpr,
                 XO_INTER: tl.constexpr, SPLIT_DV: tl.constexpr, DU_PARTS: tl.constexpr,
                 UT_O: tl.constexpr, UT_D: tl.constexpr,
                 PREFETCH_ATT: tl.constexpr,
                 PREFETCH: tl.constexpr, TRACE: tl.constexpr):
    D: tl.constexpr = 2 * HALF
    NS = L * SLOTS + 1  # stages: SLOTS a layer, then the head
    P = tl.num_programs(0)
    rank = tl.atomic_add(ctr_ptr, 1, sem="relaxed")  # items by arrival order (see StepKernel: all P are resident)
    pos = tl.load(seqlens_ptr)  # the current token's position (row 0)
    _stamp_sm(trace_ptr, rank, NS, TRACE)
    for layer in range(L):
        mp = meta_ptr + layer * 18
        rq, rk, rv = _rank(mp, 11), _rank(mp, 12), _rank(mp, 13)
        ro, rg, ru, rd = _rank(mp, 14), _rank(mp, 15), _rank(mp, 16), _rank(mp, 17)
        s0 = layer * SLOTS
        lay = tl.cast(layer, tl.int64)  # a layer of a long cache is > 2^31 elements in
        kc = kc_ptr + lay * stride_kl
        vc = vc_ptr + lay * stride_kl
        # x (normed, the norm weight folded into Vqkv) -> t = Vqkv x; layer 0 waits for nothing
        _stamp(trace_ptr, rank, s0, NS, TRACE)
        _gemv_stage(ctr_ptr, rank, P, s0, tl.maximum(s0 - 1, 0), tl.where(layer == 0, 0, P), x_ptr,
                    _weight(w_ptr, mp, 0), t_ptr, rq + rk + rv, hidden, eps, True, False, BN_QKV_V, BK_QKV_V,
                    STAGES, PREFETCH, XO_HIDDEN, WIL)
        _stamp(trace_ptr, rank, s0 + 1, NS, TRACE)
        _qkv_u_stage(ctr_ptr, rank, P, s0 + 1, s0, P, t_ptr, w_ptr, _offset(mp, 1), _offset(mp, 2), _offset(mp, 3),
                     rq, rk, rv, cos_ptr, sin_ptr, pos, q_ptr, kc, vc, stride_ks, stride_kh, H, HKV, HALF, BN_QKV_U,
                     BK_QKV_U, STAGES_U, PREFETCH)
        blk = ctr_ptr + blk_off + layer * tl.cdiv(inter, BK_DOWN_V) * PAD  # this layer's down V block counters
        _stamp(trace_ptr, rank, s0 + 2, NS, TRACE)
        _attention_stage(ctr_ptr, rank, P, s0 + 2, s0 + 1, P, q_ptr, kc, vc, stride_ks, stride_kh, pos + 1, a_ptr,
                         mid_o_ptr, mid_lse_ptr, ctr_ptr + (L * SLOTS + 2) * PAD + layer * HKV, qk_scale, H // HKV,
                         HKV, D, D_PAD, BLOCK_H, ATT_BLOCK_N, NUM_SPLITS, SPLITS_PAD, DOT_PREC, PREFETCH_ATT)
        _stamp(trace_ptr, rank, s0 + 4, NS, TRACE)
        _gemv_stage(ctr_ptr, rank, P, s0 + 4, s0 + 2, P, a_ptr, _weight(w_ptr, mp, 4), t_ptr, ro, H * D, eps, False,
                    False, BN_O_V, BK_O_V, STAGES, PREFETCH, XO_HIDDEN, WIL)
        _stamp(trace_ptr, rank, s0 + 5, NS, TRACE)
        _gemv_stage(ctr_ptr, rank, P, s0 + 5, s0 + 4, P, t_ptr, _weight(w_ptr, mp, 5), x_ptr, hidden, ro, eps, False,
                    True, BN_O_U, BK_O_U, STAGES_U, PREFETCH, WAIT_IN_LOOP=WIL, U_TILES=UT_O)
        _stamp(trace_ptr, rank, s0 + 6, NS, TRACE)
        _gemv_stage(ctr_ptr, rank, P, s0 + 6, s0 + 5, P, x_ptr, _weight(w_ptr, mp, 6), t_ptr, rg + ru, hidden, eps,
                    True, False, BN_GATE_UP_V, BK_GATE_UP_V, STAGES, PREFETCH, XO_HIDDEN, WIL)
        _stamp(trace_ptr, rank, s0 + 7, NS, TRACE)
        _gate_up_stage(ctr_ptr, rank, P, s0 + 7, s0 + 6, P, t_ptr, _weight(w_ptr, mp, 7), _weight(w_ptr, mp, 8), m_ptr,
                       inter, rg, ru, blk, BN_GATE_UP_U, BK_GATE_UP_U, STAGES_GU, PREFETCH,
                       BK_DOWN_V if SPLIT_DV else 0)
        _stamp(trace_ptr, rank, s0 + 8, NS, TRACE)
        if SPLIT_DV:
            _down_v_blocks(ctr_ptr, blk, rank, P, s0 + 8, m_ptr, _weight(w_ptr, mp, 9), td_ptr, rd, inter, BN_GATE_UP_U,
                           BN_DOWN_V, BK_DOWN_V, STAGES_DV)
            td = td_ptr
        else:
            _gemv_stage(ctr_ptr, rank, P, s0 + 8, s0 + 7, P, m_ptr, _weight(w_ptr, mp, 9), t_ptr, rd, inter, eps, False,
                        False, BN_DOWN_V, BK_DOWN_V, STAGES_DV, PREFETCH, XO_INTER)
            td = t_ptr
        _stamp(trace_ptr, rank, s0 + 9, NS, TRACE)
        _gemv_stage(ctr_ptr, rank, P, s0 + 9, s0 + 8, P, td, _weight(w_ptr, mp, 10), x_ptr, hidden, rd, eps, False,
                    True, BN_DOWN_U, BK_DOWN_U, STAGES_U, PREFETCH, WAIT_IN_LOOP=WIL, PARTS=DU_PARTS, U_TILES=UT_D)
    # final norm (folded into the head's columns) + LM head, fp32 logits
    _stamp(trace_ptr, rank, NS - 1, NS, TRACE)
    _gemv_stage(ctr_ptr, rank, P, NS - 1, NS - 2, P, x_ptr, head_ptr, logits_ptr, vocab, hidden, eps, True, False,
                BN_HEAD, BK_HEAD, STAGES, PREFETCH, XO_HIDDEN, WIL)
    _stamp(trace_ptr, rank, NS, NS, TRACE)


class StepKernel:
    """The one-launch B = 1 step over a FastDecoder's packed layers and buffers (see the module docstring).

    layers: fast_decode._Layer list, every layer factorized with the norms folded (fuse_norm). Weights must share
    one dtype and be row-major. The buffers (x, t, q, a, m, logits, caches, cos/sin, mid_o/mid_lse) are the
    decoder's own, plus td (down V's fp32 partials with split_down_v) and the counters;
    `run()` adds one memset (the counters) and one launch, no host sync or allocation.
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
            ws, ranks = layer_weights(L)
            for name, w in zip(META, ws):
                if w.dtype != dt or not w.is_contiguous():
                    raise ValueError(f"the one-launch step wants contiguous {dt} weights; {name} is {w.dtype}")
            if dev.type == "cuda":  # the kernel promises the compiler 16-element alignment (vectorized loads)
                check_aligned(ws, ranks)
            offs = [(w.data_ptr() - base.data_ptr()) // es for w in ws]
            rows.append(offs + ranks)
        self.meta = torch.tensor(rows, dtype=torch.int64, device=dev)  # (L, 18)
        self.base, self.head_n, self.b, self.cfg = base, head_n, bufs, cfg
        self.num_splits = num_splits
        # counter 0: rank tickets; then one done counter per stage, PAD apart; then a merge counter per (layer, kv
        # head); then (split_down_v) a counter per (layer, down V column block), PAD apart
        merge_end = (len(layers) * SLOTS + 2) * PAD + len(layers) * cfg.num_key_value_heads
        self.blk_off = -(-merge_end // PAD) * PAD
        self.on_gpu = dev.type == "cuda"
        k = self.kcfg
        tiles = k.constexprs(self.on_gpu, cfg.head_dim // 2)  # the kernel's tile constants
        n_dv = -(-cfg.intermediate_size // tiles["BK_DOWN_V"])  # down V's column blocks
        n_blk = len(layers) * n_dv if k.split_down_v else 0
        self.ctr = torch.zeros(self.blk_off + n_blk * PAD, dtype=torch.int32, device=dev)
        # split_down_v: down V's output (the largest rank of the layers), fp32: a partial a column block, summed by
        # down U as it reads them
        self.du_parts = n_dv if k.split_down_v else 1
        self.td = torch.zeros(self.du_parts * max(max(r[17] for r in rows), 16), dtype=torch.float32, device=dev)
        # o U and down U reading their input once (u_once): register tiles of the stage's width that the largest rank
        # of its input takes, over the layers; 0 = read a tile a step (off, or more tiles than held)
        self.reg_tiles = dict(UT_O=register_tiles(max(r[14] for r in rows), tiles["BK_O_U"], k.u_once, 4),
                              UT_D=register_tiles(max(r[17] for r in rows), tiles["BK_DOWN_U"], k.u_once, 4))
        # the launch's constants, fixed for the decoder's life (its buffers and shapes do not change)
        H, HKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        gpu = self.on_gpu
        self.consts = dict(
            H=H, HKV=HKV, HALF=D // 2, D_PAD=triton.next_power_of_2(D), NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_H=max(16, triton.next_power_of_2(H // HKV)),
            ATT_BLOCK_N=k.att_block_n if gpu else 16,
            DOT_PREC="ieee" if bufs["k_cache"].dtype == torch.float32 else "tf32",
            **tiles, STAGES=k.stages if gpu else 1, STAGES_U=k.u_stages if gpu else 1,
            STAGES_GU=k.gu_stages if gpu else 1, STAGES_DV=k.dv_stages if gpu else 1,
            XO_HIDDEN=k.x_once and max(cfg.hidden_size, H * D) <= min(tiles[f"BK_{n}"] for n in XO_STAGES),
            XO_INTER=k.x_once and cfg.intermediate_size <= tiles["BK_DOWN_V"], WIL=k.wait_in_loop,
            SPLIT_DV=k.split_down_v, DU_PARTS=self.du_parts, **self.reg_tiles,
            PREFETCH_ATT=k.att_prefetch and gpu, PREFETCH=k.prefetch if gpu else 0, TRACE=k.trace and gpu,
            num_warps=k.num_warps if gpu else 1, **({"maxnreg": k.maxnreg} if gpu and k.maxnreg else {}))
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if self.on_gpu else 1
        # one program an SM until the compiled kernel's occupancy is known (the first run); the interpreter runs
        # programs one after the other, so there a single program does every item
        self.grid = (self.sms,)
        self.resident: int | None = None
        n_stages = len(layers) * SLOTS + 1
        # (programs, stages + 1) stamps and each program's SM, sized for the most programs an SM could hold (32);
        # untraced, the kernel never touches it and gets the counters as a placeholder pointer
        self.trace = (torch.zeros(self.sms * 32, n_stages + 2, dtype=torch.int64, device=dev)
                      if self.kcfg.trace else self.ctr)

    def run(self) -> None:
        cfg, b, k = self.cfg, self.b, self.kcfg
        kc, vc = b["k_cache"], b["v_cache"]  # (L, 1, S_max, H_kv, D)
        self.ctr.zero_()
        kernel = _step_kernel[self.grid](
            self.base, self.meta, self.head_n, b["x"], b["t"], b["q"], b["a"], b["m"], b["logits"], kc, vc,
            b["seqlens"], b["cos"], b["sin"], b["mid_o"], b["mid_lse"], self.ctr, self.trace, self.td,
            len(self.meta), cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
            kc.stride(0), kc.stride(2), kc.stride(3), float(cfg.rms_norm_eps),
            math.log2(math.e) / math.sqrt(cfg.head_dim), self.blk_off, **self.consts)
        if self.on_gpu and self.resident is None:
            # items are dealt to programs statically, so a program may wait on any other's items: every program
            # must be resident at once. Cap the grid at what fits (registers, shared memory, warps per SM).
            self.resident = resident_programs(kernel.n_regs, kernel.metadata.shared, k.num_warps, kc.device)
            self.grid = (self.sms * min(k.programs_per_sm, self.resident),)


def register_tiles(rank: int, width: int, on: bool, most: int) -> int:
    """Tiles of `width` a rank-`rank` input takes when held in registers: 0 when off or more than `most`."""
    n = -(-rank // width)
    return n if on and n <= most else 0


def layer_weights(L) -> tuple[list[torch.Tensor], list[int]]:
    """A packed layer's (fast_decode._Layer) weights in META order and its 7 ranks (q, k, v, o, gate, up, down)."""
    ws = [L.Vqkv, L.Uq, L.Uk, L.Uv, L.proj["o"].V, L.proj["o"].U, L.Vgu, L.Ug, L.Uu, L.proj["down"].V,
          L.proj["down"].U]
    return ws, [*L.qkv_split, L.proj["o"].rank, *L.gu_split, L.proj["down"].rank]


def check_aligned(ws: list[torch.Tensor], ranks: list[int]) -> None:
    """The one-launch kernel reads weights with 16-byte vector loads: every rank a multiple of 16 and every weight
    32-byte aligned (the engine pads ranks to 16 on the GPU: workers/align.py)."""
    bad = [r for r in ranks if r % 16]
    if bad:
        raise ValueError(f"one-launch step: ranks {bad} are not multiples of 16; pad them (workers/align.py) or "
                         "use the per-kernel step (one_launch=False)")
    if any(w.data_ptr() % 32 for w in ws):
        raise ValueError("one-launch step: a weight is not 32-byte aligned; use the per-kernel step")


def resident_programs(n_regs: int, shared: int, num_warps: int, device: torch.device) -> int:
    """Programs of a kernel that fit on one SM at once (CUDA occupancy: registers, shared memory, threads)."""
    p = torch.cuda.get_device_properties(device)
    regs_per_warp = -(-n_regs * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = (65536 // regs_per_warp) // num_warps  # 64 K registers an SM on every CUDA GPU since Kepler
    by_smem = p.shared_memory_per_multiprocessor // (shared + 1024) if shared else 32  # 1 KB reserved a block
    by_threads = p.max_threads_per_multi_processor // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))
