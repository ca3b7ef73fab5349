"""bench/stream_probe.py: the probe kernel computes each layer's W x, through pointer loads and through a tensor
descriptor alike (CPU interpreter, several programs, uneven items and tiles), and the CLI refuses to run without a
GPU. Run alone: python -m pytest -q tests/test_bench_stream_probe.py"""

import pytest
import torch

from rankserve.bench import stream_probe
from rankserve.bench.stream_probe import ProbeCase, check, read, stream


@pytest.mark.parametrize("mode", stream_probe.MODES)
@pytest.mark.parametrize("case", [ProbeCase("V, x once", 24, 64, 2, 64, layers=3),
                                  ProbeCase("U, ragged tiles and items", 40, 48, 16, 32, layers=2)],
                         ids=lambda c: c.name if isinstance(c, ProbeCase) else None)
def test_probe_kernel_computes_w_x_per_layer(case, mode):
    torch.manual_seed(0)
    w = torch.randn(case.layers * case.n, case.k).to(torch.bfloat16)
    x = torch.randn(case.k)
    y = stream(w, x, case, mode, stages=3, programs=5)
    out = torch.full_like(y, float("nan"))
    assert stream(w, x, case, mode, stages=3, programs=5, y=out) is out and torch.equal(out, y)  # timed passes
    ref = w.double() @ x.double()
    torch_err = float(((w.float() @ x) - ref).abs().max() / ref.abs().max())
    assert check(w, x, y) <= 10 * torch_err + 1e-6
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4)


def test_probe_cases_are_the_steps_tiles():
    from rankserve.kernels.step_kernel import StepKernelConfig
    k = StepKernelConfig()
    tiles = {c.name: (c.block_n, c.block_k) for c in stream_probe.CASES}
    assert tiles == {"gate/up V": k.gate_up_v, "gate U": k.gate_up_u, "o U": k.o_u, "q/k/v U": (2 * k.qkv_u[0], k.qkv_u[1]),
                     "down U": k.down_u}


def test_tile_major_stores_each_tile_contiguously():
    case = ProbeCase("u", 5, 7, 2, 4, layers=2)  # ragged rows and columns: padded
    w = torch.arange(2 * 5 * 7, dtype=torch.float32).view(10, 7)
    p = stream_probe.tile_major(w, case)
    assert p.numel() == 2 * 3 * 2 * 2 * 4  # layers x items x tiles of K x rows x columns
    tile = p[(1 * 3 * 2 + 2 * 2 + 1) * 8:][:8].view(2, 4)  # layer 1, item 2 (row 4 only), tile 1 (columns 4-6)
    assert tile[0, :3].tolist() == w[5 + 4, 4:7].tolist() and tile[0, 3] == 0 and (tile[1] == 0).all()


def test_stream_rejects_an_unknown_mode():
    case = ProbeCase("v", 4, 8, 2, 8, layers=1)
    with pytest.raises(ValueError, match="not one of"):
        stream(torch.zeros(4, 8), torch.zeros(8), case, "dma", 3, 1)


def test_probe_cli_needs_a_gpu(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only refusal")
    assert stream_probe.main(["--out", str(tmp_path / "p.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_markdown_has_a_row_per_stage_and_mode_and_marks_errors():
    case = dict(name="o U", n=4096, k=1232, block_n=16, block_k=512, layers=32)
    res = dict(gpu="GPU X", triton="3.6.0", copy_bw=4.2e12, programs=264, rows=[
        dict(case=case, mode="ptr", stages=3, TB_s=2.1, of_copy_bw=0.5),
        dict(case=case, mode="ptr", stages=4, TB_s=2.5, of_copy_bw=0.6),
        dict(case=case, mode="tma", stages=3, error="CompilationError(...)")])
    res["rows"].append(dict(case=case, mode="ptr", stages=3, TB_s=2.2, of_copy_bw=0.52))  # a second round
    md = stream_probe.markdown(res).splitlines()
    assert md[0].startswith("GPU X, triton 3.6.0, copy bandwidth 4.20 TB/s")
    assert md[2] == "| stage (tile) | loads | 3 deep | 4 deep |"
    assert md[4] == "| o U (16 x 512 of 4096 x 1232) | pointer (cp.async) | 2.10 (50%) / 2.20 (52%) | 2.50 (60%) |"
    assert md[5] == "| o U (16 x 512 of 4096 x 1232) | TMA | error |  |"


@pytest.mark.parametrize("contiguous", [True, False])
def test_read_kernel_sums_every_tile_once(contiguous):
    w = torch.randn(7 * 64).to(torch.bfloat16)  # 7 tiles over 3 programs: uneven shares
    out = read(w, 64, stages=3, programs=3, contiguous=contiguous)
    assert torch.allclose(out.sum().double(), w.double().sum(), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="whole tiles"):
        read(w[:100], 64, 3, 3, contiguous)


def test_probe_cli_names_an_unknown_case(capsys):
    assert stream_probe.main(["--cases", "o U", "attention"]) == 2
    assert "unknown case(s) ['attention']" in capsys.readouterr().err
