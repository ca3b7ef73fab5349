"""bench/parse_oracle.py: the fitted subsets are K-of-r_max masks, start at static truncation and never end worse
than it on their own objective, score() under static masks is the first-K pool (also over the continuation's last
tokens alone), and the CLI refuses bad input.
Uses a small svd-llm pool of the bundled stories260K. Run alone: python -m pytest -q tests/test_bench_parse_oracle.py"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rankserve.bench import parse_oracle
from rankserve.bench.parse_oracle import OracleConfig, fit, score, static_masks, window_kl
from rankserve.compress.parse import build_pool

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


@pytest.fixture(scope="module")
def pool():
    torch.manual_seed(0)
    model, k, r_max = build_pool(STORIES, "svd-llm", 0.6, CALIB, 2.0, calib_tokens=2048, calib_seq_len=128,
                                 progress=False)
    model.requires_grad_(False)
    from rankserve.workers.checkpoint import load_checkpoint
    dense, _ = load_checkpoint(STORIES, "cpu", torch.float32)
    x = torch.randint(3, dense.cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    x[:, 0] = 1  # BOS
    return model, dense, k, r_max, x


def test_fit_starts_at_static_and_never_ends_worse(pool):
    model, dense, k, r_max, x = pool
    span = slice(7, 23)  # prompt 8: the continuation's positions
    with torch.no_grad():
        ref = F.log_softmax(dense(x), -1)[:, span]
    static = static_masks(k, r_max, len(x))
    masks0, obj0 = fit(model, x, ref, span, k, r_max, OracleConfig(steps=0, prompt_len=8))
    assert all(torch.equal(masks0[n], static[n]) for n in k)  # no step: the static order
    lins = model.projections()
    with torch.no_grad():
        for n, m in static.items():
            lins[n].mask = m
        want = window_kl(ref, model(x)[:, span])
        for n in k:
            lins[n].mask = None
    assert torch.allclose(torch.tensor(obj0), want, rtol=1e-5)
    masks, obj = fit(model, x, ref, span, k, r_max, OracleConfig(steps=6, lr=0.05, prompt_len=8))
    assert all(a <= b + 1e-6 for a, b in zip(obj, obj0))  # the start is kept when nothing beats it
    assert sum(a < b - 1e-6 for a, b in zip(obj, obj0)) >= 1  # and on random tokens something does
    for n in k:
        assert masks[n].shape == (len(x), r_max[n]) and bool((masks[n].sum(1) == k[n]).all())
        assert set(masks[n].unique().tolist()) <= {0.0, 1.0}
    assert all(lin.mask is None for lin in lins.values())  # the pool is left unmasked


def test_score_under_static_masks_is_the_first_k_pool(pool):
    model, dense, k, r_max, x = pool
    with torch.no_grad():
        ref = F.log_softmax(dense(x), -1)[:, 7:-1]
    got = score(model, static_masks(k, r_max, len(x)), x, ref, 8)
    lins = model.projections()
    with torch.no_grad():
        for n in k:  # the same truncation by slicing the factors' first K components
            lins[n].mask = torch.cat([torch.ones(k[n]), torch.zeros(r_max[n] - k[n])])[None].expand(len(x), -1)
        lp = F.log_softmax(model(x)[:, 7:-1], -1)
        for n in k:
            lins[n].mask = None
    nll = -lp.gather(-1, x[:, 8:, None])[..., 0].double().mean(1)
    assert torch.allclose(torch.tensor(got["nll"], dtype=torch.float64), nll, rtol=1e-6)
    assert got["agree"] == (lp.argmax(-1) == ref.argmax(-1)).sum(1).tolist()
    summary = parse_oracle.summarize({"static": got, "fit": got}, 16)
    assert summary["fit"]["dnll"] == 0.0 and summary["static"]["windows"] == 3
    both = score(model, static_masks(k, r_max, len(x)), x, ref, 8, late=16)  # the last 16 tokens: all of them
    assert both["late_nll"] == pytest.approx(both["nll"]) and both["late_agree"] == both["agree"]
    part = score(model, static_masks(k, r_max, len(x)), x, ref, 8, late=6)
    late = -lp[:, -6:].gather(-1, x[:, -6:, None])[..., 0].double().mean(1)
    assert torch.allclose(torch.tensor(part["late_nll"], dtype=torch.float64), late, rtol=1e-6)


def test_cli_refuses_bad_input(capsys, tmp_path):
    assert parse_oracle.main(["--steps", "-1"]) == 2
    assert "steps >= 0" in capsys.readouterr().err
    assert parse_oracle.main(["--calib", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="lr > 0"):
        OracleConfig(lr=0)
