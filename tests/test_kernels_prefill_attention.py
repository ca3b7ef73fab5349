"""prefill_attention (factorized causal attention, RoPE, KV-cache write) vs an fp64 reference.

Run alone: .venv/bin/python -m pytest tests/test_kernels_prefill_attention.py  (CPU: Triton interpreter, fp32)
"""

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, fresh_seed, nan_like, randn, rope_tables, to64

from rankserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("S, H, H_kv, D, rq, rk, rv", [
    (37, 4, 2, 32, 19, 13, 21),   # GQA, odd S and ranks
    (20, 2, 2, 16, 8, 9, 40),     # MHA, rank > D
    (25, 3, 1, 24, 10, 10, 10),   # MQA, head dim not a power of two
    (100, 2, 1, 32, 20, 12, 16),  # several query blocks on the GPU too (BLOCK_M = 64 there)
])
def test_prefill_attention(B, S, H, H_kv, D, rq, rk, rv, dtype):
    seed = fresh_seed()
    S_max = S + 5
    Pq, Pk, Pv = randn(B, S, rq, dtype=dtype), randn(B, S, rk, dtype=dtype), randn(B, S, rv, dtype=dtype)
    Uq = randn(H, D, rq, dtype=dtype, scale=rq ** -0.5)
    Uk = randn(H_kv, D, rk, dtype=dtype, scale=rk ** -0.5)
    Uv = randn(H_kv, D, rv, dtype=dtype, scale=rv ** -0.5)
    cos, sin = rope_tables(S_max, D)
    seqlens = torch.randint(1, S + 1, (B,), dtype=torch.int32, device=DEVICE)
    seqlens[0] = S
    if B > 2:
        seqlens[2] = 0  # an empty row: all padding
    for b in range(B):  # padding may hold anything: NaN proves it is never read
        for P in (Pq, Pk, Pv):
            P[b, seqlens[b]:] = float("nan")
    out = nan_like((B, S, H, D), dtype)
    k_cache, v_cache = nan_like((B, S_max, H_kv, D), dtype), nan_like((B, S_max, H_kv, D), dtype)

    prefill_attention(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens, k_cache=k_cache, v_cache=v_cache, out=out)

    o64, k64, v64 = prefill_attention_ref(*to64(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin), seqlens)
    ob, kb, vb = prefill_attention_ref(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens)
    what = f"prefill_attention B={B} S={S} H={H} H_kv={H_kv} D={D} r={rq},{rk},{rv} {dtype} seed={seed}"
    assert_close(out, o64, ob, what + " (out)")
    valid = torch.arange(S_max, device=DEVICE)[None, :] < seqlens.long()[:, None]  # (B, S_max)
    assert_close(k_cache[valid], k64[valid[:, :S]], kb[valid[:, :S]], what + " (k cache)")
    assert_close(v_cache[valid], v64[valid[:, :S]], vb[valid[:, :S]], what + " (v cache)")
    assert k_cache[~valid].isnan().all() and v_cache[~valid].isnan().all(), what + ": wrote cache rows >= seqlens[b]"


def test_prefill_attention_without_cache():
    seed = fresh_seed()
    dtype = DTYPES[0]
    B, S, H, H_kv, D, r = 2, 18, 2, 1, 16, 12
    Pq, Pk, Pv = (randn(B, S, r, dtype=dtype) for _ in range(3))
    Uq, Uk, Uv = randn(H, D, r, dtype=dtype), randn(H_kv, D, r, dtype=dtype), randn(H_kv, D, r, dtype=dtype)
    cos, sin = rope_tables(S, D)
    seqlens = torch.tensor([S, 7], dtype=torch.int32, device=DEVICE)
    out = prefill_attention(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens)
    o64 = prefill_attention_ref(*to64(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin), seqlens)[0]
    ob = prefill_attention_ref(Pq, Pk, Pv, Uq, Uk, Uv, cos, sin, seqlens)[0]
    assert_close(out, o64, ob, f"prefill_attention no cache seed={seed}")
