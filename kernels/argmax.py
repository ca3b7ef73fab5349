"""Greedy token choice on the device: the index of each row's largest logit, inside the decode step's CUDA graph.

Taken after the step, torch.argmax is one more eager launch a token (a reduction over the vocabulary); here the
step itself ends with it and writes the next input token, so greedy decoding replays one graph per token and
nothing else. One program per row reads the row in tiles of up to 32 K logits (one tile for LLaMA's 32 K
vocabulary), keeping the running maximum and its first index (torch.argmax's tie rule: the first maximum).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr):
    # grid (B,): out[b] = the first index of the largest of x[b, :V]
    row = x_ptr + tl.program_id(0) * stride_x
    offs = tl.arange(0, BLOCK)
    x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    best_i = tl.argmax(x, axis=0, tie_break_left=True)
    for v0 in range(BLOCK, V, BLOCK):  # vocabularies above one tile
        x = tl.load(row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        take = m > best  # strictly larger: an equal maximum further on keeps the first index
        best_i = tl.where(take, v0 + tl.argmax(x, axis=0, tie_break_left=True), best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + tl.program_id(0), best_i.to(out_ptr.dtype.element_ty))


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: (B, V) float logits, unit stride on V -> out (B,) int64 (or the given int buffer): argmax of each row,
    the first index among equal maxima. One launch, no host sync or allocation when out is given."""
    B, V = x.shape
    assert x.stride(1) == 1, "argmax_rows wants unit stride along the vocabulary"
    if out is None:
        out = torch.empty(B, device=x.device, dtype=torch.long)
    BLOCK = min(triton.next_power_of_2(V), 32768 if x.is_cuda else 1024)
    _argmax_kernel[(B,)](x, out, V, x.stride(0), BLOCK=BLOCK, num_warps=16 if x.is_cuda else 1)
    return out
