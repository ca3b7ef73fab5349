"""Prefix cache (workers/prefix_cache.py): longest block-aligned common prefix, at least one token left to run, LRU
within the byte budget, entries extended or held already not stored twice; through the engine, a prompt that starts
like an earlier one prefills only the rest and decodes the tokens an engine without the cache gives (fp32, eager
and fast path), alone and joining a running batch.

Run alone: .venv/bin/python -m pytest tests/test_prefix_cache.py -q
"""

from pathlib import Path

import pytest
import torch

from rankserve.workers.engine import Engine
from rankserve.workers.prefix_cache import PrefixCache
from rankserve.workers.sampler import SamplingParams

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "stories260K"
STORY = ("Once upon a time there was a little girl named Lily. She loved to play outside in the sun with her dog. "
         "One day they went to the park and saw a big red ball under a tree. ")


def _kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, n, 1, 4, generator=g), torch.randn(2, n, 1, 4, generator=g)  # (L, n, H_kv, D)


def test_match_takes_the_longest_block_aligned_prefix():
    c = PrefixCache(max_bytes=1 << 20, block=4)
    a, b = list(range(10)), list(range(6)) + [99, 98, 97, 96, 95, 94]
    ka, va = _kv(10)
    c.store(a, ka, va)  # keeps a[:8]
    c.store(b, *_kv(12, 1))  # keeps b[:12]
    assert len(c) == 2
    p, k, v = c.match(list(range(9)) + [50])  # shares 9 tokens with a: 8 held
    assert p == 8 and torch.equal(k, ka[:, :8]) and torch.equal(v, va[:, :8])
    assert c.match(list(range(8)))[0] == 4  # one token is left to run: 7 common -> 4
    assert c.match([5, 6, 7, 8, 9])[0] == 0  # no common first block
    p, k, _ = c.match(b + [1])
    assert p == 12 and k.shape == (2, 12, 1, 4)
    assert (c.hits, c.misses, c.hit_tokens) == (3, 1, 24)


def test_store_keeps_one_copy_and_drops_the_least_recent():
    kv = _kv(16)
    size = 2 * kv[0][:, :8].numel() * 4  # fp32 bytes of an 8-token entry
    c = PrefixCache(max_bytes=2 * size, block=8)
    c.store(list(range(8)), *kv)
    c.store(list(range(16)), *kv)  # extends the first: it replaces it
    assert len(c) == 1 and c.bytes == 2 * size
    c.store(list(range(8)) + [0], *kv)  # held inside the longer entry: nothing new
    assert len(c) == 1
    c.store([7] * 8, *kv)  # over the budget: the least recently used goes
    assert len(c) == 1 and c.match([7] * 9)[0] == 8 and c.match(list(range(17)))[0] == 0
    c.store(list(range(40)), *_kv(40))  # alone larger than the budget: not stored
    assert len(c) == 1 and c.bytes == size
    c.store([1, 2, 3], *kv)  # shorter than a block: nothing to keep
    assert len(c) == 1
    with pytest.raises(ValueError):
        PrefixCache(-1)


@pytest.mark.parametrize("fast_path", ["off", "torch"])
def test_a_prompt_that_starts_alike_prefills_only_the_rest(fast_path):
    eng = Engine.load(BUNDLED, fast_path=fast_path)
    plain = Engine.load(BUNDLED, fast_path=fast_path, prefix_cache_bytes=0)
    assert plain.prefix is None and eng.prefix is not None
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    first, second = STORY * 2 + "Lily ran", STORY * 2 + "The dog barked at a cat"
    n = len(eng.encode_prompt(second))
    assert eng.generate(first, sp).token_ids == plain.generate(first, sp).token_ids
    assert len(eng.prefix) == 1 and eng.prefix.hits == 0
    stream = eng.stream_batch([second], [sp])
    got = [ev.token_id for step in stream for ev in step.values()]
    assert got == plain.generate(second, sp).token_ids
    hit = eng.prefix.hit_tokens
    assert eng.prefix.hits == 1 and hit >= 64 and hit % 64 == 0 and hit < n
    assert stream._batch.chunks == 1  # one chunk: the rest after the hit
    # a batch of requests sharing the story, joining a running one: each its own tokens
    tails = ["Tom", "The sun was hot", "A bird sang in the tree", "Lily"]
    stream = eng.stream_batch(["The dog"], [SamplingParams(max_new_tokens=30, ignore_eos=True)])
    next(stream)
    rows = {stream.add(STORY * 2 + t, sp): t for t in tails}
    out: dict[int, list[int]] = {i: [] for i in rows}
    for step in stream:
        for i, ev in step.items():
            if i in out:
                out[i].append(ev.token_id)
    assert [out[i] for i in rows] == [plain.generate(STORY * 2 + t, sp).token_ids for t in tails]
    assert eng.prefix.hits == 5


def test_a_zero_budget_turns_it_off():
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        Engine.load(BUNDLED, prefix_cache_bytes=-1)
    assert Engine.load(BUNDLED, prefix_cache_bytes=0).prefix is None
