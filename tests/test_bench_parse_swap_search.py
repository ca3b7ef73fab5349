"""bench/parse_swap_search.py on the bundled model: a move's bias shift flips the share of windows it names; the
partial forward from a cached layer equals the model's own; the search only keeps moves that lower the batch loss,
and its reported batch loss is what a full forward with the kept biases gives; nothing kept leaves the start; the
start and the pool's masks are left as they were; the CLI writes its JSON and refuses bad input with exit 2.

Run alone: .venv/bin/python -m pytest tests/test_bench_parse_swap_search.py -q
"""

import json
from pathlib import Path

import pytest
import torch

from rankserve.bench.parse_kd_sweep import shared_start
from rankserve.bench.parse_swap_search import (SearchConfig, contested, head_logprobs, layers_from, main, move_delta,
                                               search, train_batches)
from rankserve.compress.parse import TrainConfig, _hard
from rankserve.workers.parse import router_input

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "stories260K"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"
TRAIN = TrainConfig(windows=150, window=32, prompt_len=16, kd_eval=8, loss_scope="continuation")


@pytest.mark.parametrize("promote", [True, False])
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_move_flips_its_share_of_windows(promote, share):
    g = torch.Generator().manual_seed(0)
    s, k = torch.randn(400, 12, generator=g), 5
    for j in range(12):
        d = move_delta(s, j, k, share, promote)
        before = _hard(s, k)[:, j].bool()
        side = ~before if promote else before  # the windows the move can flip
        t = s.clone()
        t[:, j] += d
        after = _hard(t, k)
        assert (after.sum(-1) == k).all()
        flipped = (after[:, j].bool() != before)
        assert not flipped[~side].any()  # nothing flips the other way
        assert flipped[side].float().mean() == pytest.approx(share, abs=0.02)
    assert move_delta(torch.ones(3, 4) * torch.arange(4.0), 3, 2, 0.5, promote=True) is None  # always selected
    assert move_delta(torch.ones(3, 4) * torch.arange(4.0), 0, 2, 0.5, promote=False) is None  # never selected
    assert move_delta(torch.randn(3, 4), 0, 4, 0.5, promote=True) is None  # K = r_max: no component left out


def test_contested_components_come_first():
    s = torch.zeros(10, 4)
    s[:, 0] = 10  # always in
    s[:5, 1] = 5  # in half of the windows
    s[:, 2] = torch.arange(10.0) - 3  # in 6 of 10 (with K = 2)
    up, down = contested(s, 2, 2)
    assert up == [1, 2] and down[:2] in ([1, 2], [2, 1])
    assert 0 not in up  # a component every window selects cannot be promoted


@pytest.fixture(scope="module")
def start():
    return shared_start(MODEL, "svd-llm", CALIB, CALIB, "cpu", 0.6, TRAIN, 2)


def test_partial_forward_is_the_models(start):
    x = start.data.windows[:3]
    with torch.no_grad():
        full = torch.log_softmax(start.model(x)[:, 5:], -1)
        h = layers_from(start.model, start.model.embed(x), 0, 1)
        n = len(start.model.layers)
        tail = head_logprobs(start.model, layers_from(start.model, h, 1, n), 5)
    torch.testing.assert_close(tail, full, rtol=1e-5, atol=1e-5)


def batch_loss(st, b, cfg, which=0):
    """KL(dense ‖ pool) on the search's batch with hard masks from biases b: a full forward, no cache."""
    n_val = int(round(st.data.n * TRAIN.holdout))
    idx = train_batches(st.data.n - n_val, cfg)[which]
    lins, first = st.model.projections(), TRAIN.loss_from
    x = st.data.windows[idx]
    try:
        with torch.no_grad():
            for n in st.k:
                lins[n].mask = _hard(st.data.x[router_input(n)][idx] @ st.R[n].T + b[n], st.k[n])
            ref = torch.log_softmax(st.dense(x)[:, first:], -1)
            lp = torch.log_softmax(st.model(x)[:, first:], -1)
            return float((ref.exp() * (ref - lp)).sum(-1).mean())
    finally:
        for n in st.k:
            lins[n].mask = None


def test_search_keeps_only_moves_that_lower_the_batch_loss(start):
    b0 = {n: v.clone() for n, v in start.b.items()}
    cfg = SearchConfig(batch=6, candidates=2, sweeps=1, margin=0.0)
    best, rec = search(start, TRAIN, cfg, log=lambda s: None)
    (sw,) = rec["sweeps"]
    assert sw["tried"] > 0 and sw["kept"], "a search from 2 layer-local steps finds some move on 6 windows"
    losses = [sw["batch_loss_start"][0]] + [m["batch_loss"][0] for m in sw["kept"]]
    assert all(a > b for a, b in zip(losses, losses[1:]))
    assert sw["batch_loss_end"] == [losses[-1]]
    assert len(sw["trials"]) == sw["tried"] and sum(t[3] < 0 for t in sw["trials"]) == len(sw["kept"])
    end = {n: v.clone() for n, v in b0.items()}
    for m in sw["kept"]:
        end[m["proj"]][m["component"]] += m["delta"]
    assert batch_loss(start, b0, cfg) == pytest.approx(sw["batch_loss_start"][0], rel=1e-5)
    assert batch_loss(start, end, cfg) == pytest.approx(sw["batch_loss_end"][0], rel=1e-5)  # the cache is exact
    assert len(rec["heldout"]) == 2
    chosen = end if rec["best_sweep"] == 1 else b0
    assert all(torch.equal(best[n], chosen[n]) for n in b0)
    assert all(torch.equal(start.b[n], b0[n]) for n in b0)  # the start is not changed
    assert all(lin.mask is None for lin in start.model.projections().values())


def test_confirmed_moves_lower_both_batches(start):
    b0 = {n: v.clone() for n, v in start.b.items()}
    cfg = SearchConfig(batch=6, confirm=6, candidates=2, sweeps=1, margin=0.0)
    _, rec = search(start, TRAIN, cfg, log=lambda s: None)
    (sw,) = rec["sweeps"]
    confirmed = [t for t in sw["trials"] if len(t) == 5]  # scored on both: those the first batch kept
    assert len(confirmed) == sum(t[3] < 0 for t in sw["trials"])
    assert len(sw["kept"]) == sum(t[4] < 0 for t in confirmed) < len(sw["trials"])
    end = {n: v.clone() for n, v in b0.items()}
    for m in sw["kept"]:
        end[m["proj"]][m["component"]] += m["delta"]
    for which in (0, 1):
        assert sw["batch_loss_end"][which] <= sw["batch_loss_start"][which]
        assert batch_loss(start, end, cfg, which) == pytest.approx(sw["batch_loss_end"][which], rel=1e-5)
    with pytest.raises(ValueError, match="only"):
        train_batches(10, SearchConfig(batch=6, confirm=6))


def test_nothing_kept_returns_the_start(start):
    best, rec = search(start, TRAIN, SearchConfig(batch=4, candidates=1, sweeps=1, margin=1.0), log=lambda s: None)
    assert rec["sweeps"][0]["kept"] == [] and rec["best_sweep"] == 0
    assert rec["heldout"][0] == rec["heldout"][1]
    assert all(torch.equal(best[n], start.b[n]) for n in best)


def test_config_is_checked():
    for bad in (dict(batch=0), dict(confirm=-1), dict(share=0.0), dict(share=1.5), dict(margin=-1.0), dict(loss="mse")):
        with pytest.raises(ValueError):
            SearchConfig(**bad)


def test_cli_writes_json_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "swap.json"
    args = ["--dense", str(MODEL), "--calib-text", str(CALIB), "--train-text", str(CALIB), "--test", str(CALIB),
            "--windows", "150", "--window", "32", "--prompt-len", "16", "--kd-eval", "8", "--seq-len", "32",
            "--max-tokens", "600", "--batch", "4", "--candidates", "1", "--sweeps", "1", "--out", str(out)]
    assert main(args + ["--loss", "argmax"]) == 0
    res = json.loads(out.read_text())
    assert res["command"].startswith("python -m rankserve.bench.parse_swap_search")
    assert [r["variant"] for r in res["rows"]] == ["start", "search"][:1 + (res["search"]["best_sweep"] > 0)]
    assert res["search"]["config"]["loss"] == "argmax"
    for r in res["rows"]:
        assert r["dev"]["tokens"] > 0 and r["test"]["windows"] > 0
    assert main(args[:-1] + [str(tmp_path / "x.json"), "--share", "0"]) == 2
    assert "share" in capsys.readouterr().err
    assert main(args[:2] + ["--calib-text", str(tmp_path / "missing.txt")] + args[4:]) == 2
