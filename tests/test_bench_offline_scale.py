"""bench/offline_scale.py on the CPU at the `tiny` width: every stage runs through the real offline code and reports
the Gram bytes a layer must hold, and bad arguments exit 2.

Run alone: .venv/bin/python -m pytest tests/test_bench_offline_scale.py -q
"""

import json
from pathlib import Path

import pytest

from rankserve.bench.offline_scale import main
from rankserve.workers.config import preset

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


def test_stages_report_time_memory_and_a_usable_checkpoint(tmp_path):
    out = tmp_path / "scale.json"
    assert main(["--device", "cpu", "--preset", "tiny", "--layers", "1", "2", "--calib", str(TEXT),
                 "--calib-tokens", "1024", "--stages", "calibrate", "compress", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "CPU" and [r["layers"] for r in res["runs"]] == [1, 2]
    cfg = preset("tiny")
    h, q, f = cfg.hidden_size, cfg.q_dim, cfg.intermediate_size
    for run in res["runs"]:
        cal = run["calibrate"]
        assert cal["tokens"] == 1024
        # four distinct fp64 Grams a layer: q/k/v's and gate/up's inputs (hidden), o's (q_dim) and down's
        assert cal["gram_gb"] == round(run["layers"] * (2 * h * h + q * q + f * f) * 8 / 1e9, 3)
        assert cal["gpu_peak_gb"] is None and cal["host_peak_gb"] > 0
        assert run["compress"]["finite_logits"] and run["compress"]["seconds"] > 0
        assert 0 < run["compress"]["out_bytes"] < run["dense_bytes"]  # keep 0.6 of the decoder linears
        assert "parse" not in run
    assert main(["--device", "cpu", "--preset", "tiny", "--layers", "1", "--calib", str(TEXT), "--calib-tokens",
                 "1024", "--stages", "parse", "--parse-windows", "24", "--parse-steps", "2", "--parse-kd-steps", "1",
                 "--svd-route", "eigh", "--out", str(out)]) == 0
    parse = json.loads(out.read_text())["runs"][0]["parse"]
    assert parse["finite_logits"] and parse["steps"] == 2 and parse["seconds"] > 0 and parse["svd_route"] == "eigh"
    kd = parse["kd"]  # the KD stage's step kept ("start" or its step) and its held-out KL before and after
    assert kd["kd_kept"] in ("start", "step 1"), kd
    assert kd["kd_heldout_kl"] <= kd["kd_heldout_kl_start"] + 1e-6


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main(["--device", "cpu", "--calib", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o.json")]) == 2
    assert main(["--device", "cpu", "--layers", "0", "--calib", str(TEXT), "--out", str(tmp_path / "o.json")]) == 2
    assert "--calib must be a file" in capsys.readouterr().err
    assert main(["--device", "cpu", "--preset", "tiny", "--calib", str(TEXT), "--calib-tokens", "10", "--stages",
                 "compress", "--out", str(tmp_path / "o.json")]) == 2  # refused by compress: one clean line
    assert "offline_scale: max_tokens=10 is below" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_a_kept_work_dir_reuses_the_source_and_resumes_a_cut_parse_stage(tmp_path, monkeypatch):
    import rankserve.compress.parse as parse

    work, pw, out = tmp_path / "work", tmp_path / "elsewhere", tmp_path / "scale.json"
    args = ["--device", "cpu", "--preset", "tiny", "--layers", "1", "--calib", str(TEXT), "--calib-tokens", "1024",
            "--stages", "parse", "--parse-windows", "24", "--parse-steps", "2", "--parse-kd-steps", "0",
            "--svd-route", "eigh", "--work", str(work), "--out", str(out)]
    moved = args + ["--parse-work", str(pw)]  # the parse stage's intermediates on another disk
    real = parse.train_routers

    def cut(*a, **kw):  # the run dies after its pool and router data are on disk
        raise RuntimeError("cut off")

    monkeypatch.setattr(parse, "train_routers", cut)
    with pytest.raises(RuntimeError, match="cut off"):
        main(moved)
    source = (work / "dense-1" / "model.safetensors").stat().st_mtime_ns
    assert (pw / "parse-1" / "pool").is_dir()  # what the cut run finished is kept
    assert not (work / ".parse-1.parse-work").exists()
    monkeypatch.setattr(parse, "train_routers", real)
    assert main(moved) == 0
    row = json.loads(out.read_text())["runs"][0]["parse"]
    assert row["resumed"] and row["finite_logits"]
    assert (work / "dense-1" / "model.safetensors").stat().st_mtime_ns == source  # reused, not rebuilt
    assert not (pw / "parse-1").exists()  # a finished parse stage cleans its work dir
    assert main(args) == 0 and not json.loads(out.read_text())["runs"][0]["parse"]["resumed"]
