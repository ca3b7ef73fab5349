"""bench/rows_trace.py on the CPU: the bytes it credits each stage of PARSE slots (only the live rows / columns), and
its refusal without a GPU (the stamps are the GPU's global timer; their analysis is tests/test_bench_step_trace.py's).

Run alone:  .venv/bin/python -m pytest tests/test_bench_rows_trace.py -q
"""

from __future__ import annotations

import torch

from rankserve.bench import rows_trace
from rankserve.bench.parse_speed import build, live_bytes, overlapping_subsets
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder
from rankserve.workers.parse_decode import ParseSlots


def test_refuses_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():  # pragma: no cover - the CI machine has none
        return
    assert rows_trace.main(["--out", str(tmp_path / "t.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _norm_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)


def test_stage_bytes_count_the_live_union_only():
    torch.manual_seed(0)
    cfg, K, static, pool, routers = build("tiny", 0.6, 2.0, "cpu", torch.float32)
    B, S = 4, 32
    slots = ParseSlots(pool, routers, DecodeConfig(batch_size=B, max_seq_len=S, graph="none"))
    sizes = slots.load(overlapping_subsets(routers, B, 1.2, seed=3))
    L = cfg.num_hidden_layers
    kv = 2 * B * 10 * cfg.num_key_value_heads * cfg.head_dim * 4
    got = rows_trace.stage_bytes(slots.decoder, 10, slots.live)
    assert len(got) == 10 * L + 1
    assert got[2::10] == [kv] * L and got[3::10][:L] == [0] * L  # attention: every row's keys and values; no merge
    weights = sum(got) - kv * L
    # the live prefix of every routed matrix (and the head), as parse_speed's bytes per step; norms are folded
    assert weights == live_bytes(slots, sizes) - _norm_bytes(slots.model)
    assert weights < sum(rows_trace.stage_bytes(slots.decoder, 10)) - kv * L  # the whole slot width is more
    # the static model: every weight, as bench/decode.py counts them
    dec = FastDecoder(static, DecodeConfig(batch_size=B, max_seq_len=S, graph="none"))
    full = rows_trace.stage_bytes(dec, 10)
    from rankserve.bench.decode import weight_bytes_read
    assert sum(full) - kv * L == weight_bytes_read(static) - _norm_bytes(static)


def test_unions_want_the_svd_llm_family(capsys):
    """PARSE slots come from an svd-llm pool: another family's static model is traced alone (no --unions)."""
    assert rows_trace.main(["--family", "dobi", "--unions", "1.0"]) == 2
    assert "wants --family svd-llm" in capsys.readouterr().err
