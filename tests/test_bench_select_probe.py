"""bench/select_probe.py: the probe kernel computes each layer's (W ⊙ keep) x under the interpreter, with and without
a block mask and with a short last block; the sm90 build keeps the weight stream in 16-byte cp.async copies with the
mask on; the CLI refuses bad input and renders a result.
Run alone: python -m pytest -q tests/test_bench_select_probe.py"""

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from rankserve.bench import select_probe
from rankserve.bench.select_probe import SEL, pool_rank, random_keep, reference, run


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("width", [200, 256, 64])  # a short last block, whole blocks, one tile
def test_kernel_matches_torch(masked, width):
    g = torch.Generator().manual_seed(0)
    layers, n = 3, 20
    w = torch.randn(layers * n, width, generator=g).to(torch.bfloat16)
    x = torch.randn(width, generator=g)
    nb = -(-width // SEL)
    keep = random_keep(layers, nb, min(2, nb), g, "cpu") if masked else None
    y = run(w, x, keep, layers, block_n=8, nbk=2, stages=2, programs=5)
    ref = reference(w, x, keep, layers)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4)
    if masked:  # the left-out blocks count for nothing: the same as zeroing their columns
        wz = w.float().view(layers, n, width) * keep.float().repeat_interleave(SEL, 1)[:, None, :width]
        assert torch.allclose(y, (wz @ x).reshape(-1), rtol=1e-4, atol=1e-4)
        if nb > 2:
            assert not torch.allclose(y, reference(w, x, None, layers), atol=1e-2)
    with pytest.raises(ValueError, match="keep"):
        run(w, x, torch.ones(layers, 7, dtype=torch.int8), layers, 8, 2, 2, 5)
    with pytest.raises(ValueError, match="at most 4 tiles"):
        run(torch.zeros(layers * n, 300), torch.zeros(300), None, layers, 8, 1, 2, 5)  # 5 tiles of 64 columns


def test_helpers():
    assert pool_rank(1232) == 1600 and pool_rank(1792) == 2240 and pool_rank(64, 1.0) == 64
    keep = random_keep(4, 25, 19, torch.Generator().manual_seed(1), "cpu")
    assert keep.shape == (4, 25) and keep.dtype == torch.int8 and (keep.sum(1) == 19).all()
    assert len({tuple(r.tolist()) for r in keep}) > 1  # each layer its own choice


def compile_ptx(transposed: bool = False) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kern = select_probe._transposed_kernel if transposed else select_probe._select_kernel
    names = list(inspect.signature(kern.fn).parameters)
    consts = (dict(BLOCK_O=128, CH=64, STAGES=3, MASKED=False, GATHER=True) if transposed
              else dict(BLOCK_N=16, NBK=8, SEL=64, STAGES=3, MASKED=True, TILES=4))
    ptrs = {"w_ptr": "*bf16", "x_ptr": "*fp32", "c_ptr": "*fp32", "keep_ptr": "*i8", "idx_ptr": "*i32",
            "y_ptr": "*fp32"}
    sig = {n: ptrs.get(n, "i32") for n in names if n not in consts}
    sig.update({n: "constexpr" for n in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs if n in names}
    attrs[(names.index("N" if transposed else "K"),)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(kern, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3})
    return k.asm["ptx"]


def test_sm90_build_keeps_16_byte_async_copies_under_the_mask():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; sys.path.insert(0, 'tests'); import test_bench_select_probe as t; "
            "print(repr([t.compile_ptx(False), t.compile_ptx(True)]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, f"offline sm90 compile failed:\n{out.stderr[-3000:]}"
    for ptx in eval(out.stdout.strip().splitlines()[-1]):  # noqa: S307 (our own repr)
        copies = [l for l in ptx.splitlines() if "cp.async.cg.shared.global" in l]
        assert len(copies) >= 16 and all("], 0x10, %r" in l for l in copies), copies[:4]  # 16 bytes, a src-size


def test_cli(tmp_path, capsys):
    assert select_probe.main(["--factor", "0.5"]) == 2
    if not torch.cuda.is_available():
        assert select_probe.main(["--out", str(tmp_path / "p.json")]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    rows = [dict(case="o U", variant="static", read=1232, width=1232, ms=0.10, TB_s=3.2, of_copy_bw=0.78),
            dict(case="o U", variant="select", read=1216, width=1600, ms=0.11, TB_s=2.9, of_copy_bw=0.70),
            dict(case="o U", variant="head", error="boom")]
    res = dict(gpu="NVIDIA H200", triton="3.6.0", copy_bw=4.1e12, programs=264, stages=3, rows=rows)
    md = select_probe.markdown(res)
    assert "| o U | select | 1216 of 1600 | 0.1100 | 2.90 | 70% | 1.100x |" in md and "| o U | head | | error" in md
    (tmp_path / "r.json").write_text(json.dumps(res))
    assert select_probe.main(["--markdown", str(tmp_path / "r.json")]) == 0
    assert "NVIDIA H200" in capsys.readouterr().out


@pytest.mark.parametrize("masked", [False, True])
def test_transposed_kernel_matches_torch(masked):
    g = torch.Generator().manual_seed(3)
    layers, R, N = 2, 150, 40  # 3 chunks of 64 (the last short), 3 tiles of 16 outputs (the last short)
    wt = torch.randn(layers * R, N, generator=g).to(torch.bfloat16)
    c = torch.randn(R, generator=g)
    keep = (torch.rand(layers, R, generator=g) < 0.5).to(torch.int8) if masked else None
    y = select_probe.run_transposed(wt, c, keep, layers, block_o=16, ch=64, stages=2, programs=7)
    want = select_probe.reference_transposed(wt, c, keep, layers)
    assert torch.allclose(y, want, rtol=1e-4, atol=1e-4)
    y2 = select_probe.run_transposed(wt, c, keep, layers, 16, 64, 2, 7, y)  # y is reset, not added to
    assert torch.allclose(y2, want, rtol=1e-4, atol=1e-4)
    if masked:
        dense = (wt.float().view(layers, R, N) * (c * keep.float())[..., None]).sum(1).reshape(-1)
        assert torch.allclose(y, dense, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="one a chunk"):
        select_probe.run_transposed(wt, c, keep, layers, 16, 64, 2, 2)
    with pytest.raises(ValueError, match="keep"):
        select_probe.run_transposed(wt, c, torch.ones(layers, 3, dtype=torch.int8), layers, 16, 64, 2, 7)


def test_transposed_gather_visits_the_kept_rows():
    g = torch.Generator().manual_seed(4)
    layers, R, N = 3, 150, 40
    wt = torch.randn(layers * R, N, generator=g).to(torch.bfloat16)
    c = torch.randn(R, generator=g)
    keep = (torch.rand(layers, R, generator=g).argsort(1) < 70).to(torch.int8)  # 70 rows a layer, 2 chunks
    idx = select_probe.kept_rows(keep)
    assert idx.shape == (layers, 70) and bool((idx[:, 1:] > idx[:, :-1]).all())
    y = select_probe.run_transposed(wt, c, keep, layers, 16, 64, 2, 5, idx=idx)
    assert torch.allclose(y, select_probe.reference_transposed(wt, c, keep, layers), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="idx"):
        select_probe.run_transposed(wt, c, keep, layers, 16, 64, 2, 5, idx=idx.long())
    uneven = keep.clone()
    uneven[0, uneven[0].argmin()] = 1
    with pytest.raises(ValueError, match="as many rows"):
        select_probe.kept_rows(uneven)
