"""lowrank_linear / gemv vs an fp64 reference.

Run alone: .venv/bin/python -m pytest tests/test_kernels_lowrank_linear.py  (CPU: Triton interpreter, fp32)
"""

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, fresh_seed, nan_like, randn, to64

from rankserve.kernels.lowrank_linear import gemv, lowrank_linear, lowrank_linear_ref


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
