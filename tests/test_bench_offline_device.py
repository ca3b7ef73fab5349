"""The offline-tools device check (bench/offline_device.py) on the CPU against itself: the same builds give the same
checkpoints, every field is filled, and bad arguments exit 2. Run alone:
    python -P -m pytest -q tests/test_bench_offline_device.py
"""

import json
from pathlib import Path

from rankserve.bench import offline_device

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


def test_cpu_against_itself(tmp_path):
    c = offline_device.compare_compress(STORIES, CALIB, "cpu", 0.6, 2048, tmp_path)
    assert c["logits_rel_diff"] == 0 and c["argmax_agree"] == 1.0
    assert 0 < c["dense_rel_diff_cpu"] == c["dense_rel_diff_device"]  # compressed: not the dense model
    p = offline_device.compare_parse("cpu", tmp_path, 2048)
    assert p["pool_all_rel_diff"] == 0 and p["pool_first_k_rel_diff"] == 0
    assert p["router_pick_overlap_mean"] == p["router_pick_overlap_min"] == 1.0 and p["prompts"] == 4
    assert p["seconds_cpu"] > 0 and p["seconds_device"] > 0
    o = offline_device.compare_kd_offload("cpu", tmp_path, 2048)  # offloaded KD: the plain checkpoint, to the bit
    assert o["equal"] and o["tensors"] > 0 and o["kd_kept"] != "start"  # its steps moved the routers


def test_cli_refuses_bad_arguments(tmp_path, capsys):
    out = tmp_path / "od.json"
    assert offline_device.main(["--device", "cuda:99", "--out", str(out)]) == 2
    assert "is not usable here" in capsys.readouterr().err
    assert offline_device.main(["--device", "cpu", "--calib", str(tmp_path / "none.txt"), "--out", str(out)]) == 2
    assert "must be a file" in capsys.readouterr().err
    assert not out.exists()


def test_cli_writes_json(tmp_path):
    out = tmp_path / "od.json"
    assert offline_device.main(["--device", "cpu", "--model", str(STORIES), "--calib", str(CALIB),
                                "--calib-tokens", "2048", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "CPU"
    assert res["compress"]["model"] == "stories260K" and res["parse"]["model"] == "stories260K"
    assert res["kd_offload"]["equal"] is True
