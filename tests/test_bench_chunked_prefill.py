"""bench/chunked_prefill.py on a tiny CPU run: the whole-prompt baseline and a chunked run serve every request with
the same tokens (fp32), the long prompts' first tokens come, and the JSON + markdown land where asked.

Run alone: .venv/bin/python -m pytest tests/test_bench_chunked_prefill.py -q
"""

import json
from pathlib import Path

import pytest

from rankserve.bench.chunked_prefill import main

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "stories260K"


def test_tiny_run_writes_its_results(tmp_path):
    out = tmp_path / "c.json"
    assert main(["--model-dir", str(BUNDLED), "--rows", "2", "--long-tokens", "200", "--chunks", "64", "0",
                 "--joins", "2", "--every", "4", "--gen", "24", "--long-gen", "4", "--repeats", "1",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["args"]["chunks"] == [0, 64]  # the baseline first
    for c in ("0", "64"):
        r = res["runs"][c]
        assert r["equal"] == 4 and [len(t) for t in r["tokens"]] == [24, 24, 4, 4]
        assert len(r["ttft_long_ms"]) == 2 and r["gap_p50_ms"] <= r["gap_max_ms"]
    assert res["long_tokens"] > 64  # each long prompt really went in several chunks
    md = out.with_suffix(".md").read_text()
    assert "| whole prompt |" in md and "| 64 |" in md and "--long-tokens 200" in md


def test_a_run_without_the_baseline_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--model-dir", str(BUNDLED), "--chunks", "64", "--out", str(tmp_path / "c.json")])
