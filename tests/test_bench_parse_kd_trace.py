"""bench/parse_kd_trace.py on the bundled model: variants parse or are refused; with no step size nothing is swapped
and the held-out KL stays at the start's; steps that move the routers are counted as swapped selections; the pool's
masks are cleared; the CLI writes its JSON and refuses bad input with exit 2.

Run alone: .venv/bin/python -m pytest tests/test_bench_parse_kd_trace.py -q
"""

import json
from pathlib import Path

import pytest

from rankserve.bench.parse_kd_sweep import shared_start
from rankserve.bench.parse_kd_trace import main, parse_variant, trace
from rankserve.compress.parse import TrainConfig, distill_routers

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "stories260K"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"
TRAIN = TrainConfig(windows=150, window=32, prompt_len=16, kd_eval=8, loss_scope="continuation")


def test_variants_parse_or_are_refused():
    assert parse_variant("adamw:1e-3:1:100") == ("adamw", 1e-3, 1.0, 100)
    assert parse_variant("sgd:0:0.1:3") == ("sgd", 0.0, 0.1, 3)
    for bad, match in (("adamw:1e-3:100", "opt:lr:T:steps"), ("adam:1e-3:1:10", "optimizer"),
                       ("sgd:1e-3:0:10", "T positive"), ("sgd:-1:1:10", "lr must be"), ("sgd:1:1:0", "steps")):
        with pytest.raises(ValueError, match=match):
            parse_variant(bad)


@pytest.fixture(scope="module")
def start():
    return shared_start(MODEL, "svd-llm", CALIB, CALIB, "cpu", 0.6, TRAIN, 2)


def test_no_step_swaps_nothing(start):
    for opt in ("adamw", "sgd"):
        rows = trace(start, TRAIN, opt, 0.0, 1.0, 3, every=2)
        assert [r["step"] for r in rows] == [0, 2, 3]
        assert all(r["swapped"] == 0.0 and r["heldout_kl"] == rows[0]["heldout_kl"] for r in rows)
        assert rows[0]["heldout_kl"] > 0 and rows[0]["train_kl"] is None and rows[1]["train_kl"] > 0
    assert all(lin.mask is None for lin in start.model.projections().values())


def test_start_is_the_kd_stages_start(start):
    """The trace's step-0 held-out KL is the figure the KD stage itself starts its early stopping from."""
    rows = trace(start, TRAIN, "adamw", 0.0, 1.0, 1, every=1)
    _, _, rep = distill_routers(start.model, start.dense, start.data, start.k, start.R, start.b, 1, TRAIN, None,
                                progress=False)
    assert rows[0]["heldout_kl"] == pytest.approx(rep["kd_heldout_kl_start"], rel=1e-6)


def test_moving_routers_swap_selections(start):
    rows = trace(start, TRAIN, "adamw", 0.05, 1.0, 4, every=4)
    assert 0 < rows[-1]["swapped"] <= 1
    assert rows[-1]["heldout_kl"] != rows[0]["heldout_kl"]
    again = trace(start, TRAIN, "adamw", 0.05, 1.0, 4, every=4)  # the start is not changed by a trace
    assert again == rows


def test_cli_writes_json_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "trace.json"
    args = ["--dense", str(MODEL), "--calib-text", str(CALIB), "--train-text", str(CALIB), "--windows", "150",
            "--window", "32", "--prompt-len", "16", "--kd-eval", "8", "--every", "1", "--out", str(out)]
    assert main(args + ["--variants", "sgd:0.1:0.1:2"]) == 0
    res = json.loads(out.read_text())
    assert res["base"] == "svd-llm" and res["command"].startswith("python -m rankserve.bench.parse_kd_trace")
    (v,) = res["variants"]
    assert v["optimizer"] == "sgd" and [r["step"] for r in v["trace"]] == [0, 1, 2]
    assert main(args + ["--variants", "adamw:1e-3"]) == 2
    assert "opt:lr:T:steps" in capsys.readouterr().err
    assert main(args + ["--variants", "sgd:0.1:1:2", "--every", "0"]) == 2
    assert main(["--calib-text", str(tmp_path / "missing.txt"), "--train-text", str(CALIB), "--variants",
                 "sgd:0.1:1:2", "--out", str(out)]) == 2
