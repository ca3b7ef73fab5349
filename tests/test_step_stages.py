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

from rankserve.kernels.step_kernel import PAD, _down_v_blocks, _gate_up_stage, _gemv_stage

P = 3  # programs
W = int(PAD.value)  # int32 counters a line apart


@triton.jit
def _gemv_probe(ctr_ptr, x_ptr, w_ptr, y_ptr, N, K, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_ONCE: tl.constexpr, WIL: tl.constexpr,
                PARTS: tl.constexpr, U_TILES: tl.constexpr):
    _gemv_stage(ctr_ptr, tl.program_id(0), tl.num_programs(0), 0, 0, 0, x_ptr, w_ptr, y_ptr, N, K, 1e-6, NORM,
                RESIDUAL, BLOCK_N, BLOCK_K, 1, 0, X_ONCE, WIL, PARTS, U_TILES)


@triton.jit
def _gate_up_probe(ctr_ptr, t_ptr, ug_ptr, uu_ptr, m_ptr, N, rg, ru, blk_ptr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, BK_BLK: tl.constexpr):
    _gate_up_stage(ctr_ptr, tl.program_id(0), tl.num_programs(0), 0, 0, 0, t_ptr, ug_ptr, uu_ptr, m_ptr, N, rg, ru,
                   blk_ptr, BLOCK_N, BLOCK_K, 1, 0, BK_BLK)


@triton.jit
def _down_v_probe(ctr_ptr, blk_ptr, m_ptr, w_ptr, td_ptr, N, K, BN_GU: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    _down_v_blocks(ctr_ptr, blk_ptr, tl.program_id(0), tl.num_programs(0), 0, m_ptr, w_ptr, td_ptr, N, K, BN_GU,
                   BLOCK_N, BLOCK_K, 1)


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
    _gate_up_probe[(P,)](ctr, t, ug, uu, m, N, rg, ru, blk, BLOCK_N=4, BLOCK_K=8, BK_BLK=8 if runs else 0)
    g = ug.double() @ t[:rg].double()
    ref = g * torch.sigmoid(g) * (uu.double() @ t[rg:].double())
    _close(m, ref)
    assert _done(ctr) == P
    counts = blk.view(-1, W)[:, 0].tolist()
    # 42 rows in blocks of 8: five full blocks (2 items each) and 2 rows (one item); no counting without runs
    assert counts == ([2, 2, 2, 2, 2, 1] if runs else [0] * 6)


def test_down_v_blocks_over_programs():
    """td = W m by (column block of 16, 2 rows) items over 3 programs, blocks visited from the second on: each block's
    partial stored apart (td[c * N + n])."""
    torch.manual_seed(2)
    N, K = 10, 40  # 3 column blocks, the last half full
    w, m = torch.randn(N, K), torch.randn(K)
    ctr = torch.zeros(4 * W, dtype=torch.int32)
    blk = torch.zeros(3 * W, dtype=torch.int32)
    blk.view(-1, W)[:, 0] = torch.tensor([4, 4, 2], dtype=torch.int32)  # gate/up U's items of 4 rows, all done
    td = torch.zeros(3 * N)
    _down_v_probe[(P,)](ctr, blk, m, w, td, N, K, BN_GU=4, BLOCK_N=2, BLOCK_K=16)
    for c in range(3):
        cols = slice(16 * c, min(16 * c + 16, K))
        _close(td[c * N:(c + 1) * N], w[:, cols].double() @ m[cols].double())
    assert _done(ctr) == P
