"""workers/prefill_graph.py on the CPU (graph=False: the same padded, sync-free forward the GPU captures): a prompt
prefilled through the staging cache into one slot of a batch's cache equals the eager prefill of that row, the
other rows stay as they were, and each length bucket is built once.

Run alone: .venv/bin/python -m pytest tests/test_prefill_graph.py -q
"""

from pathlib import Path

import pytest
import torch

from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.prefill_graph import PrefillGraphs

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "stories260K"


def _cache(model, B: int, S: int) -> KVCache:
    cfg = model.cfg
    return KVCache(cfg.num_hidden_layers, B, S, cfg.num_key_value_heads, cfg.head_dim, dtype=model.embed.weight.dtype)


@pytest.mark.parametrize("n", [1, 5, 16, 17, 100])
def test_prefill_into_a_slot_equals_the_eager_prefill(n):
    model, _ = load_checkpoint(BUNDLED, "cpu", torch.float64)
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist()
    want_cache = _cache(model, 1, 256)
    want = model(torch.tensor([ids]), want_cache, last_only=True)[0]  # (V,)
    cache = _cache(model, 4, 256)
    cache._k.normal_(generator=g)
    cache._v.normal_(generator=g)
    cache.seqlens.copy_(torch.tensor([7, 9, 11, 13]))
    before_k = cache._k.clone()
    graphs = PrefillGraphs(model, 256, graph=False)
    got = graphs.prefill(ids, cache, 2)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(cache.k[:, 2, :n], want_cache.k[:, 0, :n], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(cache.v[:, 2, :n], want_cache.v[:, 0, :n], rtol=1e-9, atol=1e-9)
    assert cache.seqlens.tolist() == [7, 9, n, 13]
    keep = torch.ones(4, dtype=torch.bool)
    keep[2] = False
    assert torch.equal(cache._k[:, keep], before_k[:, keep])
    assert graphs.buckets() == [graphs.bucket(n)] and graphs.bucket(n) >= max(n, 16)


def test_a_prompt_past_the_cache_is_refused():
    model, _ = load_checkpoint(BUNDLED, "cpu", torch.float32)
    graphs = PrefillGraphs(model, 64, graph=False)
    with pytest.raises(ValueError, match="does not fit"):
        graphs.prefill([1] * 65, _cache(model, 1, 256), 0)
    with pytest.raises(ValueError, match="CUDA"):
        PrefillGraphs(model, 64)
