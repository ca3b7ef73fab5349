"""bench/parse_modes.py: the Lloyd fit of the tails (one mode is static's tail; two clusters of tokens using disjoint
components get a tail each), the masks (head plus one tail: K components), the oracle's choice (the tail of most
energy, checked token by token), a full-rank sketch measures the tail energy exactly, the configs leave the pool as
they found it, and the CLI refuses bad input. Uses a small svd-llm pool of the bundled stories260K.
Run alone: python -m pytest -q tests/test_bench_parse_modes.py"""

from pathlib import Path

import pytest
import torch

from rankserve.bench import parse_modes
from rankserve.bench.parse_modes import Modes, fit_all, fit_modes, fit_sketch, mode_forward, selection
from rankserve.compress.parse import build_pool
from rankserve.workers.model import FactorizedLinear

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


def test_one_mode_is_static_tail():
    e2 = torch.rand(50, 12, generator=torch.Generator().manual_seed(0))
    tails = fit_modes(e2, head=5, t=3, modes=1)
    # with one mode every token is assigned to it, so it becomes the 3 components of largest summed energy >= 5
    assert torch.equal(tails[0], (e2[:, 5:].sum(0).topk(3).indices + 5).sort().values)
    with pytest.raises(ValueError, match="tail of"):
        fit_modes(e2, head=5, t=8, modes=2)


def test_two_clusters_get_a_tail_each():
    g = torch.Generator().manual_seed(1)
    e2 = torch.rand(40, 10, generator=g) * 0.01
    e2[:20, [4, 5]] += 1.0  # half the tokens put their energy on components 4, 5; the others on 8, 9
    e2[20:, [8, 9]] += 1.0
    tails = fit_modes(e2, head=2, t=2, modes=2)
    assert sorted(map(tuple, tails.tolist())) == [(4, 5), (8, 9)]
    assert bool((tails >= 2).all()) and all(len(set(t)) == 2 for t in tails.tolist())


def test_masks_and_oracle_choice():
    g = torch.Generator().manual_seed(2)
    lin = FactorizedLinear(6, 9, rank=8)
    with torch.no_grad():
        lin.U.copy_(torch.randn(9, 8, generator=g))
        lin.V.copy_(torch.randn(8, 6, generator=g))
        md = Modes(head=3, tails=torch.tensor([[3, 4], [5, 7], [6, 7]]))
        masks = md.masks(8)
        assert masks.shape == (3, 8) and bool((masks.sum(1) == 5).all()) and bool((masks[:, :3] == 1).all())
        x = torch.randn(4, 5, 6, generator=g)  # (B, S, in)
        counts = torch.zeros(3)
        got = mode_forward(lin, x, md, masks, False, counts)
        assert counts.sum() == 20
        c = x @ lin.V.T
        e2 = (c * lin.U.norm(dim=0)) ** 2
        for b in range(4):
            for s in range(5):
                m = max(range(3), key=lambda i: float(e2[b, s, md.tails[i]].sum()))
                keep = masks[m].bool()
                assert torch.allclose(got[b, s], lin.U[:, keep] @ c[b, s, keep], rtol=1e-5, atol=1e-6)


def test_full_rank_sketch_is_exact():
    g = torch.Generator().manual_seed(3)
    lin = FactorizedLinear(6, 9, rank=8)
    with torch.no_grad():
        lin.U.copy_(torch.randn(9, 8, generator=g))
        lin.V.copy_(torch.randn(8, 6, generator=g))
        x = torch.randn(30, 6, generator=g)
        tails = torch.tensor([[3, 4, 5], [5, 6, 7]])
        sk, bias = fit_sketch(lin, x, tails, s=3)  # s = t: the sketch keeps every direction, and misses nothing
        assert sk.shape == (2, 3, 6) and torch.allclose(bias, torch.zeros(2), atol=1e-4)
        e2 = (x @ lin.V.T * lin.U.norm(dim=0)) ** 2
        for m in range(2):
            assert torch.allclose((x @ sk[m].T).pow(2).sum(1), e2[:, tails[m]].sum(1), rtol=1e-4, atol=1e-5)
        sk1, bias1 = fit_sketch(lin, x, tails, s=1)  # one direction: on the fitting tokens the mean is still right
        for m in range(2):
            est = (x @ sk1[m].T).pow(2).sum(1) + bias1[m]
            assert float(est.mean()) == pytest.approx(float(e2[:, tails[m]].sum(1).mean()), rel=1e-4)
            assert float(bias1[m]) > 0
        md = Modes(head=3, tails=tails, sketch=sk, bias=bias)  # so the sketched choice is the oracle's
        masks = md.masks(8)
        a = mode_forward(lin, x, md, masks, True, torch.zeros(2))
        b = mode_forward(lin, x, md, masks, False, torch.zeros(2))
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_configs_on_a_pool_restore_it():
    torch.manual_seed(0)
    model, k, r_max = build_pool(STORIES, "svd-llm", 0.6, CALIB, 2.0, calib_tokens=2048, calib_seq_len=128,
                                 progress=False)
    x = torch.randint(3, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    x[:, 0] = 1  # BOS
    modes = fit_all(model, k, x, tail_frac=0.25, modes=3, s=2, batch=1)
    lins = model.projections()
    assert set(modes) == set(k)
    for n, md in modes.items():
        t = max(1, round(k[n] * 0.25))
        assert md.head == k[n] - t and md.tails.shape == (3, t) and md.sketch.shape == (3, 2, lins[n].in_features)
        assert md.bias.shape == (3,) and bool((md.bias >= -1e-4).all())  # a sketch misses energy, never adds it
        assert bool((md.tails >= md.head).all()) and bool((md.tails < r_max[n]).all())
    counts: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        full = model(x)
        with selection(model, "static", k, modes, counts):
            static = model(x)
        outs = {}
        for cfg in ("modes-oracle", "modes-sketch", "token-energy"):
            with selection(model, cfg, k, modes, counts):
                outs[cfg] = model(x)
            assert not torch.allclose(outs[cfg], full, atol=1e-3)
        assert not torch.allclose(outs["modes-oracle"], static, atol=1e-3)
        assert all(float(v.sum()) == 24 for v in counts.values())  # every token chose once a matrix
        with pytest.raises(ValueError, match="unknown config"):
            with selection(model, "nope", k, modes, counts):
                pass
        assert torch.equal(model(x), full)
    assert all(lin.live is None and "forward" not in lin.__dict__ for lin in lins.values())


def test_cli_refuses_bad_input(capsys, tmp_path):
    assert parse_modes.main(["--calib", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert parse_modes.main(["--calib", str(CALIB), "--tail", "1.5"]) == 2
    assert parse_modes.main(["--calib", str(CALIB), "--modes", "0"]) == 2
    with pytest.raises(SystemExit):
        parse_modes.main(["--configs", "bogus"])
