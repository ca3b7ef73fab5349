"""argmax_rows equals torch.argmax, ties resolved to the first maximum. On CPU under TRITON_INTERPRET=1, on the GPU
when there is one. Run alone: .venv/bin/python -m pytest tests/test_kernels_argmax.py -q
"""

import pytest
import torch

from kernel_utils import DEVICE
from rankserve.kernels.argmax import argmax_rows


@pytest.mark.parametrize("B,V", [(1, 53), (3, 1024), (2, 3000), (8, 32000)])
def test_argmax_rows_matches_torch(B, V):
    torch.manual_seed(V)
    x = torch.randn(B, V, device=DEVICE)
    assert argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist()


def test_ties_and_maxima_in_later_tiles_and_strided_rows():
    x = torch.randn(4, 5000, device=DEVICE)  # CPU tiles are 1024 wide: maxima placed in several tiles
    x[0, 10] = x[0, 4000] = 50.0  # tie across tiles: the first wins
    x[1, 4999] = 60.0  # the last element of a partial tile
    x[2, 2047] = x[2, 2048] = 70.0  # tie across a tile boundary
    x[3, 1] = x[3, 2] = 80.0  # tie inside a tile
    buf = torch.zeros(8, 5000, device=DEVICE)[::2]  # rows two apart
    buf.copy_(x)
    out = torch.full((4,), -1, dtype=torch.int32, device=DEVICE)
    argmax_rows(buf, out)
    assert out.tolist() == [10, 4999, 2047, 1] == torch.argmax(x, dim=-1).tolist()
