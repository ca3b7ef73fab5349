"""bench/rows_sweep.py on the CPU: its config strings and its refusal without a GPU (the sweep itself ran on the
H200: bench/results/rows-sweep-h200-*.json).

Run alone:  .venv/bin/python -m pytest tests/test_bench_rows_sweep.py -q
"""

from __future__ import annotations

import pytest
import torch

from rankserve.bench.rows_sweep import main, parse_config
from rankserve.kernels.step_rows import RowsConfig


def test_configs_are_rows_config_fields():
    assert RowsConfig(*parse_config("2,128,128,16,128,3,4,2,64,128,32,128")) == RowsConfig()
    c = RowsConfig(*parse_config("1,64,128,32,128,3,4"))  # 7 numbers: every U stage takes the U tile
    assert (c.programs_per_sm, c.v, c.u, c.gu, c.qkv, c.min_tiles) == (1, (64, 128), (32, 128), (32, 128), (32, 128), 2)
    for bad in ("2,16,256", "2,16,256,16,128,3,4,2,64"):
        with pytest.raises(ValueError, match="integers wanted"):
            parse_config(bad)
    with pytest.raises(ValueError, match="powers of two"):
        RowsConfig(*parse_config("2,8,256,16,128,3,4"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
