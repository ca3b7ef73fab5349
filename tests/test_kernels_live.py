"""PARSE slot options of the decode kernels: `keep` masks and device-side live widths (`klive`).

A slot stores the batch's union of components first; components at and beyond the live width are padding that
no row keeps. The kernels must give exactly the masked product over the union, without reading the padding
beyond the live width rounded up to 16: here those factors are NaN, so any read of them would poison the
output. Ranks are multiples of 16, as the slots make them (the kernels promise the compiler 16-wide masks).

Run alone: .venv/bin/python -m pytest tests/test_kernels_live.py  (CPU: Triton interpreter, fp32)
"""

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, fresh_seed, nan_like, randn, rope_tables, to64

from rankserve.kernels.gate_up import gate_up
from rankserve.kernels.lowrank_linear import lowrank_linear, lowrank_linear_ref
from rankserve.kernels.qkv_rope import qkv_rope, qkv_rope_ref


def _keep(B: int, r: int, live: int) -> torch.Tensor:
    """(B, r) 0/1: each row keeps a random part of the first `live` components, nothing beyond."""
    keep = (torch.rand(B, r, device=DEVICE) < 0.6).float()
    keep[:, live:] = 0
    keep[0, :live] = 1  # some row keeps every live component (the union is exactly the first `live`)
    return keep


def _poison(V: torch.Tensor, U: torch.Tensor, live: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of V (r, in) and U (out, r) with the components the kernels may skip set to NaN: those from `live`
    rounded up to 16 on (the kernels read whole groups of 16 components; the slots' padding is masked out)."""
    V, U = V.clone(), U.clone()
    skip = -(-live // 16) * 16
    V[skip:] = float("nan")
    U[:, skip:] = float("nan")
    return V, U


def _live(*n: int) -> torch.Tensor:
    return torch.tensor(n, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [2, 8])
@pytest.mark.parametrize("d_in, r, live, d_out", [(96, 64, 37, 80), (128, 80, 80, 50), (70, 48, 16, 33),
                                                   (64, 96, 50, 40)])
def test_lowrank_linear_keep_live(B, d_in, r, live, d_out, dtype):
    seed = fresh_seed()
    x = randn(B, d_in, dtype=dtype)
    V = randn(r, d_in, dtype=dtype, scale=d_in ** -0.5)
    U = randn(d_out, r, dtype=dtype, scale=r ** -0.5)
    keep = _keep(B, r, live)
    Vp, Up = _poison(V, U, live)
    y, t = nan_like((B, d_out), dtype), nan_like((B, r), torch.float32)
    lowrank_linear(x, Vp, Up, out=y, t=t, keep=keep.to(dtype), klive=_live(live))
    # reference: the union's factors, each row's own components
    x64, V64, U64 = to64(x, V[:live], U[:, :live])
    ref64 = ((x64 @ V64.T) * keep[:, :live].double()) @ U64.T
    base = ((x @ V[:live].T) * keep[:, :live].to(dtype)) @ U[:, :live].T
    what = f"lowrank_linear keep+klive B={B} in={d_in} r={r} live={live} out={d_out} {dtype} seed={seed}"
    assert_close(y, ref64, base, what)


@pytest.mark.parametrize("B", [1, 4])
def test_lowrank_linear_klive_full_width_is_plain(B):
    """klive >= r reads everything: the same result as no klive."""
    seed = fresh_seed()
    dtype = DTYPES[0]
    x, V, U = randn(B, 64, dtype=dtype), randn(48, 64, dtype=dtype, scale=0.125), randn(40, 48, dtype=dtype, scale=0.14)
    y = lowrank_linear(x, V, U, klive=_live(1000))
    assert_close(y, lowrank_linear_ref(*to64(x, V, U)), lowrank_linear_ref(x, V, U), f"klive wide seed={seed}")


def _t(B: int, r: int, split: int) -> torch.Tensor:
    """The V stage's fp32 scratch: NaN (every element must be written) or, for split-K, the zeros it adds into."""
    return nan_like((B, r), torch.float32) if split == 1 else torch.zeros(B, r, device=DEVICE)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [2, 5])
def test_qkv_rope_keep_live(B, dtype, split):
    seed = fresh_seed()
    hidden, H, H_kv, D, S_max = 128, 4, 2, 16, 12
    (rq, lq), (rk, lk), (rv, lv) = (48, 30), (32, 32), (64, 9)
    x = randn(B, hidden, dtype=dtype)
    Vs = [randn(r, hidden, dtype=dtype, scale=hidden ** -0.5) for r in (rq, rk, rv)]
    Us = [randn(n * D, r, dtype=dtype, scale=r ** -0.5) for n, r in ((H, rq), (H_kv, rk), (H_kv, rv))]
    keeps = [_keep(B, r, l) for r, l in ((rq, lq), (rk, lk), (rv, lv))]
    poisoned = [_poison(V, U, l) for V, U, l in zip(Vs, Us, (lq, lk, lv))]
    cos, sin = rope_tables(S_max, D)
    cache_seqlens = torch.randint(0, S_max, (B,), dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = randn(B, S_max, H_kv, D, dtype=dtype), randn(B, S_max, H_kv, D, dtype=dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = nan_like((B, H, D), dtype)
    qkv_rope(x, torch.cat([p[0] for p in poisoned]), *(p[1] for p in poisoned), cos, sin, k_cache, v_cache,
             cache_seqlens, q_out=q, t=_t(B, rq + rk + rv, split),
             keep=torch.cat(keeps, dim=1).to(dtype), klive=_live(lq, lk, lv), split=split)
    # reference: fold each row's mask into x's projection by running the reference once per row on masked factors
    rows, pos = torch.arange(B, device=DEVICE), cache_seqlens.long()
    what = f"qkv_rope keep+klive B={B} {dtype} split={split} seed={seed}"
    refs = {name: ([], []) for name in ("q", "k", "v")}  # per row (fp64 reference, torch in dtype), then stacked
    for b in range(B):
        Vb = [V * kp[b, :, None].to(dtype) for V, kp in zip(Vs, keeps)]  # the row's components only
        k64, v64 = to64(k0[b:b + 1].clone(), v0[b:b + 1].clone())
        q64 = qkv_rope_ref(*to64(x[b:b + 1], torch.cat(Vb), *Us, cos, sin), k64, v64, cache_seqlens[b:b + 1])
        kb, vb = k0[b:b + 1].clone(), v0[b:b + 1].clone()
        qb = qkv_rope_ref(x[b:b + 1], torch.cat(Vb), *Us, cos, sin, kb, vb, cache_seqlens[b:b + 1])
        p = pos[b:b + 1]
        for name, r64, rb in (("q", q64, qb), ("k", k64[:, p], kb[:, p]), ("v", v64[:, p], vb[:, p])):
            refs[name][0].append(r64)
            refs[name][1].append(rb)
    assert_close(q, torch.cat(refs["q"][0]), torch.cat(refs["q"][1]), what + " (q)")
    assert_close(k_cache[rows, pos][:, None], torch.cat(refs["k"][0]), torch.cat(refs["k"][1]), what + " (new k)")
    assert_close(v_cache[rows, pos][:, None], torch.cat(refs["v"][0]), torch.cat(refs["v"][1]), what + " (new v)")
    assert torch.isfinite(k_cache[rows, pos]).all() and torch.isfinite(v_cache[rows, pos]).all()


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [2, 8])
def test_gate_up_keep_live(B, dtype, split):
    seed = fresh_seed()
    hidden, inter, (rg, lg), (ru, lu) = 128, 160, (48, 23), (64, 64)
    x = randn(B, hidden, dtype=dtype)
    Vg, Vu = randn(rg, hidden, dtype=dtype, scale=hidden ** -0.5), randn(ru, hidden, dtype=dtype, scale=hidden ** -0.5)
    Ug, Uu = randn(inter, rg, dtype=dtype, scale=2 * rg ** -0.5), randn(inter, ru, dtype=dtype, scale=ru ** -0.5)
    kg, ku = _keep(B, rg, lg), _keep(B, ru, lu)
    (Vgp, Ugp), (Vup, Uup) = _poison(Vg, Ug, lg), _poison(Vu, Uu, lu)
    h = nan_like((B, inter), dtype)
    gate_up(x, torch.cat([Vgp, Vup]), Ugp, Uup, out=h, t=_t(B, rg + ru, split),
            keep=torch.cat([kg, ku], dim=1).to(dtype), klive=_live(lg, lu), split=split)
    keep = torch.cat([kg, ku], dim=1)

    def ref(x, Vgu, Ug, Uu, keep):  # each row's own components: the masked rank vector, as the kernel computes it
        t = (x @ Vgu.T) * keep  # (B, rg + ru)
        return torch.nn.functional.silu(t[:, :rg] @ Ug.T) * (t[:, rg:] @ Uu.T)

    Vgu = torch.cat([Vg, Vu])
    # three chained stages (masked t, two U products, SiLU): measured up to 6.9e-7 in fp32 where torch's own error
    # was 1e-7 (1 seed in ~60 over the 4x rule), hence 8 fp32 ulps of slack
    assert_close(h, ref(*to64(x, Vgu, Ug, Uu, keep)), ref(x, Vgu, Ug, Uu, keep.to(dtype)),
                 f"gate_up keep+klive B={B} {dtype} split={split} seed={seed}", slack=8 * torch.finfo(torch.float32).eps)


def test_klive_needs_ranks_in_multiples_of_16():
    x, V, U = randn(2, 32, dtype=DTYPES[0]), randn(40, 32, dtype=DTYPES[0]), randn(24, 40, dtype=DTYPES[0])
    with pytest.raises(AssertionError, match="multiple of 16"):
        lowrank_linear(x, V, U, klive=_live(20))


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("residual", [False, True])
def test_dead_row_block_reads_no_weights_and_writes_zeros(residual, split):
    """A block of V rows (16 on the CPU tiles) that no row keeps is skipped before any weight load: its weights
    (NaN here) never reach the result, and the V stage still writes exact zeros there for the U stage to read."""
    seed = fresh_seed()
    dtype = DTYPES[0]
    B, d_in, r, d_out = 4, 192, 64, 48
    x = randn(B, d_in, dtype=dtype)
    V = randn(r, d_in, dtype=dtype, scale=d_in ** -0.5)
    U = randn(d_out, r, dtype=dtype, scale=r ** -0.5)
    keep = _keep(B, r, r)
    keep[:, 16:32] = 0  # a whole tile of rows nobody keeps, inside the live width
    Vp = V.clone()
    Vp[16:32] = float("nan")
    y0 = randn(B, d_out, dtype=dtype)
    y, t = y0.clone(), _t(B, r, split)
    lowrank_linear(x, Vp, U, out=y, t=t, keep=keep.to(dtype), klive=_live(r), residual=residual, split=split)
    assert torch.equal(t[:, 16:32], torch.zeros(B, 16, device=DEVICE)), "the dead block's V outputs are not zeros"
    x64, V64, U64 = to64(x, V, U)
    ref64 = ((x64 @ V64.T) * keep.double()) @ U64.T
    base = ((x @ V.T) * keep.to(dtype)) @ U.T
    if residual:
        ref64, base = ref64 + y0.double(), base + y0
    assert_close(y, ref64, base, f"dead row block residual={residual} split={split} seed={seed}")
