"""qkv_rope (low-rank q/k/v, RoPE, KV-cache append) vs an fp64 reference.

Run alone: .venv/bin/python -m pytest tests/test_kernels_qkv_rope.py  (CPU: Triton interpreter, fp32)
"""

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, fresh_seed, nan_like, randn, rope_tables, to64

from rankserve.kernels.qkv_rope import qkv_rope, qkv_rope_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("hidden, H, H_kv, D, rq, rk, rv, S_max", [
    (64, 4, 4, 16, 24, 24, 24, 12),   # MHA, equal ranks
    (96, 4, 2, 32, 40, 17, 23, 20),   # GQA, Dobi-SVD-like ranks
    (80, 6, 1, 24, 31, 9, 15, 9),     # MQA, head dim not a power of two
])
def test_qkv_rope(B, hidden, H, H_kv, D, rq, rk, rv, S_max, dtype):
    seed = fresh_seed()
    x = randn(B, hidden, dtype=dtype)
    Vqkv = randn(rq + rk + rv, hidden, dtype=dtype, scale=hidden ** -0.5)
    Uq = randn(H * D, rq, dtype=dtype, scale=rq ** -0.5)
    Uk = randn(H_kv * D, rk, dtype=dtype, scale=rk ** -0.5)
    Uv = randn(H_kv * D, rv, dtype=dtype, scale=rv ** -0.5)
    cos, sin = rope_tables(S_max, D)
    cache_seqlens = torch.randint(0, S_max, (B,), dtype=torch.int32, device=DEVICE)
    cache_seqlens[-1] = S_max - 1  # the last cache row
    k_cache, v_cache = randn(B, S_max, H_kv, D, dtype=dtype), randn(B, S_max, H_kv, D, dtype=dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q, t = nan_like((B, H, D), dtype), nan_like((B, rq + rk + rv), torch.float32)

    qkv_rope(x, Vqkv, Uq, Uk, Uv, cos, sin, k_cache, v_cache, cache_seqlens, q_out=q, t=t)

    k64, v64 = to64(k0, v0)
    q64 = qkv_rope_ref(*to64(x, Vqkv, Uq, Uk, Uv, cos, sin), k64, v64, cache_seqlens)
    kb, vb = k0.clone(), v0.clone()
    qb = qkv_rope_ref(x, Vqkv, Uq, Uk, Uv, cos, sin, kb, vb, cache_seqlens)
    what = f"qkv_rope B={B} H={H} H_kv={H_kv} D={D} r={rq},{rk},{rv} {dtype} seed={seed}"
    assert_close(q, q64, qb, what + " (q)")
    rows, pos = torch.arange(B, device=DEVICE), cache_seqlens.long()
    assert_close(k_cache[rows, pos], k64[rows, pos], kb[rows, pos], what + " (new k)")
    assert_close(v_cache[rows, pos], v64[rows, pos], vb[rows, pos], what + " (new v)")
    untouched = torch.ones(B, S_max, dtype=torch.bool, device=DEVICE)
    untouched[rows, pos] = False
    assert torch.equal(k_cache[untouched], k0[untouched]) and torch.equal(v_cache[untouched], v0[untouched]), \
        what + ": wrote outside [b, cache_seqlens[b]]"
    assert torch.equal(cache_seqlens[-1:].cpu(), torch.tensor([S_max - 1], dtype=torch.int32)), "cache_seqlens changed"


@pytest.mark.parametrize("B", [1, 3])
def test_qkv_rope_fused_rmsnorm(B):
    """norm_eps: x is the raw residual, RMS-normalized inside the first GEMV (norm weight folded into Vqkv)."""
    seed = fresh_seed()
    dtype, eps, hidden, H, H_kv, D, S_max = DTYPES[0], 1e-5, 64, 4, 2, 16, 10
    x = randn(B, hidden, dtype=dtype, scale=5.0)
    g = (1 + 0.2 * randn(hidden, dtype=torch.float32)).to(dtype)
    Vqkv = randn(50, hidden, dtype=dtype, scale=hidden ** -0.5)
    Uq, Uk, Uv = (randn(n * D, 50 // 3 + (i == 0) * 2, dtype=dtype) for i, n in enumerate((H, H_kv, H_kv)))
    cos, sin = rope_tables(S_max, D)
    seqlens = torch.randint(0, S_max, (B,), dtype=torch.int32, device=DEVICE)
    kc, vc = randn(B, S_max, H_kv, D, dtype=dtype), randn(B, S_max, H_kv, D, dtype=dtype)
    k64, v64, kb, vb = *to64(kc, vc), kc.clone(), vc.clone()
    q = nan_like((B, H, D), dtype)
    qkv_rope(x, (Vqkv.float() * g.float()).to(dtype), Uq, Uk, Uv, cos, sin, kc, vc, seqlens, q_out=q, norm_eps=eps)
    x64 = x.double()
    xn = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    xb = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * g.float()).to(dtype)
    q64 = qkv_rope_ref(xn, *to64(Vqkv, Uq, Uk, Uv, cos, sin), k64, v64, seqlens)
    qb = qkv_rope_ref(xb, Vqkv, Uq, Uk, Uv, cos, sin, kb, vb, seqlens)
    assert_close(q, q64, qb, f"qkv_rope norm B={B} seed={seed} (q)")
    rows, pos = torch.arange(B, device=DEVICE), seqlens.long()
    assert_close(kc[rows, pos], k64[rows, pos], kb[rows, pos], f"qkv_rope norm B={B} seed={seed} (k)")
