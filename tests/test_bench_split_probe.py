"""The split-K plans the per-kernel step's probe compares (bench/split_probe.py), as plain arithmetic. Run alone:
    python -P -m pytest -q tests/test_bench_split_probe.py
"""

import pytest

from rankserve.bench.split_probe import ceil_split_k, floor_split_k, main
from rankserve.kernels.lowrank_linear import gemv_config


def test_floor_never_deals_more_programs_than_the_gpu_has():
    # svd-llm 0.6 at the 7B shape, B = 8: o V has 1232 rows in 16-row blocks (77), down V 1792 (112)
    assert ceil_split_k(8, 1232, 4096, True, 132, 1) == 2  # 154 programs for 132 SMs
    assert floor_split_k(8, 1232, 4096, True, 132, 1) == 1
    assert ceil_split_k(8, 1232, 4096, True, 132, 2) == 4  # 308 for 264
    assert floor_split_k(8, 1232, 4096, True, 132, 2) == 3  # 231
    for N in range(16, 4096, 48):
        for waves in (1, 2):
            n = floor_split_k(8, N, 4096, True, 132, waves)
            blocks = -(-N // gemv_config(8, N, True, 4096)[0])
            assert n >= 1 and (n == 1 or blocks * n <= waves * 132)


def test_both_plans_leave_b1_and_unaligned_reductions_whole():
    for fn in (ceil_split_k, floor_split_k):
        assert fn(1, 1232, 4096, True, 132, 1) == 1
        assert fn(8, 1232, 4100, True, 132, 1) == 1
        assert fn(8, 1232, 4096, True, 132, 0) == 1


@pytest.mark.parametrize("cases", [["svd-llm:0.6:128:1"]])
def test_cli_refuses_batch_one(cases, tmp_path, capsys):
    assert main(["--device", "cpu", "--cases", *cases, "--out", str(tmp_path / "sp.json")]) == 2
    assert "batch > 1" in capsys.readouterr().err
