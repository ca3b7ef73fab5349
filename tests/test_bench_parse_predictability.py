"""bench/parse_predictability.py: the cross-validated ridge recovers a linear map and never reads a window's own
fold; on the bundled model every svd-llm predictor lies between the oracle and what it can reach, static is the
first K; the CLI writes its JSON and refuses bad input with exit 2.

Run alone: .venv/bin/python -m pytest tests/test_bench_parse_predictability.py -q
"""

import json
from pathlib import Path

import pytest
import torch

from rankserve.bench.parse_predictability import fold_mean, fold_neighbours, fold_predict, main, predictability
from rankserve.compress.parse import _hard, build_pool, collect, sample_windows
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "stories260K"
TEXT = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


def test_fold_predict_recovers_a_linear_map():
    g = torch.Generator().manual_seed(0)
    F = torch.randn(300, 6, generator=g, dtype=torch.float64)
    W = torch.randn(6, 4, generator=g, dtype=torch.float64)
    G = 3 * F @ W + torch.randn(4, generator=g, dtype=torch.float64)  # an exact affine map
    folds = torch.arange(300) % 5
    torch.testing.assert_close(fold_predict(F, G, folds, 1e-12), G, rtol=1e-6, atol=1e-6)
    use = torch.arange(300) % 2 == 0
    torch.testing.assert_close(fold_predict(F, G, folds, 1e-12, use), G, rtol=1e-6, atol=1e-6)


def test_nearest_neighbours_average_the_closest_training_rows():
    F = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [1.0, 0.05], [0.05, 1.0]])
    G = torch.tensor([[1.0], [3.0], [10.0], [30.0], [0.0], [0.0]])
    folds = torch.tensor([0, 0, 0, 0, 1, 1])  # fold 1's rows see only fold 0's
    out = fold_neighbours(F, G, folds, 2)
    assert out[4].item() == pytest.approx(2.0) and out[5].item() == pytest.approx(20.0)  # the two on its side


def test_a_fold_is_predicted_without_its_own_rows():
    g = torch.Generator().manual_seed(1)
    F, G = torch.randn(100, 3, generator=g), torch.randn(100, 5, generator=g)
    folds = torch.arange(100) % 4
    base, mean = fold_predict(F, G, folds, 0.1), fold_mean(G, folds)
    G2 = G.clone()
    G2[folds == 0] += 100.0  # fold 0's own targets change: its predictions must not
    torch.testing.assert_close(fold_predict(F, G2, folds, 0.1)[folds == 0], base[folds == 0])
    torch.testing.assert_close(fold_mean(G2, folds)[folds == 0], mean[folds == 0])
    near = fold_neighbours(F, G, folds, 5)
    torch.testing.assert_close(fold_neighbours(F, G2, folds, 5)[folds == 0], near[folds == 0])
    assert not torch.allclose(fold_predict(F, G2, folds, 0.1)[folds == 1], base[folds == 1])


@pytest.fixture(scope="module")
def pool():
    model, k, _ = build_pool(MODEL, "svd-llm", 0.6, TEXT, progress=False)
    dense_model, _ = load_checkpoint(MODEL, "cpu", torch.float32)
    dense = {n: l.dense_weight().detach() for n, l in dense_model.projections().items()}
    wins = sample_windows([TEXT], Tokenizer.load(MODEL), 60, 32, 0)
    return model, dense, wins, k


@pytest.fixture(scope="module")
def data(pool):
    model, dense, wins, k = pool
    cont = collect(model, dense, wins, 16, progress=False, loss_from=15)
    prompt = collect(model, dense, wins[:, :16], 16, progress=False)
    return cont, prompt, k


def test_predictors_lie_above_the_oracle(data):
    cont, prompt, k = data
    res = predictability(cont, prompt, k, n_folds=3, fraction=0.5, ridges=(0.1, 1.0), progress=False)
    assert set(res["matrices"]) == set(k)
    for n, row in res["matrices"].items():
        every = torch.arange(cont.n)
        first_k = torch.zeros(cont.n, cont.a[n].shape[1])
        first_k[:, :k[n]] = 1
        assert row["static"] == pytest.approx(cont.loss(n, every, first_k).mean().item(), rel=1e-6)
        assert row["oracle"] == pytest.approx(
            cont.loss(n, every, _hard(-cont.a[n], k[n])).mean().item(), rel=1e-6)
        for m, v in row.items():  # svd-llm's U is orthogonal: the oracle is a true bound
            assert v >= row["oracle"] - 1e-7, (n, m)
    assert res["share_of_oracle_gap"]["static"] == 0 and res["share_of_oracle_gap"]["oracle"] == pytest.approx(1)
    assert res["vs_static"]["static"] == 0 and res["vs_static"]["oracle"] <= 0
    assert set(res["mean"]) == {"static", "oracle", "mean_gain", "prompt_gain", "x", "x @0.5", "gp", "gp @0.5",
                                "x+gp", "x+gp @0.5", "x nearest"}


def test_recent_gains_are_one_more_predictor_above_the_oracle(pool, data):
    cont, prompt, k = data
    model, dense, wins, _ = pool
    recent = collect(model, dense, wins[:, :16], 16, progress=False, loss_from=12)  # the prompt's last 4 positions
    res = predictability(cont, prompt, k, n_folds=3, fraction=0.5, ridges=(0.1, 1.0), progress=False, recent=recent)
    assert {"gr", "gr @0.5", "recent_gain"} <= set(res["mean"])
    for n, row in res["matrices"].items():
        every = torch.arange(cont.n)
        Gr = -recent.a[n] / recent.Y[n][:, None].clamp_min(1e-30)
        assert row["recent_gain"] == pytest.approx(cont.loss(n, every, _hard(Gr, k[n])).mean().item(), rel=1e-6)
        assert row["gr"] >= row["oracle"] - 1e-7 and row["recent_gain"] >= row["oracle"] - 1e-7
    plain = predictability(cont, prompt, k, n_folds=3, fraction=0.5, ridges=(0.1, 1.0), progress=False)
    assert all(plain["mean"][m] == res["mean"][m] for m in plain["mean"])  # the other rows do not move
    with pytest.raises(ValueError, match="recent statistics"):
        predictability(cont, prompt, k, progress=False, recent=collect(model, dense, wins[:5, :16], 16,
                                                                       progress=False))


def test_predictability_checks_its_arguments(data):
    cont, prompt, k = data
    with pytest.raises(ValueError, match="folds"):
        predictability(cont, prompt, k, n_folds=1, progress=False)
    with pytest.raises(ValueError, match="fraction"):
        predictability(cont, prompt, k, fraction=0.0, progress=False)


def test_cli_writes_json_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["--dense", str(MODEL), "--calib-text", str(TEXT), "--train-text", str(TEXT), "--windows", "30",
            "--window", "32", "--prompt-len", "16", "--folds", "3"]
    assert main(args + ["--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["windows"] == 30 and res["base"] == "svd-llm" and res["command"].endswith(f"--out {out}")
    assert res["mean"]["oracle"] <= res["mean"]["static"]
    assert main(args + ["--fraction", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert main(args + ["--neighbours", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert main(args + ["--recent", "17", "--out", str(tmp_path / "x.json")]) == 2  # longer than the prompt
    assert main(["--dense", str(MODEL), "--calib-text", str(tmp_path / "none.txt"), "--train-text", str(TEXT),
                 "--out", str(tmp_path / "y.json")]) == 2
    assert main(args + ["--windows", "100000", "--out", str(tmp_path / "z.json")]) == 2  # the text is too short
    assert main(args + ["--keep", "1.5", "--out", str(tmp_path / "z.json")]) == 2
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "z.json").exists()
    assert "error:" in capsys.readouterr().err


def test_basis_sharing_reports_no_share_of_a_non_bound(tmp_path):
    out = tmp_path / "bs.json"
    assert main(["--base", "basis-sharing", "--dense", str(MODEL), "--calib-text", str(TEXT), "--train-text",
                 str(TEXT), "--windows", "30", "--window", "32", "--prompt-len", "16", "--folds", "3",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["share_of_oracle_gap"] is None  # shared bases are not orthogonal: the oracle is no bound there
    assert res["vs_static"]["static"] == 0 and set(res["vs_static"]) == set(res["mean"])
