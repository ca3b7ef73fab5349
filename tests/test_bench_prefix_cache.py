"""bench/prefix_cache.py on a tiny CPU run: with the cache on, requests after the first take the shared system
prompt's blocks from it, every request's tokens equal the cache-off run's (fp32), and the JSON + markdown land.

Run alone: .venv/bin/python -m pytest tests/test_bench_prefix_cache.py -q
"""

import json
from pathlib import Path

from rankserve.bench.prefix_cache import main

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "stories260K"


def test_tiny_run_writes_its_results(tmp_path):
    out = tmp_path / "p.json"
    assert main(["--model-dir", str(BUNDLED), "--system-tokens", "200", "--question-tokens", "16", "--requests", "4",
                 "--batch", "4", "--gen", "8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["off"]["hit_tokens"] == 0 and res["off"]["equal"] == 4 and res["on"]["equal"] == 4
    assert res["on"]["hit_tokens"] == 3 * (res["system_tokens"] // 64 * 64)  # requests 2-4 hit the system blocks
    assert len(res["on"]["ttft_ms"]) == 4 and all(len(t) == 8 for t in res["on"]["tokens"])
    md = out.with_suffix(".md").read_text()
    assert "| on |" in md and "| off |" in md and "--system-tokens 200" in md
