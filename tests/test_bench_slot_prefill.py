"""The slot-prefill timing (bench/slot_prefill.py) on the CPU with a small random pool: both ways give the same
logits, every field is filled, and the CLI refuses to run without a GPU. Run alone:
    python -P -m pytest -q tests/test_bench_slot_prefill.py
"""

import pytest
import torch

from rankserve.bench import slot_prefill
from rankserve.bench.parse_speed import overlapping_subsets
from rankserve.workers.config import ModelConfig
from rankserve.workers.fast_decode import DecodeConfig
from rankserve.workers.model import PROJS, Transformer, proj_name
from rankserve.workers.parse import Routers
from rankserve.workers.parse_decode import ParseSlots
from rankserve.workers.prefill_graph import PrefillGraphs

CFG = ModelConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def _slots(B: int = 2) -> ParseSlots:
    torch.manual_seed(0)
    ranks = {proj_name(i, p): 16 for i in range(CFG.num_hidden_layers) for p in PROJS}
    pool = Transformer(CFG, ranks).eval()
    with torch.no_grad():
        for p in pool.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    routers = Routers(R={}, b={}, k={n: 8 for n in ranks}, r_max=dict(ranks), head={}, perm={})
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=B, max_seq_len=32, backend="torch", graph="none"))
    slots.load(overlapping_subsets(routers, B, 1.1, 0))
    return slots


def test_both_ways_agree_on_the_cpu():
    slots = _slots()
    with pytest.raises(ValueError, match="no one-row prefills"):
        slot_prefill.measure(slots, [5], repeats=1)
    slots.prefills = PrefillGraphs(slots.model, 32, graph=False)
    res = slot_prefill.measure(slots, [5, 20], repeats=2)
    assert res["batch"] == 2 and res["routed_matrices"] == 2 * len(PROJS) and res["row_mode_alone_ms"] > 0
    assert [r["tokens"] for r in res["rows"]] == [5, 20] and [r["bucket"] for r in res["rows"]] == [16, 32]
    for r in res["rows"]:
        assert not r["replays"]  # no graphs on the CPU: both ways run the module eagerly in row mode
        assert r["max_abs_logit_diff"] == 0 and r["argmax_equal"]
        assert 0 < r["replay_host_ms"] <= r["replay_wall_ms"] and r["row_mode_wall_ms"] > 0
    res.update(device="CPU", torch=torch.__version__, shape="test", union=1.1, repeats=2)
    assert "| 5 (16) | no (eager) |" in slot_prefill.markdown(res)
    assert "replays" not in vars(slots.prefills)  # the forced way's override is gone


def test_cli_needs_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for the CPU")
    out = tmp_path / "sp.json"
    assert slot_prefill.main(["--out", str(out)]) == 2 and not out.exists()
    assert "needs a CUDA GPU" in capsys.readouterr().err
