"""bench/text_host.py on a short run: incremental text equals the baseline's, and the figures are written."""

import json

from rankserve.bench.text_host import main


def test_text_host_short_run(tmp_path):
    out = tmp_path / "t.json"
    assert main(["--out", str(out), "--tokens", "300", "--tail", "50"]) == 0
    res = json.loads(out.read_text())
    for m in ("stories260K", "reference"):
        assert res[m]["same_text"] and res[m]["incremental"]["seconds"] > 0 and res[m]["whole"]["last_ms_per_token"] > 0
