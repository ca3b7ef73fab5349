"""RMSNorm of a few decode rows, optionally fused with the residual add that precedes it.

Decode does `residual += x; x = norm(residual)` before every sub-layer; fusing reads x and the residual once
and writes the new residual and the normed row in one launch. One program per row, the row in registers.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, residual_ptr, w_ptr, out_ptr, N, eps, stride_x, stride_r, stride_o,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # grid (B,): one row per program
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    s = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK,)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_r + offs
        s = (s + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(r_ptrs, s, mask=mask)
        s = s.to(tl.float32)  # normalize the stored (rounded) residual, as an unfused add + norm would
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (s * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x / sqrt(mean(x²) + eps) * weight, fp32 math, one launch.

    x: (B, hidden) bf16 (GPU) or fp32, unit stride on hidden; weight: (hidden,) any float dtype.
    residual: optional (B, hidden); if given, residual <- residual + x in place (rounded to residual.dtype),
    and that new residual is what gets normalized. out: optional (B, hidden) x.dtype; may alias x.
    Returns out. No host sync.
    """
    B, N = x.shape
    assert x.stride(1) == 1 and weight.shape == (N,), "rmsnorm wants x (B, hidden) unit stride and weight (hidden,)"
    if out is None:
        out = torch.empty_like(x)
    r = residual if residual is not None else x  # dummy pointer when unused
    BLOCK = triton.next_power_of_2(N)
    _rmsnorm_kernel[(B,)](x, r, weight, out, N, eps, x.stride(0), r.stride(0), out.stride(0),
                          HAS_RESIDUAL=residual is not None, BLOCK=BLOCK,
                          num_warps=min(16, max(1, BLOCK // 512)) if x.is_cuda else 1)
    return out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of rmsnorm (updates residual in place when given), fp32 math for fp32/bf16 inputs."""
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float() if x.dtype != torch.float64 else x
    w = weight.to(xf.dtype)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
