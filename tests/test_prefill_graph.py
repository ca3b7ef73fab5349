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
    assert not graphs.replays(n)  # an eager bucket: the model's modules run on every call


def test_a_prompt_past_the_cache_is_refused():
    model, _ = load_checkpoint(BUNDLED, "cpu", torch.float32)
    graphs = PrefillGraphs(model, 64, graph=False)
    with pytest.raises(ValueError, match="does not fit"):
        graphs.prefill([1] * 65, _cache(model, 1, 256), 0)
    with pytest.raises(ValueError, match="CUDA"):
        PrefillGraphs(model, 64)


def test_prefills_can_share_a_staging_cache():
    """Two PrefillGraphs on one staging cache (PARSE: one per rank-slots model) give what each gives alone; a
    staging cache of more rows or fewer positions than max_len is refused."""
    model, _ = load_checkpoint(BUNDLED, "cpu", torch.float64)
    stage = _cache(model, 1, 256)
    a, b = PrefillGraphs(model, 256, graph=False, stage=stage), PrefillGraphs(model, 128, graph=False, stage=stage)
    assert a.stage is stage and b.stage is stage
    cache = _cache(model, 2, 256)
    got = [a.prefill([5, 6, 7], cache, 0), b.prefill([9, 10], cache, 1), a.prefill([5, 6, 7], cache, 1)]
    torch.testing.assert_close(got[0], got[2], rtol=0, atol=0)
    alone = PrefillGraphs(model, 128, graph=False).prefill([9, 10], _cache(model, 1, 256), 0)
    torch.testing.assert_close(got[1], alone, rtol=1e-12, atol=1e-12)
    for bad in (_cache(model, 2, 256), _cache(model, 1, 64)):
        with pytest.raises(ValueError, match="staging cache of one row"):
            PrefillGraphs(model, 128, graph=False, stage=bad)
