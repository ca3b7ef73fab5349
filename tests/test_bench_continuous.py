"""bench/continuous.py on a tiny CPU run: both modes serve every request whole with the same tokens (fp32), rows
joining as others end need no more decode steps than static batches, and the JSON + markdown land where asked.

Run alone: .venv/bin/python -m pytest tests/test_bench_continuous.py -q
"""

import json
from pathlib import Path

from rankserve.bench.continuous import main

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "stories260K"


def test_tiny_run_writes_its_results(tmp_path):
    out = tmp_path / "c.json"
    assert main(["--model-dir", str(BUNDLED), "--requests", "10", "--longest", "12", "--repeats", "1",
                 "--prefill-lengths", "16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rows_equal"] == 10 and 10 <= res["tokens"] <= 120
    static, cont = res["static"], res["continuous"]
    assert cont["steps"] <= static["steps"] and cont["mean_rows_per_step"] >= static["mean_rows_per_step"]
    assert res["prefill"][0]["tokens"] == 16 and res["prefill"][0]["max_abs_logit_diff"] < 1e-4
    first = res["first_step"]  # one prompt's 8 choices prefill once, 8 different prompts 8 times
    assert first["same_prompt_prefills"] == 1 and first["different_prompts_prefills"] == 8
    assert first["prompt_tokens"] < 512
    md = out.with_suffix(".md").read_text()
    assert "| continuous |" in md and "| 16 |" in md and "--requests 10" in md
