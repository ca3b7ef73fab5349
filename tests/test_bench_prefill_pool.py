"""The prefill-pool check on the CPU (bench/prefill_pool.py): every bucket of a small context, prompts replayed out
of order through the padded one-row prefill against the plain forward. Run alone:
    python -P -m pytest -q tests/test_bench_prefill_pool.py
"""

import json

from pathlib import Path

from rankserve.bench import prefill_pool
from rankserve.workers.engine import Engine
from rankserve.workers.prefill_graph import pool_bytes

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"


def test_buckets_cover_the_context():
    assert prefill_pool.buckets(128) == [16, 32, 64, 128]
    assert prefill_pool.buckets(100) == [16, 32, 64, 100]
    assert prefill_pool.buckets(16) == [16]


def test_padded_replays_match_the_plain_forward():
    model = Engine.load(STORIES).model  # the bundled model, fp32 on the CPU
    res = prefill_pool.check(model, max_len=64, per_bucket=2, seed=1)
    assert [c["bucket"] for c in res["captures"]] == [16, 32, 64]
    assert {r["bucket"] for r in res["replays"]} == {16, 32, 64}
    assert any(r["tokens"] < r["bucket"] for r in res["replays"])  # padded prompts are in the draw
    assert res["all_argmax_equal"] and res["all_seqlens_right"]
    assert res["max_abs_logit_diff"] < 1e-3 and res["max_abs_kv_diff"] < 1e-4
    assert res["shared_pool_mib"] == 0 and res["separate_pools_mib"] == 0  # no pools off the GPU


def test_cli_refuses_a_context_longer_than_the_model(tmp_path, capsys):
    out = tmp_path / "pp.json"
    code = prefill_pool.main(["--model-dir", str(STORIES), "--max-len", "100000", "--out", str(out)])
    assert code == 2 and not out.exists()
    assert "over the model's context" in capsys.readouterr().err


def test_cli_writes_json_and_markdown(tmp_path):
    out = tmp_path / "pp.json"
    assert prefill_pool.main(["--model-dir", str(STORIES), "--max-len", "32", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "CPU" and res["all_argmax_equal"]
    assert "eagerly" in out.with_suffix(".md").read_text()


def test_draws_stay_in_their_bucket_when_the_context_is_not_a_power_of_two():
    model = Engine.load(STORIES).model
    res = prefill_pool.check(model, max_len=100, per_bucket=3, seed=2)
    per_bucket = {}
    for r in res["replays"]:
        per_bucket.setdefault(r["bucket"], []).append(r["tokens"])
    assert sorted(per_bucket) == [16, 32, 64, 100]
    assert all(64 < n <= 100 for n in per_bucket[100])  # drawn above the previous bucket, so they pad to 100
    assert res["all_argmax_equal"] and res["all_seqlens_right"]


def test_pool_bytes_of_no_pool_is_zero():
    assert pool_bytes() == 0 and pool_bytes(None, None) == 0
