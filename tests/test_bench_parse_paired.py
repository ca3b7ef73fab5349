"""bench/parse_paired.py on the bundled model: its totals are `rankserve eval`'s (fidelity) for both PARSE modes,
and its paired differences are the per-window means of the two.

Run alone: .venv/bin/python -m pytest tests/test_bench_parse_paired.py -q
"""

import json
from pathlib import Path

import pytest

from rankserve.bench.parse_paired import main, paired
from rankserve.compress.fidelity import fidelity

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "stories260K"
TEXT = ROOT / "tests" / "data" / "wikitext2-raw-test-head.txt"


def test_totals_are_evals_and_the_differences_pair(tiny_parse, tmp_path):
    r = paired(tiny_parse, TEXT.read_text(), MODEL, seq_len=96, prompt_len=24, max_tokens=700, batch_size=3)
    for mode in ("route", "static"):
        ev = fidelity(tiny_parse, TEXT, reference_dir=MODEL, max_tokens=700, seq_len=96, prompt_len=24,
                      parse_mode=mode, progress=False)
        assert r["tokens"] == ev["tokens"] and r[mode]["nll"] == pytest.approx(ev["nll"], rel=1e-6)
        assert r[mode]["top1_agreement"] == pytest.approx(ev["top1_agreement"])
        assert r[mode]["kl"] == pytest.approx(ev["kl"], rel=1e-5)
    d = r["route_minus_static"]
    assert r["windows"] == 8 and d["nll_ci95"] > 0 and d["top1_ci95"] >= 0
    assert d["windows_route_lower_nll"] + d["windows_static_lower_nll"] <= r["windows"]
    out = tmp_path / "p.json"
    assert main([str(tiny_parse), "--data", str(TEXT), "--reference", str(MODEL), "--out", str(out),
                 "--seq-len", "96", "--prompt-len", "24", "--max-tokens", "700"]) == 0
    saved = json.loads(out.read_text())
    assert saved["results"][0]["route"] == pytest.approx(r["route"]) and "Δ NLL" in out.with_suffix(".md").read_text()
    with pytest.raises(ValueError, match="not a PARSE checkpoint"):
        paired(MODEL, TEXT.read_text(), MODEL, max_tokens=300, seq_len=96, prompt_len=24)
