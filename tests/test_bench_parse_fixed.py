"""bench/parse_fixed.py: the per-token mask gradient summed over tokens is the gradient of a mask shared by the
window's tokens (taken through FactorizedLinear's own mask), every fixed subset keeps K components a matrix, static is
the first K and swap-N keeps K - N of them, the pool's forwards are restored, and the CLI refuses bad input. Uses a
small svd-llm pool of the bundled stories260K.
Run alone: python -m pytest -q tests/test_bench_parse_fixed.py"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rankserve.bench import parse_fixed
from rankserve.bench.parse_fixed import fixed_masks, sensitivities
from rankserve.bench.parse_oracle import score, summarize
from rankserve.compress.parse import build_pool
from rankserve.workers.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    pool, k, r_max = build_pool(STORIES, "svd-llm", 0.6, CALIB, 2.0, calib_tokens=2048, calib_seq_len=128,
                                progress=False)
    pool.requires_grad_(False)
    dense, _ = load_checkpoint(STORIES, "cpu", torch.float32)
    dense.requires_grad_(False)
    x = torch.randint(3, pool.cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    x[:, 0] = 1  # BOS
    return pool, dense, k, r_max, x


def test_summed_token_gradients_are_the_shared_mask_gradient(setup):
    pool, dense, k, r_max, x = setup
    with torch.no_grad():
        before = pool(x)
    sens = sensitivities(pool, dense, k, x, batch=len(x))
    with torch.no_grad():
        assert torch.equal(pool(x), before)  # forwards restored
    lins = pool.projections()
    masks = {n: (torch.arange(r_max[n]) < k[n]).float().expand(len(x), -1).clone().requires_grad_(True) for n in k}
    try:
        for n, m in masks.items():
            lins[n].mask = m  # (B, r_max): one mask for every token of a window
        ref = F.log_softmax(dense(x), -1)
        lp = F.log_softmax(pool(x), -1)
        (ref.exp() * (ref - lp)).sum(-1).mean().backward()
    finally:
        for n in k:
            lins[n].mask = None
    for n in k:
        want = masks[n].grad.double().sum(0)
        assert torch.allclose(sens["grad"][n], want, rtol=1e-4, atol=1e-7)
        assert (sens["fisher"][n] >= 0).all() and (sens["energy"][n] > 0).all()
        assert sens["fisher"][n].sum() > 0


def test_fixed_subsets_keep_k_components(setup):
    pool, dense, k, r_max, x = setup
    sens = sensitivities(pool, dense, k, x, batch=2)
    for c in ("static", *parse_fixed.SCORES, "swap-1", "swap-3"):
        masks = fixed_masks(sens, k, r_max, c)
        for n in k:
            assert masks[n].shape == (r_max[n],) and masks[n].sum() == k[n]
            assert set(masks[n].unique().tolist()) <= {0.0, 1.0}
            if c == "static":
                assert masks[n][:k[n]].sum() == k[n]
            if c.startswith("swap-"):
                assert masks[n][:k[n]].sum() == k[n] - min(int(c[5:]), r_max[n] - k[n])
    g = sens["grad"]
    n = next(iter(k))
    first = fixed_masks(sens, k, r_max, "first-order")[n]
    assert g[n][first.bool()].max() <= g[n][~first.bool()].min()  # the K of smallest summed gradient
    with pytest.raises(ValueError, match="unknown config"):
        fixed_masks(sens, k, r_max, "best")


def test_cli_refuses_bad_input(tmp_path, capsys):
    assert parse_fixed.main(["--calib", str(tmp_path / "none.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert parse_fixed.main(["--calib", str(CALIB), "--swaps", "0"]) == 2
    assert parse_fixed.main(["--calib", str(CALIB), "--model", str(STORIES), "--windows", "100000"]) == 2
    assert "windows of 256" in capsys.readouterr().err


def test_evaluate_scores_each_subset_as_the_oracle_scores_its_masks(setup):
    pool, dense, k, r_max, x = setup
    sens = sensitivities(pool, dense, k, x, batch=2)
    configs = {c: fixed_masks(sens, k, r_max, c) for c in ("static", "fisher")}
    got = parse_fixed.evaluate(pool, dense, x, configs, 4, 2, "test")  # batches of 2 and 1 (broadcast mask)
    with torch.no_grad():
        ref = F.log_softmax(dense(x), -1)[:, 3:-1]
    for c, masks in configs.items():
        per = score(pool, {n: m.expand(len(x), -1).clone() for n, m in masks.items()}, x, ref, 4)
        want = summarize({c: per, "static": per}, x.shape[1] - 4)[c]
        assert got[c]["perplexity"] == pytest.approx(want["perplexity"], rel=1e-5)
        assert got[c]["top1_agreement"] == want["top1_agreement"]
    assert all(lin.mask is None for lin in pool.projections().values())
