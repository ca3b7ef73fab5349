"""bench/svd_probe.py on the CPU at small shapes: every route's truncation agrees with the default SVD's, and the
rows are saved as they are measured.

Run alone: .venv/bin/python -m pytest tests/test_bench_svd_probe.py -q
"""

import json

import torch

from rankserve.bench import svd_probe


def test_routes_agree_and_rows_are_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(svd_probe, "SHAPES", {"tall": (64, 48), "wide": (40, 96)})
    out = tmp_path / "p.json"
    saved = []
    rows = svd_probe.probe(torch.device("cpu"), 2, lambda r: saved.append(len(r)))
    assert [r["route"] for r in rows] == ["cholesky", "svd:default", "eigh"] * 2  # the CPU has one driver
    assert saved == [2, 3, 5, 6]  # after every decomposition row, the Cholesky rows before them included
    for r in rows:
        if r["route"] == "eigh":
            assert r["sigma_rel_diff"] < 1e-10 and r["product_rel_diff"] < 1e-10
    assert svd_probe.main(["--device", "cpu", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "CPU" and len(res["rows"]) == 6 and all(r["median_s"] >= 0 for r in res["rows"])

