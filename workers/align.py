"""Rank padding for the GPU: zero components that make every rank a multiple of 16 (GPU_ALIGN).

A rank such as 1228 or 1791 (SVD-LLM at keep 0.6 on LLaMA-7B) gives U (out, r) and the rank activation (S, r)
rows of 2456 / 3582 bytes in bf16: not a multiple of 16. cuBLAS then falls back to its sm75-era tensor-core
kernels for the prefill GEMMs (measured on the H200: 437-772 us per GEMM where aligned shapes take ~100 us,
`bench/results/prefill-probe-h200.json`), and Triton cannot vectorize loads along U's rows in decode.
`pad_ranks` appends zero rows to V and zero columns to U, so r becomes a multiple of `multiple`; the product U V
is unchanged exactly (the extra components contribute 0 * x). Done once at load time on CUDA.

Why 16 components and not 8 (16 bytes in bf16, enough for cuBLAS): Triton specializes integer arguments
(a rank as loop bound or row stride) only when they are multiples of 16; otherwise its masks and row starts have
unknown alignment and every weight load of the decode GEMVs becomes a scalar 2-byte load. Compiled for sm90 on
the CPU (`triton.compile` of `_gemv_kernel`): 12 of 12 global loads vectorized with a rank that is a multiple of
16, 4 of 68 with 8 mod 16 (B = 1), 0 of 192 at B = 8. SVD-LLM at keep 0.8 (ranks 1638 / 2388 -> 1640 / 2392)
and most Dobi-SVD / Basis Sharing ranks are 8 mod 16; ≤ 15 zero components more per matrix (< 1.3% bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from rankserve.workers.model import Transformer


GPU_ALIGN = 16  # components; see the module doc


def padded(r: int, multiple: int) -> int:
    """r rounded up to a multiple of `multiple` (elementwise for a numpy array of ints)."""
    return -(-r // multiple) * multiple


@torch.no_grad()
def pad_ranks(model: Transformer, multiple: int = GPU_ALIGN) -> int:
    """Zero-pad every factorized projection's rank up to a multiple of `multiple` in place; -> projections padded.

    Basis Sharing: a shared V is padded once and stays shared (its members have the same rank). A PARSE mask
    (B, r) is padded with zeros. Routers and subsets index components < r and are unaffected.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    new_v: dict[int, nn.Parameter] = {}  # id(old V) -> padded V, so shared bases stay one tensor
    count = 0
    for lin in model.projections().values():
        if not lin.factorized or lin.rank % multiple == 0:
            continue
        r, rp = lin.rank, padded(lin.rank, multiple)
        V = lin.V
        if id(V) not in new_v:
            Vp = torch.zeros(rp, V.shape[1], device=V.device, dtype=V.dtype)
            Vp[:r] = V
            new_v[id(V)] = nn.Parameter(Vp, requires_grad=False)
        Up = torch.zeros(lin.U.shape[0], rp, device=lin.U.device, dtype=lin.U.dtype)
        Up[:, :r] = lin.U
        lin.U = nn.Parameter(Up, requires_grad=False)
        lin.V = new_v[id(V)]
        lin.rank = rp
        if lin.mask is not None:
            lin.mask = torch.cat([lin.mask, lin.mask.new_zeros(lin.mask.shape[0], rp - r)], dim=1)
        count += 1
    for key, p in list(model.bases.items()):
        if id(p) in new_v:
            model.bases[key] = new_v[id(p)]
    return count
