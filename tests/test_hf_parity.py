"""Our runtime's logits equal transformers.LlamaForCausalLM's on the same dense weights (fp32, CPU).

Run alone: .venv/bin/python -m pytest tests/test_hf_parity.py -q
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rankserve.compress.import_dense import HF_PROJ, dense_model, hf_common_name
from rankserve.workers.config import ModelConfig
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import proj_name

CONFIGS = {
    "gqa": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2),
    "mha-untied": dict(hidden_size=48, intermediate_size=130, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=4, tie_word_embeddings=False),
    "llama3-tied": dict(hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "odd-headdim": dict(hidden_size=70, intermediate_size=77, num_hidden_layers=2, num_attention_heads=5,
                        num_key_value_heads=1, head_dim=14, rms_norm_eps=1e-5, rope_theta=1234.5),
    "linear-rope": dict(hidden_size=32, intermediate_size=50, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def _pair(name: str, seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=97, max_position_embeddings=128, **CONFIGS[name])
    kw.setdefault("tie_word_embeddings", False)
    hf = LlamaForCausalLM(LlamaConfig(**kw)).float().eval()
    with torch.no_grad():  # HF initialises norms to 1: randomise them so the test sees their weights
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    native = {}
    for k, t in hf.state_dict().items():
        name = hf_common_name(k)
        if name:
            native[name] = t
            continue
        for p, hp in HF_PROJ.items():
            parts = k.split(".")
            if k.endswith(f"{hp}.weight"):
                native[f"{proj_name(int(parts[2]), p)}.weight"] = t
    if cfg.tie_word_embeddings:
        native.pop("lm_head.weight", None)
    return hf, dense_model(cfg, native).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_forward_matches_hf(name):
    hf, ours = _pair(name)
    tokens = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert _rel(got, ref) <= 1e-5


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_steps_match_full_reforward(name):
    hf, ours = _pair(name, seed=1)
    B, P, steps = 2, 9, 32
    tokens = torch.randint(0, 97, (B, P + steps))
    cfg = ours.cfg
    cache = KVCache(cfg.num_hidden_layers, B, P + steps, cfg.num_key_value_heads, cfg.head_dim)
    with torch.no_grad():
        ours(tokens[:, :P], cache)
        for s in range(steps):
            step_logits = ours(tokens[:, P + s:P + s + 1], cache)[:, 0]
            ref = hf(tokens[:, :P + s + 1]).logits[:, -1]
            assert _rel(step_logits, ref) <= 1e-5, f"decode step {s + 1}"


def test_padded_batch_prefill_matches_unpadded():
    _, ours = _pair("gqa", seed=2)
    a, b = torch.randint(0, 97, (1, 12)), torch.randint(0, 97, (1, 7))
    batch = torch.zeros(2, 12, dtype=torch.long)
    batch[0], batch[1, :7] = a[0], b[0]
    lengths = torch.tensor([12, 7], dtype=torch.int32)
    cfg = ours.cfg
    with torch.no_grad():
        cache = KVCache(cfg.num_hidden_layers, 2, 20, cfg.num_key_value_heads, cfg.head_dim)
        last = ours(batch, cache, lengths, last_only=True)
        assert _rel(last[0], ours(a)[0, -1]) <= 1e-5
        assert _rel(last[1], ours(b)[0, -1]) <= 1e-5
        assert cache.seqlens.tolist() == [12, 7]
        nxt = torch.randint(0, 97, (2, 1))  # one decode step continues each row at its own position
        step = ours(nxt, cache, last_only=True)
        assert _rel(step[1], ours(torch.cat([b, nxt[1:]], 1))[0, -1]) <= 1e-5
        assert _rel(step[0], ours(torch.cat([a, nxt[:1]], 1))[0, -1]) <= 1e-5


def test_an_activation_other_than_silu_is_refused():
    """The runtime's MLP is SiLU-gated: a gelu config must not import as a silently different model."""
    d = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    hidden_act="gelu").to_dict()
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_hf(d)
    assert ModelConfig.from_hf({**d, "hidden_act": "silu"}).hidden_size == 16


def test_swish_is_read_as_silu():
    """HF runs hidden_act "swish" as SiLU (transformers.activations.ACT2FN): the same model, not refused."""
    from transformers.activations import ACT2FN

    x = torch.randn(64)
    assert torch.equal(ACT2FN["swish"](x), torch.nn.functional.silu(x))
    d = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    hidden_act="swish").to_dict()
    assert ModelConfig.from_hf(d).hidden_size == 16
