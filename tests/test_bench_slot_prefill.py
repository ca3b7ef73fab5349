"""The slot-prefill timing (bench/slot_prefill.py) on the CPU with a small random pool: both ways give the same
logits, every field is filled, and the CLI refuses what it cannot run. Run alone:
    python -P -m pytest -q tests/test_bench_slot_prefill.py
"""

import json

import pytest
import torch

from rankserve.bench import slot_prefill
from rankserve.workers.model import PROJS


def test_both_ways_agree_on_the_cpu():
    slots = slot_prefill.tiny_slots()
    prefills, slots.prefills = slots.prefills, None
    with pytest.raises(ValueError, match="no one-row prefills"):
        slot_prefill.measure(slots, [5], repeats=1)
    slots.prefills = prefills
    res = slot_prefill.measure(slots, [5, 20], repeats=2)
    assert res["batch"] == 2 and res["routed_matrices"] == 2 * len(PROJS) and res["row_mode_alone_ms"] > 0
    assert [r["tokens"] for r in res["rows"]] == [5, 20] and [r["bucket"] for r in res["rows"]] == [16, 32]
    for r in res["rows"]:
        assert not r["replays"]  # no graphs on the CPU: both ways run the modules eagerly in row mode
        assert r["max_abs_logit_diff"] == 0 and r["argmax_equal"]
        assert 0 < r["replay_host_ms"] <= r["replay_wall_ms"] and r["row_mode_wall_ms"] > 0
    res.update(device="CPU", torch=torch.__version__, shape="test", union=1.1, repeats=2)
    assert "| 5 (16) | no (eager) |" in slot_prefill.markdown(res)
    assert "replays" not in vars(slots.prefills)  # the forced way's override is gone


def test_cli_on_the_cpu_writes_json_and_markdown(tmp_path):
    out = tmp_path / "sp.json"
    assert slot_prefill.main(["--cpu-layers", "3", "--repeats", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "CPU" and res["routed_matrices"] == 3 * len(PROJS)
    assert [r["tokens"] for r in res["rows"]] == [16] and res["rows"][0]["argmax_equal"]
    assert "`_row_mode` alone" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("args, says", [
    (["--cpu-layers", "2", "--lengths", "64"], "--lengths in 1..32"),
    (["--cpu-layers", "0"], "--cpu-layers >= 1"),
    (["--cpu-layers", "2", "--batch", "1"], "--batch >= 2"),
])
def test_cli_refuses_bad_arguments(tmp_path, capsys, args, says):
    out = tmp_path / "sp.json"
    assert slot_prefill.main([*args, "--out", str(out)]) == 2 and not out.exists()
    assert says in capsys.readouterr().err


def test_cli_without_a_gpu_asks_for_cpu_layers(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for the CPU")
    out = tmp_path / "sp.json"
    assert slot_prefill.main(["--out", str(out)]) == 2 and not out.exists()
    assert "needs a CUDA GPU" in capsys.readouterr().err
