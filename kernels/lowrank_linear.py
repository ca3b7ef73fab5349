"""Decode-time low-rank projection y = U (V x) for a few rows of x (B <= 8).

Two launches of one memory-bound GEMV kernel: t = x Vᵀ into an fp32 scratch, then y = t Uᵀ. Every weight
byte is read once; t (B * r * 4 bytes) is re-read from L2 by every program of the second launch.
Each program owns BLOCK_N rows of the weight and walks the whole reduction dimension, so no split-K
scratch and no atomics are needed: at LLaMA-7B shapes (r ~ 1.2k-2.4k, out 4096/11008) BLOCK_N = 4 already
gives 300-2750 programs, several per SM.

Measured on an H200 (triton 3.6, bf16, keep 0.6, CUDA-graph replay, cold L2; copy bandwidth 4.23 TB/s):
  o-proj 4096 -> r 1228 -> 4096:   B=1 16.1 us (torch two GEMVs 19.5, dense 4096x4096 19.1); B=8 26.4 (torch 30.5)
  down 11008 -> r 1791 -> 4096:    B=1 24.8 us (torch 33.9, dense 36.9); B=8 42.6 (torch 71.2)
A 10 MB GEMV is mostly fixed cost (~1.2 TB/s); the big U stages reach ~2.1-2.5 TB/s.

Inner product, picked by B at compile time:
  B == 1   CUDA cores, a (BLOCK_N, BLOCK_K) fp32 accumulator reduced over K once after the loop;
  B  > 1   tensor cores, x zero-padded to 16 rows, tl.dot with a pipelined (num_stages) weight stream.
Alternatives measured (bench/kernels_gpu.py --only gemv_sweep, H200):
  - B > 1 on CUDA cores (x broadcast against the weight tile, reduced over K every iteration): 3-4x slower
    than this at B = 4..8 (122 vs 26 us for the o-proj at B=8): FMA and shuffle work per weight byte grows with B;
  - tl.dot at B = 1 needs BLOCK_N >= 16, leaving ~80 programs for the V stage;
  - one fused launch splitting r (each program: t_chunk = V_chunk x, then atomically y += U[:, chunk] t_chunk):
    saves a launch but needs a zeroed fp32 y, an extra cast and out * r / chunk fp32 atomics.

Split-K (B > 1): a program owns 16-32 rows there, so few-row V stages (o: 1232 rows -> 77 programs) leave SMs
idle; `split` lets several programs share a row block, each adding one chunk of the reduction into a zeroed fp32
t with atomics (the decoder zeroes all split stages' scratch once per step). One program per SM: B = 8 4.21 ->
4.17 ms/token; two per SM was slower (decode-log.md).

Pipelining: at B = 1 the K loop is a `tl.range` with num_stages = STAGES (weight tiles through shared memory,
cp.async); the decoder runs 2 at B = 1 (3.259 vs 3.458 ms/token for the whole step, decode-log.md). PARSE slots:
`keep` masks skip dead row blocks and `klive` bounds the K loop by a live width read on the device.

Fusions the decoder uses (workers/fast_decode.py):
  - NORM: the RMSNorm before q/k/v, gate/up and the LM head rides in the GEMV that reads the residual stream:
    the norm weight is folded into w's columns at load time and every program already walks the whole row,
    so it accumulates the sum of squares on the way and scales its outputs at the end (no norm kernel);
  - RESIDUAL: the o and down projections add into the residual stream in their epilogue (no add kernel);
  - PDL (Hopper+): every kernel is launched with programmatic dependent launch, signals its dependents as it
    starts and loads its first weight tile before `griddepcontrol.wait`, so one kernel's launch and weight
    stream overlap the previous kernel's tail.

`_gemv_tile` is shared with qkv_rope.py and gate_up.py (their second stage is this GEMV with a fused epilogue).
"""

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper+): triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_PDL = True
except ImportError:  # pragma: no cover - older triton: PDL stays off
    HAVE_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def _gemv_tile(x_ptr, stride_x, w_ptr, stride_w, offs_n, mask_n, B, K, K_run, eps,
               B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               NORM: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr):
    """acc[b, n] = sum_k x[b, k] * w[offs_n[n], k] for k in [0, K_run); fp32 (B_PAD, BLOCK_N).

    x: rows b < B at x_ptr + b * stride_x, any float dtype; w: row-major rows at w_ptr + n * stride_w.
    Both must have unit stride along k. K: the row length (an argument, so the compiler knows its alignment);
    K_run <= K: where the sum stops, possibly read from memory (PARSE live widths; 0 = a block nobody needs).
    The first weight tile is issued with K's mask before K_run is known and cleared beyond K_run afterwards, so
    a K_run that comes from a load adds no latency, and the weights beyond it never reach the sum (not even NaN).
    NORM: also scale row b by rsqrt(mean_k x[b, k]^2 + eps), i.e. an RMSNorm of x whose weight the caller
    folded into w's columns; the sum of squares rides along the K loop every program walks anyway (K_run = K).
    PDL: the first weight tile is loaded before waiting on the previous kernel (weights never depend on it),
    so under programmatic dependent launch the stream starts while that kernel drains.
    STAGES (B = 1): software-pipeline depth of the K loop; > 1 streams the weight tiles through shared memory
    (cp.async), STAGES - 1 tiles ahead. B > 1 pipelines through the launch's num_stages (the tl.dot loop).
    """
    offs_b = tl.arange(0, B_PAD)
    mask_b = offs_b < B
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    if B_PAD == 1:
        # CUDA cores; reduce over K once, after the loop
        w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
        if PDL:
            gdc_wait()
        run_k = offs_k < K_run
        xk = tl.load(x_ptr + offs_k, mask=run_k, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc2 = tl.where(run_k[None, :], w.to(tl.float32), 0.0) * xk[None, :]  # (BLOCK_N, BLOCK_K)
        ss = xk * xk  # (BLOCK_K,)
        for k0 in tl.range(BLOCK_K, K_run, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K_run
            w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")  # (BLOCK_N, BLOCK_K)
            xk = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc2 += w.to(tl.float32) * xk[None, :]
            if NORM:
                ss += xk * xk
        acc = tl.sum(acc2, axis=1)[None, :]  # (1, BLOCK_N)
        if NORM:
            acc = acc / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    else:
        # tensor cores: x zero-padded to B_PAD >= 16 rows; x is rounded to w's dtype (as torch's bf16 GEMM would)
        wT = tl.load(w_ptr + offs_n[None, :] * stride_w + offs_k[:, None],
                     mask=mask_k[:, None] & mask_n[None, :], other=0.0, eviction_policy="evict_first")
        if PDL:
            gdc_wait()
        run_k = offs_k < K_run
        wT = tl.where(run_k[:, None], wT, 0.0)
        xk = tl.load(x_ptr + offs_b[:, None] * stride_x + offs_k[None, :],
                     mask=mask_b[:, None] & run_k[None, :], other=0.0, eviction_policy="evict_last")
        acc = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
        xf = xk.to(tl.float32)
        ss = tl.sum(xf * xf, axis=1)  # (B_PAD,)
        if w_ptr.dtype.element_ty == tl.float32:
            acc = tl.dot(xf, wT, acc, input_precision="ieee")
        else:
            acc = tl.dot(xk.to(wT.dtype), wT, acc)
        for k0 in range(BLOCK_K, K_run, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K_run
            wT = tl.load(w_ptr + offs_n[None, :] * stride_w + offs_k[:, None],
                         mask=mask_k[:, None] & mask_n[None, :], other=0.0,
                         eviction_policy="evict_first")  # (BLOCK_K, BLOCK_N)
            xk = tl.load(x_ptr + offs_b[:, None] * stride_x + offs_k[None, :],
                         mask=mask_b[:, None] & mask_k[None, :], other=0.0,
                         eviction_policy="evict_last")  # (B_PAD, BLOCK_K)
            if NORM:
                xf = xk.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            if w_ptr.dtype.element_ty == tl.float32:
                acc = tl.dot(xk.to(tl.float32), wT, acc, input_precision="ieee")
            else:
                acc = tl.dot(xk.to(wT.dtype), wT, acc)
        if NORM:
            acc = acc / tl.sqrt(ss / K + eps)[:, None]
    return acc


@triton.jit
def live_width(K, klive_ptr):
    """min(K, klive[0] rounded up to 16), hinted as a multiple of 16 so masks stay 16-wide and loads vectorized
    (K % 16 == 0; the PARSE slots' padding between the union and the rounded width is masked out by `keep`)."""
    return tl.multiple_of(tl.minimum(K, tl.cdiv(tl.load(klive_ptr), 16) * 16), 16)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, keep_ptr, klive_ptr, B, N, K, stride_x, stride_w, stride_y, stride_keep, eps,
                 B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NORM: tl.constexpr, RESIDUAL: tl.constexpr, KEEP: tl.constexpr, LIVE: tl.constexpr,
                 PDL: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr):
    # grid (cdiv(N, BLOCK_N), SPLIT): y[b, n] (+)= sum_k x[b, k] w[n, k] (RESIDUAL: added to y in place), y's dtype;
    # SPLIT > 1: program (nb, s) sums one chunk of k (a multiple of BLOCK_K) and adds it into y with an atomic
    # (y fp32 and zeroed by the caller; no NORM, RESIDUAL or LIVE), so a few-row matrix still fills every SM;
    # KEEP: y[b, n] *= keep[b, n] (PARSE: the rank components row b does not use are zeroed); a block of rows that
    # no row keeps reads no weights and is written as zeros. keep (like klive) is written at admission, before
    # the graph replays, so it is read before waiting on the previous kernel.
    # LIVE: only k < klive[0] is read (PARSE slots: x's columns beyond the batch's union are never used)
    if PDL:
        gdc_launch_dependents()
    K_run = K
    if LIVE:
        K_run = live_width(K, klive_ptr)
    K_len = K
    if SPLIT > 1:  # this program's chunk of k: [k_lo, k_lo + K_len)
        KC = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
        k_lo = tl.program_id(1) * KC
        x_ptr += k_lo
        w_ptr += k_lo
        K_len = tl.multiple_of(tl.maximum(tl.minimum(KC, K - k_lo), 0), 16)
        K_run = K_len
    # one block of BLOCK_N rows per iteration; a grid smaller than the block count (grid_cap) makes the programs
    # persistent: all resident from the start, each striding over several blocks
    for nb in range(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_b = tl.arange(0, B_PAD)
        y_ptrs = y_ptr + offs_b[:, None] * stride_y + offs_n[None, :]
        mask = (offs_b[:, None] < B) & mask_n[None, :]
        if KEEP:
            kp = tl.load(keep_ptr + offs_b[:, None] * stride_keep + offs_n[None, :], mask=mask,
                         other=0.0).to(tl.float32)  # (B_PAD, BLOCK_N)
            # nobody keeps these rows: every weight load masked off (no traffic) and an empty K loop -> zeros;
            # no branch around the tile, so the K loop's software pipelining is the same as without KEEP
            alive = tl.max(tl.max(kp, axis=1), axis=0) > 0
            k_blk = tl.multiple_of(tl.where(alive, K_run, 0), 16)
            mask_live = mask_n & (offs_n < tl.where(alive, N, 0))  # (a tensor & scalar-bool trips the interpreter)
            acc = _gemv_tile(x_ptr, stride_x, w_ptr, stride_w, offs_n, mask_live, B, K_len, k_blk, eps, B_PAD,
                             BLOCK_N, BLOCK_K, NORM, PDL, STAGES) * kp
        else:
            acc = _gemv_tile(x_ptr, stride_x, w_ptr, stride_w, offs_n, mask_n, B, K_len, K_run, eps, B_PAD, BLOCK_N,
                             BLOCK_K, NORM, PDL, STAGES)
        if RESIDUAL:  # each element is owned by one program: the in-place add is race free
            acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        if SPLIT > 1:
            tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def pad_rows(B: int) -> int:
    """B_PAD of _gemv_tile: 1 (CUDA-core path) or >= 16 (tensor-core path, tl.dot's minimum M)."""
    return 1 if B == 1 else max(16, triton.next_power_of_2(B))


def gemv_config(B: int, N: int, on_gpu: bool, K: int = 0) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of _gemv_kernel for B rows of x and N rows of w of length K.

    GPU values from bench/kernels_gpu.py --only gemv_sweep on an H200 (triton 3.6), median us, cold L2:
      B=1, (1228, 4096): 8.9 (best 8.2);  B=1, (11008, 1791): 18.9 (best)
      B=8: see below (a later sweep with more configs and the PARSE slot shapes)
    Under the CPU interpreter big tiles mean fewer (slow, Python-level) programs.
    """
    if not on_gpu:
        return 16, 64, 1, 1
    if B == 1:
        return 4, 1024, 4, 1
    # B > 1, from the sweep at the LLaMA-7B and PARSE-slot shapes (bench/kernels_gpu.py --only gemv_sweep,
    # kernels-h200-gemv-slot-sweep.json, us, cold L2): U stages (K = rank < 4096, N = 11008): (32, 128, 4, 4)
    # 20.0 static / 21.1 slot (live 1888 of 3584) vs 23.0 / 27.4 with (32, 256, 4, 4); V stages (K = hidden):
    # (32, 256, 4, 4) 17.9 static (N = 3696) / 19.6 slot (N = 7392, half beyond the union) vs 18.8 / 24.5 with
    # (16, 512, 4, 4), which stays for few rows (o, down: N = 1232 / 1792; 11.4 us at N = 1228, earlier sweep)
    if N < 2048:
        return 16, 512, 4, 4
    return (32, 256, 4, 4) if K >= 4096 else (32, 128, 4, 4)


def split_k(B: int, N: int, K: int, on_gpu: bool, sms: int, waves: int, live: int = 0) -> int:
    """How many programs share each block of rows of an N x K GEMV at B rows (SPLIT of _gemv_kernel): enough
    for `waves` programs per SM when the row blocks in use (the first `live` rows, 0 = all N; PARSE slots) are
    fewer, at least two BLOCK_K tiles each; 1 at B = 1 (its narrow tiles already give hundreds of programs) or
    when waves is 0."""
    if B == 1 or waves <= 0 or K % 16:
        return 1
    BLOCK_N, BLOCK_K, _, _ = gemv_config(B, N, on_gpu, K)
    blocks = triton.cdiv(live or N, BLOCK_N)
    # rounded up, even past one program an SM: 0.7-1.5 % faster than rounded down (bench/results/split-probe-h200.md)
    return max(1, min(triton.cdiv(waves * sms, blocks), K // (2 * BLOCK_K)))


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *, norm_eps: float | None = None,
         residual: bool = False, keep: torch.Tensor | None = None, klive: torch.Tensor | None = None,
         pdl: bool = False, grid_cap: int = 0, stages: int = 0, split: int = 1) -> torch.Tensor:
    """y = x @ wᵀ for a few rows of x, fp32 accumulation.

    x: (B, K) bf16/fp16/fp32, unit stride along K. w: (N, K) row-major, unit stride along K.
    out: optional (B, N) buffer, any float dtype (fp32 for a scratch t); default x.dtype.
    norm_eps: RMS-normalize each row of x first (y = (x / rms(x)) @ wᵀ; fold the norm weight into w's columns).
    residual: out += x @ wᵀ in place (out required). keep: optional (B, N) 0/1 multiplier of the result,
    unit stride on N (PARSE: the components each row does not use; blocks no row keeps skip their weights).
    klive: optional int32 device tensor; only the first klive[0] columns of x and w are read, rounded up to 16
    (PARSE slots: the batch's union is stored first; read on the device, so a captured graph follows its
    changes). Needs K % 16 == 0: the kernel promises the compiler 16-wide masks, which keeps loads vectorized.
    grid_cap: at most this many programs (0 = one per block of rows), each then striding over several blocks
    (persistent programs). stages: pipeline depth of the weight stream (0 = gemv_config's; see _gemv_tile's
    STAGES). pdl: launch with programmatic dependent launch (Hopper+, CUDA only).
    split: > 1 splits the reduction over that many programs per block of rows (see split_k), which add their
    partial sums into out with atomics: out must be an fp32 buffer of zeros; not with norm_eps, residual, klive.
    Returns out. No host sync, no allocation when out is given (CUDA-graph capturable).
    """
    B, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and x.stride(1) == 1 and w.stride(1) == 1, "gemv wants x (B, K), w (N, K), unit stride on K"
    assert out is not None or not residual, "residual=True adds into out: pass it"
    if out is None:
        out = torch.zeros(B, N, device=x.device, dtype=torch.float32) if split > 1 else \
            torch.empty(B, N, device=x.device, dtype=x.dtype)
    BLOCK_N, BLOCK_K, num_warps, num_stages = gemv_config(B, N, x.is_cuda, K)
    num_stages = stages or num_stages
    if keep is not None:
        assert keep.shape == (B, N) and keep.stride(1) == 1, "keep wants (B, N), unit stride on N"
    if klive is not None:
        assert klive.dtype == torch.int32 and klive.numel() >= 1 and K % 16 == 0, \
            "klive wants an int32 device tensor and K a multiple of 16"
    if split > 1:
        assert out.dtype == torch.float32 and norm_eps is None and not residual and klive is None and K % 16 == 0, \
            "split-K wants a zeroed fp32 out, no norm, residual or klive, and K a multiple of 16"
    kp = keep if keep is not None else out  # dummy pointer when unused
    blocks = triton.cdiv(N, BLOCK_N)
    _gemv_kernel[(min(blocks, grid_cap) if grid_cap > 0 else blocks, max(split, 1))](
        x, w, out, kp, klive if klive is not None else kp, B, N, K, x.stride(0), w.stride(0), out.stride(0),
        kp.stride(0), float(norm_eps or 0.0),
        B_PAD=pad_rows(B), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NORM=norm_eps is not None, RESIDUAL=residual,
        KEEP=keep is not None, LIVE=klive is not None, PDL=pdl, STAGES=num_stages if B == 1 else 1,
        SPLIT=max(split, 1),
        num_warps=num_warps, num_stages=num_stages, **launch_opts(pdl))
    return out


def launch_opts(pdl: bool) -> dict:
    """Extra launch keywords: programmatic dependent launch only when asked (never under the interpreter)."""
    return {"launch_pdl": True} if pdl else {}


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper-or-newer GPU and a triton that exposes griddepcontrol."""
    return HAVE_PDL and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def lowrank_linear(x: torch.Tensor, V: torch.Tensor, U: torch.Tensor, *,
                   out: torch.Tensor | None = None, t: torch.Tensor | None = None, residual: bool = False,
                   keep: torch.Tensor | None = None, klive: torch.Tensor | None = None, pdl: bool = False,
                   grid_cap: int = 0, stages: int = 0, split: int = 1) -> torch.Tensor:
    """y = U (V x) for each row of x: the canonical factorization W (out, in) ~ U (out, r) @ V (r, in).

    x: (B, in), B <= 8 (decode rows), bf16 (GPU) or fp32; V: (r, in) and U: (out, r) row-major, x.dtype.
    t: optional fp32 (B, r) scratch for V x (kept in fp32 so the rank-space activation is not rounded).
    out: optional (B, out) buffer, x.dtype; residual: out += U (V x) in place (the decoder's residual stream).
    keep: optional (B, r) 0/1 mask of each row's rank components (PARSE), applied to V x. klive: optional int32
    (1,) device tensor: only the first klive[0] components are in use (see gemv). grid_cap, stages: see gemv. split: split-K of the V stage (see gemv; a given t must then hold fp32 zeros).
    Two launches, no host sync; no allocation when out and t are given.
    """
    B = x.shape[0]
    if t is None:
        t = (torch.zeros if split > 1 else torch.empty)(B, V.shape[0], device=x.device, dtype=torch.float32)
    gemv(x, V, out=t, keep=keep, pdl=pdl, grid_cap=grid_cap, stages=stages, split=split)  # (B, r) fp32
    if out is None:
        out = torch.empty(B, U.shape[0], device=x.device, dtype=x.dtype)
    return gemv(t, U, out=out, residual=residual, klive=klive, pdl=pdl, grid_cap=grid_cap, stages=stages)


def lowrank_linear_ref(x: torch.Tensor, V: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """Torch reference of lowrank_linear in the inputs' dtype: (x Vᵀ) Uᵀ -> (B, out)."""
    return (x @ V.T) @ U.T
