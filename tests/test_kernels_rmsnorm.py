"""rmsnorm (plain and fused residual add) vs an fp64 reference.

Run alone: .venv/bin/python -m pytest tests/test_kernels_rmsnorm.py  (CPU: Triton interpreter, fp32)
"""

import pytest
from kernel_utils import DTYPES, assert_close, fresh_seed, nan_like, randn, to64

from rankserve.kernels.rmsnorm import rmsnorm, rmsnorm_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("hidden", [64, 300, 4096])
@pytest.mark.parametrize("fused_residual", [False, True])
def test_rmsnorm(B, hidden, fused_residual, dtype):
    seed = fresh_seed()
    eps = 1e-5
    x = randn(B, hidden, dtype=dtype)
    w = randn(hidden, dtype=dtype, scale=0.5) + 1
    res = randn(B, hidden, dtype=dtype) if fused_residual else None
    res64, res_t = (res.double(), res.clone()) if fused_residual else (None, None)
    out = nan_like((B, hidden), dtype)
    what = f"rmsnorm B={B} hidden={hidden} residual={fused_residual} {dtype} seed={seed}"
    rmsnorm(x, w, eps, residual=res, out=out)
    ref64 = rmsnorm_ref(*to64(x, w), eps, residual=res64)
    base = rmsnorm_ref(x, w, eps, residual=res_t)
    assert_close(out, ref64, base, what)
    if fused_residual:
        assert_close(res, res64, res_t, what + " (new residual)")


def test_rmsnorm_in_place():
    seed = fresh_seed()
    dtype = DTYPES[0]
    x = randn(2, 100, dtype=dtype)
    w = randn(100, dtype=dtype)
    ref64 = rmsnorm_ref(*to64(x, w), 1e-6)
    base = rmsnorm_ref(x, w, 1e-6)
    assert rmsnorm(x, w, 1e-6, out=x) is x
    assert_close(x, ref64, base, f"rmsnorm out=x seed={seed}")
