"""Rank padding (workers/align.py) is exact: same logits, shared bases stay shared, masks padded with zeros.

Run alone: .venv/bin/python -m pytest tests/test_align.py -q
"""

import pytest
import torch

from rankserve.workers.align import pad_ranks, padded
from rankserve.workers.config import ModelConfig
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import PROJS, Transformer, proj_name

CFG = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def _model(shared: bool) -> Transformer:
    torch.manual_seed(0)
    ranks = {proj_name(i, p): 9 + 2 * PROJS.index(p) for i in range(2) for p in PROJS}  # 9, 11, ...: unaligned
    groups = {f"{p}.0-1": [proj_name(0, p), proj_name(1, p)] for p in ("q", "gate")} if shared else {}
    m = Transformer(CFG, ranks, groups)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m.eval()


def test_padded():
    assert [padded(r, 8) for r in (1, 8, 9, 1791)] == [8, 8, 16, 1792]


@pytest.mark.parametrize("shared", [False, True])
def test_pad_ranks_is_exact(shared):
    m = _model(shared)
    x = torch.randint(0, CFG.vocab_size, (2, 7))
    with torch.no_grad():
        ref = m(x)
        n = pad_ranks(m, 8)
        got = m(x)
    assert n == len(m.projections())
    assert all(l.rank % 8 == 0 and l.U.shape[1] == l.rank == l.V.shape[0] for l in m.projections().values())
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    if shared:
        lins = m.projections()
        assert lins["layers.0.attn.q"].V is lins["layers.1.attn.q"].V
        m.to(torch.float64)  # .to() re-ties members to the padded basis
        assert lins["layers.0.mlp.gate"].V is lins["layers.1.mlp.gate"].V is m.bases["gate_0-1"]


def test_fast_decoder_on_padded_model_matches_unpadded_eager():
    m = _model(False)
    prompt = torch.randint(0, CFG.vocab_size, (1, 4))
    steps = [torch.randint(0, CFG.vocab_size, (1,)) for _ in range(3)]
    with torch.no_grad():
        cache = KVCache(2, 1, 16, CFG.num_key_value_heads, CFG.head_dim)
        ref = [m(prompt, cache, last_only=True)] + [m(t[:, None], cache, last_only=True) for t in steps]
        pad_ranks(m, 8)
        dec = FastDecoder(m, DecodeConfig(batch_size=1, max_seq_len=16, graph="none"))
        got = [dec.prefill(prompt)] + [dec.step(t).clone() for t in steps]
    for a, b in zip(got, ref):
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-4


def test_mask_is_padded_with_zeros():
    m = _model(False)
    lin = m.projections()["layers.0.attn.k"]
    lin.mask = torch.ones(2, lin.rank)
    pad_ranks(m, 8)
    assert lin.mask.shape == (2, lin.rank) and float(lin.mask[:, 11:].abs().sum()) == 0
