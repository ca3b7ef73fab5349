"""gate_up (low-rank gate and up projections + SiLU·mul) vs an fp64 reference.

Run alone: .venv/bin/python -m pytest tests/test_kernels_gate_up.py  (CPU: Triton interpreter, fp32)
"""

import pytest
import torch
from kernel_utils import DTYPES, assert_close, fresh_seed, nan_like, randn, to64

from rankserve.kernels.gate_up import gate_up, gate_up_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("hidden, rg, ru, inter", [(64, 20, 28, 150), (100, 37, 37, 77), (48, 9, 60, 200)])
def test_gate_up(B, hidden, rg, ru, inter, dtype):
    seed = fresh_seed()
    x = randn(B, hidden, dtype=dtype)
    Vgu = randn(rg + ru, hidden, dtype=dtype, scale=hidden ** -0.5)
    Ug = randn(inter, rg, dtype=dtype, scale=2 * rg ** -0.5)  # gate pre-activations spread over SiLU's range
    Uu = randn(inter, ru, dtype=dtype, scale=ru ** -0.5)
    h, t = nan_like((B, inter), dtype), nan_like((B, rg + ru), torch.float32)
    gate_up(x, Vgu, Ug, Uu, out=h, t=t)
    what = f"gate_up B={B} hidden={hidden} rg={rg} ru={ru} inter={inter} {dtype} seed={seed}"
    assert_close(h, gate_up_ref(*to64(x, Vgu, Ug, Uu)), gate_up_ref(x, Vgu, Ug, Uu), what)


@pytest.mark.parametrize("B", [1, 3])
def test_gate_up_fused_rmsnorm(B):
    """norm_eps: x is the raw residual; the RMSNorm (weight folded into Vgu) happens inside the first GEMV."""
    seed = fresh_seed()
    dtype, eps = DTYPES[0], 1e-6
    x = randn(B, 64, dtype=dtype, scale=4.0)
    g = (1 + 0.2 * randn(64, dtype=torch.float32)).to(dtype)
    Vgu = randn(40, 64, dtype=dtype, scale=64 ** -0.5)
    Ug, Uu = randn(90, 18, dtype=dtype, scale=18 ** -0.5), randn(90, 22, dtype=dtype, scale=22 ** -0.5)
    h = nan_like((B, 90), dtype)
    gate_up(x, (Vgu.float() * g.float()).to(dtype), Ug, Uu, out=h, norm_eps=eps)
    x64 = x.double()
    xn = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    xn_base = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * g.float()).to(dtype)
    assert_close(h, gate_up_ref(xn, *to64(Vgu, Ug, Uu)), gate_up_ref(xn_base, Vgu, Ug, Uu),
                 f"gate_up norm B={B} seed={seed}")


def test_gate_up_persistent_programs():
    seed = fresh_seed()
    dtype = DTYPES[0]
    x = randn(2, 48, dtype=dtype)
    Vgu = randn(30, 48, dtype=dtype, scale=48 ** -0.5)
    Ug, Uu = randn(150, 14, dtype=dtype, scale=14 ** -0.5), randn(150, 16, dtype=dtype, scale=16 ** -0.5)
    h = nan_like((2, 150), dtype)
    gate_up(x, Vgu, Ug, Uu, out=h, grid_cap=2)
    assert_close(h, gate_up_ref(*to64(x, Vgu, Ug, Uu)), gate_up_ref(x, Vgu, Ug, Uu), f"gate_up grid_cap=2 seed={seed}")
