"""bench/parse_kd_sweep.py on the bundled model: variants parse or are refused, and a sweep of the shared start and
one KD variant scores both on the same dev windows and evaluation tokens.

Run alone: .venv/bin/python -m pytest tests/test_bench_parse_kd_sweep.py -q
"""

import json
from pathlib import Path

import pytest

from rankserve.bench.parse_kd_sweep import main, parse_variant

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "stories260K"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"
TEXT = ROOT / "tests" / "data" / "wikitext2-raw-test-head.txt"


def test_variants_parse_or_are_refused():
    assert parse_variant("none") is None
    assert parse_variant("argmax:3e-4:1000") == ("argmax", 3e-4, 1000)
    for bad, match in (("kl:1e-4", "loss:lr:steps"), ("continuation:kl:1e-4:10", "loss:lr:steps"),
                       ("mse:1e-4:10", "kd_loss"), ("kl:0:10", "positive")):
        with pytest.raises(ValueError, match=match):
            parse_variant(bad)


def test_sweep_scores_every_variant_on_the_same_tokens(tmp_path):
    out = tmp_path / "sweep.json"
    assert main(["--dense", str(MODEL), "--calib-text", str(CALIB), "--train-text", str(CALIB), "--test", str(TEXT),
                 "--variants", "none", "kl:1e-3:2", "--loss-scope", "continuation", "--windows", "150", "--window", "32", "--prompt-len", "16", "--kd-eval", "8",
                 "--max-tokens", "700",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"][0]
    none, kd = res["rows"]
    assert res["dev_windows"] == 7 and none["dev"]["tokens"] == kd["dev"]["tokens"] == 7 * 16
    assert none["dev"]["static"] == kd["dev"]["static"]  # static does not depend on the routers
    assert none["test"]["static"] == kd["test"]["static"] and none["test"]["tokens"] == kd["test"]["tokens"] > 0
    assert none["kd"] == {} and kd["kd"]["kd_steps"] == 2
    assert res["loss_scope"] == "continuation" and "kl:1e-3:2" in out.with_suffix(".md").read_text()
