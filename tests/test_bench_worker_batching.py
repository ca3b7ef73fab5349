"""bench/worker_batching.py on a tiny run: every request is served whole at each batch size, the batches hold the
rows the batch size allows, and the JSON + markdown land in the output folder.

Run alone:  .venv/bin/python -m pytest tests/test_bench_worker_batching.py -q
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.serve


def test_tiny_run_writes_its_results(tmp_path):
    from rankserve.bench.worker_batching import main

    assert main(["--batch-sizes", "1", "2", "--clients", "2", "--requests", "2", "--max-tokens", "5",
                 "--tag", "t", "--out-dir", str(tmp_path), "--jitter-ms", "1", "--batch-wait-ms", "0", "20",
                 "--join", "on", "off"]) == 0
    res = json.loads((tmp_path / "worker-batching-t.json").read_text())
    assert [(r["join"], r["batch_wait_ms"], r["max_batch_size"]) for r in res["rows"]] == \
        [(j, w, b) for j in (True, False) for w in (0, 20) for b in (1, 2)]
    assert all(r["requests"] == 4 and r["tokens"] == 20 for r in res["rows"])  # ignore_eos: all 5 tokens each
    for one, two, one_w, two_w in (res["rows"][:4], res["rows"][4:]):
        assert one["mean_step_rows"] == one_w["mean_step_rows"] == 1.0 and 1.0 <= two["mean_step_rows"] <= 2.0
        assert two_w["mean_step_rows"] == 2.0  # a 20 ms wait gathers both clients despite their 1 ms jitter
    md = (tmp_path / "worker-batching-t.md").read_text()
    assert "| yes | 20 | 2 |" in md and "| no | 20 | 2 |" in md and "--tag t" in md
    assert main(["--batch-sizes", "1", "2", "--clients", "2", "--requests", "2", "--max-tokens", "16",
                 "--tag", "m", "--out-dir", str(tmp_path), "--mixed-lengths"]) == 0
    mixed = json.loads((tmp_path / "worker-batching-m.json").read_text())["rows"]
    assert mixed[0]["tokens"] == mixed[1]["tokens"] and 2 * 4 <= mixed[0]["tokens"] < 4 * 16  # lengths in [2, 16]
    with pytest.raises(SystemExit):
        main(["--batch-sizes", "2", "--out-dir", str(tmp_path)])  # the baseline (1) must come first
