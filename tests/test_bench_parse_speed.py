"""bench/parse_speed.py on the CPU (its --device cpu smoke test: the tiny preset, Triton under the interpreter): the
PARSE slots' decode steps listed in --slot-steps are each timed and checked against the eager masked pool in one
run, and the markdown names each row's step. The speed figures themselves come from the H200
(bench/results/parse-speed-h200-s28.md).

Run alone:  .venv/bin/python -m pytest tests/test_bench_parse_speed.py -q
"""

from __future__ import annotations

import json

import pytest

from rankserve.bench import parse_speed


@pytest.mark.slow
def test_slot_steps_are_timed_and_checked_in_one_run(tmp_path):
    out = tmp_path / "ps.json"
    argv = ["--device", "cpu", "--preset", "tiny", "--batches", "2", "--unions", "1.2", "--slot-steps", "default",
            "per-kernel", "--tokens", "2", "--repeats", "1", "--prefill-tokens", "16", "--prompt", "4",
            "--out", str(out)]
    assert parse_speed.main(argv) == 0
    (e,) = json.loads(out.read_text())["batches"]
    rows = {r["row"] for r in e["rows"]}
    assert {"static", "parse-slots", "parse-slots-u1.2", "parse-slots/per-kernel",
            "parse-slots-u1.2/per-kernel"} <= rows
    assert [s["step"] for s in e["slot_steps"]] == ["default", "per-kernel"]
    assert not any(s["one_launch"] for s in e["slot_steps"])  # the CPU: per-kernel either way
    checks = [e["check"], e["checks"]["per-kernel"], *(o["check"] for o in e["overlap"])]
    assert len(checks) == 4
    for c in checks:  # fp32 on the CPU: the slots equal the eager masked pool
        assert c["max_rel_err"] < 1e-4 and c["argmax_agreement"] == 1.0
    assert [o["step"] for o in e["overlap"]] == ["default", "per-kernel"]
    assert e["overlap"][0]["prefill_parse_ms"] > 0 and e["overlap"][1]["prefill_parse_ms"] is None
    md = parse_speed.markdown([str(out)])
    assert "| 2 (default: per-kernel step) |" in md and "| 2 (per-kernel step) |" in md
    assert "overlapping subsets, per-kernel step" in md
