"""MLP input side of one decode step: h = silu(Ug (Vg x)) * (Uu (Vu x)), both projections low-rank.

Launch 1: t = x Vguᵀ, one GEMV over the packed gate/up input factors (rg + ru rows) into an fp32 scratch.
Launch 2: each program computes BLOCK_N rows of both the gate and the up output from t, then SiLU·mul in
          fp32 in registers, so g and u never reach memory.
"""

import torch
import triton
import triton.language as tl

from rankserve.kernels.lowrank_linear import (_gemv_tile, gdc_launch_dependents, gemv, gemv_config, launch_opts,
                                              live_width, pad_rows)


@triton.jit
def _gate_up_u_kernel(t_ptr, Ug_ptr, Uu_ptr, h_ptr, klive_ptr, B, N, rg, ru, stride_t, stride_ug, stride_uu,
                      stride_h, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      LIVE: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr):
    # grid (cdiv(N, BLOCK_N),): h[b, n] = silu(sum_j t[b, j] Ug[n, j]) * sum_j t[b, rg + j] Uu[n, j]
    # LIVE: gate / up read only their first klive[0] / klive[1] rank components (PARSE slots)
    if PDL:
        gdc_launch_dependents()
    kg = rg
    ku = ru
    if LIVE:
        kg = live_width(rg, klive_ptr)
        ku = live_width(ru, klive_ptr + 1)
    for nb in range(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.num_programs(0)):  # persistent when grid < blocks
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        g = _gemv_tile(t_ptr, stride_t, Ug_ptr, stride_ug, offs_n, mask_n, B, rg, kg, 0.0, B_PAD, BLOCK_N,
                       BLOCK_K, False, PDL, STAGES)
        u = _gemv_tile(t_ptr + rg, stride_t, Uu_ptr, stride_uu, offs_n, mask_n, B, ru, ku, 0.0, B_PAD, BLOCK_N,
                       BLOCK_K, False, False, STAGES)
        h = g / (1.0 + tl.exp(-g)) * u  # (B_PAD, BLOCK_N) fp32
        offs_b = tl.arange(0, B_PAD)
        tl.store(h_ptr + offs_b[:, None] * stride_h + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=(offs_b[:, None] < B) & mask_n[None, :])


def gate_up(x: torch.Tensor, Vgu: torch.Tensor, Ug: torch.Tensor, Uu: torch.Tensor, *,
            out: torch.Tensor | None = None, t: torch.Tensor | None = None, norm_eps: float | None = None,
            keep: torch.Tensor | None = None, klive: torch.Tensor | None = None, pdl: bool = False,
            grid_cap: int = 0, stages: int = 0, split: int = 1) -> torch.Tensor:
    """h = silu(Ug (Vg x)) * (Uu (Vu x)) for each row of x.

    x: (B, hidden) already RMS-normed, bf16 (GPU) or fp32, B <= 8. Vgu: (rg + ru, hidden), gate then up input
    factors stacked. Ug: (inter, rg), Uu: (inter, ru). Weights x.dtype, row-major.
    out: optional (B, inter) x.dtype; t: optional (B, rg + ru) fp32 scratch.
    norm_eps: x is the raw residual stream, RMS-normalized inside the first GEMV (norm weight folded into Vgu).
    keep: optional (B, rg + ru) 0/1 mask of each row's rank components (PARSE). klive: optional int32 (2,)
    device tensor, components in use of gate and up (PARSE slots: only those are read, rounded up to 16; ranks
    must be multiples of 16). pdl: programmatic dependent launch (Hopper+). grid_cap: at most this many programs
    per launch (persistent programs; 0 = one per block). stages: pipeline depth of the weight stream (0 =
    gemv_config's; see lowrank_linear._gemv_tile). split: split-K of the first GEMV (see gemv; a given t must then
    hold fp32 zeros).
    Returns h (B, inter). Two launches, no host sync.
    """
    B = x.shape[0]
    N, rg = Ug.shape
    ru = Uu.shape[1]
    assert Vgu.shape[0] == rg + ru and Uu.shape[0] == N, "gate_up wants Vgu (rg+ru, hidden), Ug (inter, rg), Uu (inter, ru)"
    assert Ug.stride(1) == 1 and Uu.stride(1) == 1
    assert klive is None or (klive.dtype == torch.int32 and klive.numel() >= 2 and rg % 16 == ru % 16 == 0), \
        "klive wants int32 (2,) and ranks that are multiples of 16"
    if t is None:
        t = (torch.zeros if split > 1 else torch.empty)(B, rg + ru, device=x.device, dtype=torch.float32)
    if out is None:
        out = torch.empty(B, N, device=x.device, dtype=x.dtype)
    gemv(x, Vgu, out=t, norm_eps=norm_eps, keep=keep, pdl=pdl, grid_cap=grid_cap, stages=stages,
         split=split)  # (B, rg + ru) fp32
    BLOCK_N, BLOCK_K, num_warps, num_stages = gemv_config(B, N, x.is_cuda)
    num_stages = stages or num_stages
    blocks = triton.cdiv(N, BLOCK_N)
    _gate_up_u_kernel[(min(blocks, grid_cap) if grid_cap > 0 else blocks,)](
        t, Ug, Uu, out, klive if klive is not None else out, B, N, rg, ru, t.stride(0), Ug.stride(0), Uu.stride(0),
        out.stride(0), B_PAD=pad_rows(B), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, LIVE=klive is not None, PDL=pdl,
        STAGES=num_stages if B == 1 else 1, num_warps=num_warps, num_stages=num_stages, **launch_opts(pdl))
    return out


def gate_up_ref(x: torch.Tensor, Vgu: torch.Tensor, Ug: torch.Tensor, Uu: torch.Tensor) -> torch.Tensor:
    """Torch reference of gate_up in the inputs' dtype -> (B, inter)."""
    rg = Ug.shape[1]
    t = x @ Vgu.T  # (B, rg + ru)
    return torch.nn.functional.silu(t[:, :rg] @ Ug.T) * (t[:, rg:] @ Uu.T)
