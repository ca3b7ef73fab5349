"""The one-launch step's stage functions (kernels/step_kernel.py) with several programs, each stage on its own.

The whole-step tests (test_fast_decode.py) run the kernel under the CPU interpreter with one program, since a
program there may wait on items of programs the interpreter has not run yet. A stage on its own needs no wait
(target 0, block counters set full), so here P = 3 programs deal its items as on the GPU: interleaved or in
contiguous runs with a remainder, several steps an item, x held in register tiles or read a step, down V's blocks as
partials. Each result is checked against fp64 torch, and each stage's done counter against P.
"""

import pytest
import torch
import triton
import triton.language as tl

from rankserve.kernels.step_kernel import PAD, _down_v_blocks, _gate_up_stage, _gemv_stage, _gu_deal

P = 3  # programs
W = int(PAD.value)  # int32 counters a line apart


@triton.jit
def _gemv_probe(ctr_ptr, x_ptr, w_ptr, y_ptr, N, K, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_ONCE: tl.constexpr, WIL: tl.constexpr,
                PARTS: tl.constexpr, U_TILES: tl.constexpr):
    _gemv_stage(ctr_ptr, tl.program_id(0), tl.num_programs(0), 0, 0, 0, x_ptr, w_ptr, y_ptr, N, K, 1e-6, NORM,
                RESIDUAL, BLOCK_N, BLOCK_K, 1, 0, X_ONCE, WIL, PARTS, U_TILES)


@triton.jit
def _gate_up_probe(ctr_ptr, t_ptr, ug_ptr, uu_ptr, m_ptr, N, rg, ru, blk_ptr, gp_ptr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, BK_BLK: tl.constexpr, SPLIT: tl.constexpr = False):
    _gate_up_stage(ctr_ptr, tl.program_id(0), tl.num_programs(0), 0, 0, 0, t_ptr, ug_ptr, uu_ptr, m_ptr, N, rg, ru,
                   blk_ptr, gp_ptr, BLOCK_N, BLOCK_K, 1, 0, BK_BLK, SPLIT)


@triton.jit
def _down_v_probe(ctr_ptr, blk_ptr, m_ptr, w_ptr, td_ptr, N, K, nk_gu, gp_ptr, BN_GU: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr = False):
    _down_v_blocks(ctr_ptr, blk_ptr, tl.program_id(0), tl.num_programs(0), 0, m_ptr, w_ptr, td_ptr, N, K, nk_gu,
                   gp_ptr, BN_GU, BLOCK_N, BLOCK_K, 1, SPLIT)


@triton.jit
def _deal_probe(out_ptr, n, nk, SPLIT: tl.constexpr):
    r = tl.program_id(0)
    first, mine, piece, cut = _gu_deal(n, nk, r, tl.num_programs(0), SPLIT)
    tl.store(out_ptr + 4 * r, first)
    tl.store(out_ptr + 4 * r + 1, mine)
    tl.store(out_ptr + 4 * r + 2, piece)
    tl.store(out_ptr + 4 * r + 3, cut)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 kernels against an fp64 reference: a tolerance of fp32's own error over these short sums."""
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def _done(ctr: torch.Tensor) -> int:
    return int(ctr[W])  # stage 0's done counter


@pytest.mark.parametrize("mode", ["per_step", "x_once", "x_once_wait_in_loop", "u_tiles", "u_tiles_wait_in_loop",
                                  "parts", "parts_u_tiles"])
def test_gemv_stage_over_programs(mode):
    """y (+)= W x over 37 rows in items of 4 dealt to 3 programs (round robin), K = 50 in 16-column steps or one
    64-column tile (x_once); x held in 4 register tiles (u_tiles) or summed from 3 stacked parts (down V's partials);
    RMSNorm folded in where the stage has it, a residual add where it has that."""
    torch.manual_seed(0)
    N, K = 37, 50
    x_once = mode.startswith("x_once")
    parts = 3 if mode.startswith("parts") else 1
    u_tiles = 4 if "u_tiles" in mode else 0
    norm, residual = x_once, not x_once
    w = torch.randn(N, K)
    xs = torch.randn(parts, K)
    y0 = torch.randn(N)
    y = y0.clone()
    ctr = torch.zeros(4 * W, dtype=torch.int32)
    _gemv_probe[(P,)](ctr, xs.reshape(-1), w, y, N, K, NORM=norm, RESIDUAL=residual, BLOCK_N=4,
                      BLOCK_K=64 if x_once else 16, X_ONCE=x_once, WIL=mode.endswith("wait_in_loop"), PARTS=parts,
                      U_TILES=u_tiles)
    x = xs.double().sum(0)
    ref = w.double() @ x
    if norm:
        ref = ref / torch.sqrt((x * x).mean() + 1e-6)
    if residual:
        ref = ref + y0.double()
    _close(y, ref)
    assert _done(ctr) == P


@pytest.mark.parametrize("runs", [False, True])
def test_gate_up_stage_over_programs(runs):
    """m = silu(Ug t_g) * (Uu t_u) over 42 rows in items of 4 (11 items: 3 programs, two with a fourth), ranks 13
    and 9 in 8-column steps; in contiguous runs (runs) each block of 8 rows of m counted once all its items are
    written."""
    torch.manual_seed(1)
    N, rg, ru = 42, 13, 9
    ug, uu = torch.randn(N, rg), torch.randn(N, ru)
    t = torch.randn(rg + ru)
    m = torch.zeros(N)
    ctr = torch.zeros(4 * W, dtype=torch.int32)
    blk = torch.zeros(6 * W, dtype=torch.int32)
    _gate_up_probe[(P,)](ctr, t, ug, uu, m, N, rg, ru, blk, torch.zeros(1), BLOCK_N=4, BLOCK_K=8,
                         BK_BLK=8 if runs else 0)
    g = ug.double() @ t[:rg].double()
    ref = g * torch.sigmoid(g) * (uu.double() @ t[rg:].double())
    _close(m, ref)
    assert _done(ctr) == P
    counts = blk.view(-1, W)[:, 0].tolist()
    # 42 rows in blocks of 8: five full blocks (2 items each) and 2 rows (one item), counted in steps (2 an item);
    # no counting without runs
    assert counts == ([4, 4, 4, 4, 4, 2] if runs else [0] * 6)


def test_down_v_blocks_over_programs():
    """td = W m by (column block of 16, 2 rows) items over 3 programs, blocks visited from the second on: each block's
    partial stored apart (td[c * N + n])."""
    torch.manual_seed(2)
    N, K = 10, 40  # 3 column blocks, the last half full
    w, m = torch.randn(N, K), torch.randn(K)
    ctr = torch.zeros(4 * W, dtype=torch.int32)
    blk = torch.zeros(3 * W, dtype=torch.int32)
    # gate/up U's items of 4 rows, 3 steps each, all done
    blk.view(-1, W)[:, 0] = torch.tensor([12, 12, 6], dtype=torch.int32)
    td = torch.zeros(3 * N)
    _down_v_probe[(P,)](ctr, blk, m, w, td, N, K, 3, torch.zeros(1), BN_GU=4, BLOCK_N=2, BLOCK_K=16)
    for c in range(3):
        cols = slice(16 * c, min(16 * c + 16, K))
        _close(td[c * N:(c + 1) * N], w[:, cols].double() @ m[cols].double())
    assert _done(ctr) == P


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("n,nk,programs", [(1376, 2, 264), (1376, 1, 264), (11, 2, 3), (10, 2, 3), (10, 3, 3),
                                           (7, 2, 8), (512, 2, 264), (1376, 4, 264)])
def test_gate_up_deal_covers_every_step_once(n, nk, programs, split):
    """_gu_deal: every (item, step) of gate/up U taken by exactly one program; with split, when the left-over items'
    steps fit one a program, the busiest program does at most one step more than the least busy (else one item)."""
    out = torch.zeros(programs * 4, dtype=torch.int32)
    _deal_probe[(programs,)](out, n, nk, SPLIT=split)
    deal = out.view(programs, 4).tolist()
    taken = torch.zeros(n, nk, dtype=torch.int32)
    for r, (first, mine, piece, cut) in enumerate(deal):
        taken[first:first + mine] += 1
        if piece:
            assert r // nk < cut
            taken[r // nk, r % nk] += 1
    assert taken.eq(1).all()
    steps = [mine * nk + piece for _, mine, piece, _ in deal]
    e = n % programs
    cuts = split and nk > 1 and e * nk <= programs
    assert {c for *_, c in deal} == {e if cuts else 0}
    assert max(steps) - min(steps) == ((1 if 0 < e * nk < programs else 0) if cuts else (nk if e else 0))


def test_gate_up_pieces_through_down_v():
    """gate/up U with its left-over item cut into steps (10 items of 4 rows, 2 steps each, 3 programs: item 0 in two
    pieces), then down V reading m by blocks: item 0's rows come from the pieces' partials (m's rows there left NaN),
    and td is bitwise what the same stages give without the cut."""
    torch.manual_seed(3)
    N, rg, ru, Nd = 40, 13, 9, 6
    ug, uu, t = torch.randn(N, rg), torch.randn(N, ru), torch.randn(rg + ru)
    wd = torch.randn(Nd, N)
    out = {}
    for split in (False, True):
        m = torch.full((N,), float("nan"))
        gp = torch.zeros(P * 2 * 4)
        ctr = torch.zeros(4 * W, dtype=torch.int32)
        blk = torch.zeros(3 * W, dtype=torch.int32)
        _gate_up_probe[(P,)](ctr, t, ug, uu, m, N, rg, ru, blk, gp, BLOCK_N=4, BLOCK_K=8, BK_BLK=16, SPLIT=split)
        assert blk.view(-1, W)[:, 0].tolist() == [8, 8, 4]  # steps of each 16-row block of m, all counted
        assert m[:4].isnan().all() == split  # item 0 (rows 0-3) was cut: its m rows never written
        td = torch.zeros(3 * Nd)
        ctr2 = torch.zeros(4 * W, dtype=torch.int32)
        _down_v_probe[(P,)](ctr2, blk, m, wd, td, Nd, N, 2, gp, BN_GU=4, BLOCK_N=2, BLOCK_K=16, SPLIT=split)
        out[split] = td
    g = ug.double() @ t[:rg].double()
    m_ref = g * torch.sigmoid(g) * (uu.double() @ t[rg:].double())
    ref = sum(wd[:, 16 * c:16 * c + 16].double() @ m_ref[16 * c:16 * c + 16] for c in range(3))
    _close(out[True].view(3, Nd).sum(0), ref)
    assert torch.equal(out[True], out[False])
