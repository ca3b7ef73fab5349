"""The decode benchmark's pieces that run without a GPU: rank plans, the HF low-rank baseline's equivalence,
the byte counts and the markdown writer. Run alone: .venv/bin/python -m pytest tests/test_bench_decode.py -q
"""

import json

import pytest
import torch

from rankserve.bench.decode import build_model, hf_model, markdown, plan_ranks, weight_bytes_read
from rankserve.workers.checkpoint import count_params
from rankserve.workers.config import ModelConfig, preset

SMALL = ModelConfig(vocab_size=67, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("family", ["svd-llm", "dobi", "basis-sharing"])
@pytest.mark.parametrize("keep", [0.6, 0.8])
def test_rank_plans_hit_keep_on_7b_shape(family, keep):
    cfg = preset("llama-7b")
    ranks, groups = plan_ranks(cfg, family, keep)
    kept, dense = count_params(cfg, ranks, groups)
    assert abs(kept / dense - keep) < 0.03
    if family == "svd-llm":
        assert ranks["layers.0.attn.q"] == int(keep * 4096 / 2) and ranks["layers.5.mlp.up"] == int(keep * 4096 * 11008 / 15104)
    if family == "basis-sharing":
        assert len(groups) == 16 * 5 and ranks["layers.0.attn.q"] == int(4096 * 4096 * 2 * keep / (4096 * 3))
    if family == "dobi":
        assert len({ranks[f"layers.{i}.attn.q"] for i in range(32)}) > 5


@pytest.mark.parametrize("family", ["svd-llm", "basis-sharing"])
def test_hf_lowrank_baseline_computes_the_same_function(family):
    ranks, groups = plan_ranks(SMALL, family, 0.6)
    ours = build_model(SMALL, ranks, groups, "cpu", torch.float32)
    hf = hf_model(SMALL, "cpu", torch.float32, ours)
    x = torch.randint(0, SMALL.vocab_size, (2, 9))
    with torch.no_grad():
        a, b = ours(x), hf(x).logits
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    kept, _ = count_params(SMALL, ranks, groups)
    per_use = sum(l.U.numel() + l.V.numel() for l in ours.projections().values())
    assert weight_bytes_read(ours) == 4 * (per_use + SMALL.hidden_size * (2 * SMALL.num_hidden_layers + 1)
                                           + SMALL.vocab_size * SMALL.hidden_size)
    assert per_use >= kept  # a shared basis is read once per layer that uses it


def test_markdown_renders(tmp_path):
    doc = {"env": {"gpu": "TestGPU", "torch": "x", "triton": "y", "transformers": "z", "cuda": "c", "copy_bw": 4e12},
           "cases": [{"family": "svd-llm", "keep": 0.6, "keep_target": 0.6, "prompt": 128, "batch": 1,
                      "rows": [{"row": "hf-lowrank-eager", "ms_per_token": 9.0, "ms_min": 8.9, "ms_max": 9.2,
                                "tok_s": 111, "bytes_per_token": 8e9, "floor_ms": 2.0, "mbu": 0.22},
                               {"row": "ours-triton-step", "ms_per_token": 2.5, "ms_min": 2.4, "ms_max": 2.6,
                                "tok_s": 400, "bytes_per_token": 8e9, "floor_ms": 2.0, "mbu": 0.8},
                               {"row": "ours-compile", "error": "boom"}]}]}
    p = tmp_path / "d.json"
    p.write_text(json.dumps(doc))
    md = markdown([str(p)])
    assert "TestGPU" in md and "3.60×" in md and "failed: boom" in md and "80%" in md


def test_greedy_summary_is_one_line_with_the_first_mismatch():
    from rankserve.bench.decode import greedy_summary
    clean = dict(steps=64, token_match=1.0, first_mismatch_step=None, max_logit_err=0.05, median_logit_err=0.04,
                 logit_std=1.0, mismatches=[], near_ties=True)
    assert greedy_summary(clean) == "100.0 % of 64 steps x rows agree; max logit error 0.05"
    mism = [dict(row=0, step=7, eager_margin=0.0156, logit_err=0.08), dict(row=3, step=9, eager_margin=0.5,
                                                                              logit_err=0.09)]
    bad = dict(clean, token_match=0.75, first_mismatch_step=7, mismatches=mism, near_ties=False)
    line = greedy_summary(bad)
    assert "\n" not in line and "75.0 %" in line and "2 mismatches, the first at step 7" in line
    assert "NOT all near-ties" in line and "largest eager margin 0.5" in line
    assert greedy_summary(dict(error="boom")) == "failed: boom"


def test_greedy_match_reports_logit_error_and_near_ties():
    from rankserve.bench.decode import greedy_match, make_decoder
    torch.manual_seed(0)
    ranks, groups = plan_ranks(SMALL, "svd-llm", 0.6)
    model = build_model(SMALL, ranks, groups, "cpu", torch.float32)
    dec = make_decoder(model, 1, 12 + 9, "torch", "none")
    g = greedy_match(model, dec, 12, 8)
    # the torch backend computes the eager runtime's function: same tokens, fp32-sized logit errors
    assert g["token_match"] == 1.0 and g["first_mismatch_step"] is None and g["mismatches"] == []
    assert 0 <= g["max_logit_err"] < 1e-4 and g["logit_std"] > 0 and g["near_ties"]
    # a decoder whose logits are off by a large error at one step: the mismatch is reported with its eager margin
    step = dec.step

    def skewed(tok):
        lg = step(tok)
        if int(dec.cache.seqlens[0]) == 12 + 3:  # one step (seqlens advanced past it)
            lg[0, (int(lg[0].argmax()) + 1) % SMALL.vocab_size] += 100.0
        return lg

    dec.step = skewed
    g = greedy_match(model, dec, 12, 8)
    assert g["first_mismatch_step"] is not None and len(g["mismatches"]) == 1
    m = g["mismatches"][0]
    assert m["row"] == 0 and m["step"] == g["first_mismatch_step"] and m["eager_margin"] >= 0
    assert g["max_logit_err"] >= 99 and m["logit_err"] >= 99 and g["near_ties"]  # 100 >> any margin: flippable


def test_engine_gpu_check_needs_a_gpu(tmp_path):
    """bench/engine_gpu_check.py runs on CUDA only; elsewhere it says so instead of failing inside the engine."""
    import torch

    from rankserve.bench import engine_gpu_check

    if torch.cuda.is_available():
        pytest.skip("has a GPU: the check itself runs there (bench/results/engine-gpu-check.md)")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        engine_gpu_check.main(["--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
