"""bench/parse_pertoken.py: the per-token choice keeps, token by token, the K components of largest output energy
(checked against a brute-force search on orthogonal U), equals the pool at K = r_max, the configs are the intended
truncations and leave the pool as they found it, the bytes-matched rank is the decode-bytes equation's root, and
the CLI refuses bad input. Uses a small svd-llm pool of the bundled stories260K.
Run alone: python -m pytest -q tests/test_bench_parse_pertoken.py"""

import itertools
from pathlib import Path

import pytest
import torch

from rankserve.bench import parse_pertoken
from rankserve.bench.parse_pertoken import bytes_matched_rank, selection, token_topk
from rankserve.compress.parse import build_pool
from rankserve.workers.model import FactorizedLinear

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


@pytest.fixture(scope="module")
def pool():
    torch.manual_seed(0)
    model, k, r_max = build_pool(STORIES, "svd-llm", 0.6, CALIB, 2.0, calib_tokens=2048, calib_seq_len=128,
                                 progress=False)
    x = torch.randint(3, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    x[:, 0] = 1  # BOS
    return model, k, r_max, x


def test_token_topk_is_the_best_k_subset_on_orthogonal_u():
    g = torch.Generator().manual_seed(0)
    lin = FactorizedLinear(5, 7, rank=5)
    with torch.no_grad():
        q, _ = torch.linalg.qr(torch.randn(7, 5, generator=g, dtype=torch.float64))
        lin.U.copy_((q * torch.tensor([3.0, 0.5, 2.0, 1.0, 0.1], dtype=torch.float64)).float())  # orthogonal columns
        lin.V.copy_(torch.randn(5, 5, generator=g))
        x = torch.randn(4, 3, 5, generator=g)  # (B, S, in)
        got = token_topk(lin, x, 2)
        full = lin(x)
        c = x @ lin.V.T  # (B, S, r)
        for b, s in itertools.product(range(4), range(3)):  # every 2-subset: the chosen one has the least error
            errs = {sub: float((full[b, s] - lin.U[:, list(sub)] @ c[b, s, list(sub)]).norm())
                    for sub in itertools.combinations(range(5), 2)}
            assert float((full[b, s] - got[b, s]).norm()) == pytest.approx(min(errs.values()), rel=1e-5, abs=1e-6)
        assert torch.allclose(token_topk(lin, x, 5), full, rtol=1e-5, atol=1e-6)  # K = r: everything


def test_configs_are_the_intended_truncations_and_restore_the_pool(pool):
    model, k, r_max, x = pool
    lins = model.projections()
    with torch.no_grad():
        full = model(x)
        with selection(model, "pool", k):
            assert torch.equal(model(x), full)
        with selection(model, "static", k):
            static = model(x)
            assert all(lins[n].live == k[n] for n in k)
        for n in k:  # static by masks: the first K components
            lins[n].mask = (torch.arange(r_max[n]) < k[n]).float()[None].expand(len(x), -1)
        assert torch.allclose(static, model(x), rtol=1e-5, atol=1e-5)
        for n in k:
            lins[n].mask = None
        with selection(model, "token-energy", k):
            energy = model(x)
        with selection(model, "token-energy", r_max):  # choosing all r_max per token is the pool
            assert torch.allclose(model(x), full, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(energy, static, atol=1e-3) and not torch.allclose(energy, full, atol=1e-3)
        with selection(model, "static-bytes", k):
            assert all(k[n] <= lins[n].live <= r_max[n] for n in k)
        with pytest.raises(ValueError, match="unknown config"):
            with selection(model, "nope", k):
                pass
        assert torch.equal(model(x), full)  # every config leaves the pool as it was
    assert all(lin.live is None and "forward" not in lin.__dict__ for lin in lins.values())


def test_bytes_matched_rank():
    lin = FactorizedLinear(100, 300, rank=80)
    # token-energy reads all 80 rows of V (100 wide) and 40 columns of U (300 tall): 8000 + 12000 = 400 r
    assert bytes_matched_rank(lin, 40) == 50
    assert bytes_matched_rank(lin, 80) == 80  # K = r_max: no choice, no extra bytes
    assert bytes_matched_rank(FactorizedLinear(300, 100, rank=80), 40) == 70
    assert bytes_matched_rank(FactorizedLinear(400, 10, rank=80), 10) == 78  # never past r_max


def test_cli_refuses_bad_input(capsys, tmp_path):
    assert parse_pertoken.main(["--calib", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert parse_pertoken.main(["--calib", str(CALIB), "--windows", "-1"]) == 2
    with pytest.raises(SystemExit):
        parse_pertoken.main(["--configs", "bogus"])


def test_thresholds_keep_k_on_average(pool):
    model, k, r_max, x = pool
    lins = model.projections()
    tau = parse_pertoken.calibrate_thresholds(model, k, x, batch=1)
    assert set(tau) == set(k) and all(t > 0 for t in tau.values())
    assert all(lin.__dict__.get("forward") is None for lin in lins.values())  # the recorders are gone
    kept: dict[str, list[float]] = {}
    with torch.no_grad():
        full = model(x)
        with selection(model, "token-threshold", k, tau, kept):
            got = model(x)
        with selection(model, "token-threshold", k, {n: 0.0 for n in k}, {}):  # nothing below 0: the pool
            assert torch.allclose(model(x), full, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, full, atol=1e-3)
    assert set(kept) == set(k)
    # on the tokens the thresholds were set on, K are kept on average (first matrix: its input is the same)
    first = next(iter(k))
    assert kept[first][0] == pytest.approx(k[first], rel=0.02)
    mean = sum(v[0] / k[n] for n, v in kept.items()) / len(kept)
    assert 0.8 < mean < 1.2  # later matrices see the choice's own outputs, so near K, not exactly
    with pytest.raises(ValueError, match="needs thresholds"):
        with selection(model, "token-threshold", k):
            pass


def test_token_blocks_keep_whole_blocks_of_largest_energy():
    g = torch.Generator().manual_seed(2)
    lin = FactorizedLinear(6, 9, rank=7)  # 7 components in blocks of 3: the last block is short
    with torch.no_grad():
        lin.U.copy_(torch.randn(9, 7, generator=g))
        lin.V.copy_(torch.randn(7, 6, generator=g))
        x = torch.randn(5, 6, generator=g)
        c = x @ lin.V.T
        e2 = (c * lin.U.norm(dim=0)) ** 2
        got = parse_pertoken.token_blocks(lin, x, 3, 3)  # one block of three a token
        for t in range(5):
            sums = [float(e2[t, i:i + 3].sum()) for i in (0, 3, 6)]
            b = max(range(3), key=lambda i: sums[i])
            idx = list(range(3 * b, min(7, 3 * b + 3)))
            assert torch.allclose(got[t], lin.U[:, idx] @ c[t, idx], rtol=1e-5, atol=1e-6)
        assert torch.allclose(parse_pertoken.token_blocks(lin, x, 7, 1), lin(x), rtol=1e-5, atol=1e-6)
        assert torch.allclose(parse_pertoken.token_blocks(lin, x, 2, 1), token_topk(lin, x, 2), rtol=1e-5, atol=1e-6)


def test_reroute_keeps_the_previous_blocks_strongest_components():
    g = torch.Generator().manual_seed(3)
    lin = FactorizedLinear(6, 8, rank=6)
    with torch.no_grad():
        lin.U.copy_(torch.randn(8, 6, generator=g))
        lin.V.copy_(torch.randn(6, 6, generator=g))
        x = torch.randn(2, 7, 6, generator=g)  # (B, S, in): blocks of 3 are positions 0-2, 3-5, 6
        got = parse_pertoken.token_rerouted(lin, x, 2, 3)
        c = x @ lin.V.T  # (B, S, r)
        e2 = (c * lin.U.norm(dim=0)) ** 2
        for b in range(2):
            for s in range(7):
                blk = s // 3
                keep = [0, 1] if blk == 0 else e2[b, 3 * (blk - 1):3 * blk].sum(0).topk(2).indices.tolist()
                want = lin.U[:, keep] @ c[b, s, keep]
                assert torch.allclose(got[b, s], want, rtol=1e-5, atol=1e-5)
        assert torch.allclose(parse_pertoken.token_rerouted(lin, x, 6, 2), lin(x), rtol=1e-5, atol=1e-5)  # K = r


def test_reroute_over_the_whole_window_is_static(pool):
    model, k, r_max, x = pool
    with torch.no_grad():
        with selection(model, "static", k):
            static = model(x)
        with selection(model, f"reroute-{x.shape[1]}", k):  # one block: static's first K throughout
            assert torch.allclose(model(x), static, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="reroute-N"):
        with selection(model, "reroute-0", k):
            pass
