"""lowrank_linear / gemv vs an fp64 reference.

Run alone: .venv/bin/python -m pytest tests/test_kernels_lowrank_linear.py  (CPU: Triton interpreter, fp32)
"""

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, fresh_seed, nan_like, randn, to64

from rankserve.kernels.lowrank_linear import gemv, lowrank_linear, lowrank_linear_ref, split_k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("d_in, r, d_out", [(77, 19, 45), (128, 33, 96), (300, 70, 257)])
def test_lowrank_linear(B, d_in, r, d_out, dtype):
    seed = fresh_seed()
    x = randn(B, d_in, dtype=dtype)
    V = randn(r, d_in, dtype=dtype, scale=d_in ** -0.5)
    U = randn(d_out, r, dtype=dtype, scale=r ** -0.5)
    t, y = nan_like((B, r), torch.float32), nan_like((B, d_out), dtype)
    lowrank_linear(x, V, U, out=y, t=t)
    what = f"lowrank_linear B={B} in={d_in} r={r} out={d_out} {dtype} seed={seed}"
    assert_close(y, lowrank_linear_ref(*to64(x, V, U)), lowrank_linear_ref(x, V, U), what)
    assert_close(t, x.double() @ V.double().T, (x @ V.T).float(), what + " (t)")


@pytest.mark.parametrize("B", [1, 5])
def test_gemv_strided_x_and_default_out(B):
    seed = fresh_seed()
    dtype = DTYPES[0]
    xs = randn(B, 2 * 90, dtype=dtype)[:, 10:100]  # row stride 180, unit stride on K
    w = randn(70, 90, dtype=dtype, scale=90 ** -0.5)
    y = gemv(xs, w)
    assert y.dtype == dtype and y.device.type == DEVICE
    assert_close(y, xs.double() @ w.double().T, xs @ w.T, f"gemv strided B={B} seed={seed}")


def _rms64(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("K, N", [(96, 40), (300, 77)])
def test_gemv_fused_rmsnorm(B, K, N, dtype):
    """norm_eps: y = rmsnorm(x) @ (w * g)ᵀ with the norm weight g folded into w's columns by the caller."""
    seed = fresh_seed()
    eps = 1e-5
    x = randn(B, K, dtype=dtype, scale=3.0)  # a residual stream: not unit scale
    w = randn(N, K, dtype=dtype, scale=K ** -0.5)
    g = (1 + 0.1 * randn(K, dtype=torch.float32)).to(dtype)
    wg = (w.float() * g.float()).to(dtype)
    y = nan_like((B, N), torch.float32)
    gemv(x, wg, out=y, norm_eps=eps)
    base = ((x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(dtype) @ wg.T).float()
    assert_close(y, _rms64(x, eps) @ wg.double().T, base, f"gemv norm B={B} K={K} N={N} {dtype} seed={seed}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 4])
def test_lowrank_linear_residual_adds_in_place(B, dtype):
    seed = fresh_seed()
    x = randn(B, 80, dtype=dtype)
    V, U = randn(23, 80, dtype=dtype, scale=80 ** -0.5), randn(64, 23, dtype=dtype, scale=23 ** -0.5)
    res = randn(B, 64, dtype=dtype)
    ref = res.double() + lowrank_linear_ref(*to64(x, V, U))
    base = res + lowrank_linear_ref(x, V, U)
    out = res.clone()
    got = lowrank_linear(x, V, U, out=out, residual=True)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, ref, base, f"lowrank_linear residual B={B} {dtype} seed={seed}")


def test_residual_needs_out():
    x = randn(1, 8, dtype=DTYPES[0])
    with pytest.raises(AssertionError, match="residual"):
        gemv(x, randn(4, 8, dtype=DTYPES[0]), residual=True)


@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("opts", [dict(grid_cap=1), dict(grid_cap=3), dict(stages=2), dict(stages=3)],
                         ids=["grid_cap1", "grid_cap3", "stages2", "stages3"])
def test_schedule_options_keep_the_product(B, opts):
    """Options that change the schedule, not the sum: grid_cap (fewer programs than blocks, each striding over
    several) and stages > 1 (the weight stream software-pipelined through shared memory at B = 1)."""
    seed = fresh_seed()
    dtype = DTYPES[0]
    x = randn(B, 200, dtype=dtype)
    V, U = randn(48, 200, dtype=dtype, scale=200 ** -0.5), randn(130, 48, dtype=dtype, scale=48 ** -0.5)
    y = nan_like((B, 130), dtype)
    lowrank_linear(x, V, U, out=y, **opts)
    assert_close(y, lowrank_linear_ref(*to64(x, V, U)), lowrank_linear_ref(x, V, U),
                 f"lowrank_linear {opts} B={B} seed={seed}")


@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("B", [2, 8])
def test_split_k_adds_every_chunk_once(B, split):
    """split > 1: the reduction is cut into BLOCK_K-multiple chunks (here 64 on the CPU tiles; K = 208 leaves a
    short last chunk and, at split 3 and 5, programs with nothing to do) whose partial sums are added into a
    zeroed fp32 out; the result is the same product."""
    seed = fresh_seed()
    dtype = DTYPES[0]
    x = randn(B, 208, dtype=dtype)
    V, U = randn(40, 208, dtype=dtype, scale=208 ** -0.5), randn(72, 40, dtype=dtype, scale=40 ** -0.5)
    t = torch.zeros(B, 40, device=DEVICE)
    y = lowrank_linear(x, V, U, t=t, split=split)
    what = f"split-K {split} B={B} seed={seed}"
    assert_close(t, x.double() @ V.double().T, (x @ V.T).float(), what + " (t)")
    assert_close(y, lowrank_linear_ref(*to64(x, V, U)), lowrank_linear_ref(x, V, U), what)
    assert_close(gemv(x, V, split=split), x.double() @ V.double().T, (x @ V.T).float(), what + " (default out)")


def test_split_k_refuses_what_it_cannot_add():
    x, w = randn(2, 64, dtype=DTYPES[0]), randn(32, 64, dtype=DTYPES[0])
    with pytest.raises(AssertionError, match="split-K"):
        gemv(x, w, out=torch.zeros(2, 32, device=DEVICE, dtype=torch.float64), split=2)
    with pytest.raises(AssertionError, match="split-K"):
        gemv(x, w, out=torch.zeros(2, 32, device=DEVICE), split=2, norm_eps=1e-6)


def test_split_k_choice():
    """split_k fills `waves` programs per SM when the row blocks are few, keeps >= 2 tiles a program, and stays 1
    at B = 1 or when off. GPU tiles: B = 8, (1232, 4096) -> 77 blocks of 16 rows, BLOCK_K 512."""
    assert split_k(1, 1232, 4096, True, 132, 2) == 1
    assert split_k(8, 1232, 4096, True, 132, 0) == 1
    assert split_k(8, 1232, 4096, True, 132, 2) == 4  # ceil(264 / 77) = 4 <= 4096 // 1024
    assert split_k(8, 1232, 4096, True, 132, 8) == 4  # capped: two 512-wide tiles per program
    assert split_k(8, 11008, 1792, True, 132, 2) == 1  # 344 blocks already fill two waves
    assert split_k(8, 1232, 4096, True, 132, 1) == 2  # one wave: ceil(132 / 77)
    assert split_k(8, 2464, 4096, True, 132, 1, live=1232) == 4  # a slot: 32-row tiles, 39 blocks in use
