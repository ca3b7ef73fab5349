"""Chunked prefill: a long prompt joining a decoding batch goes in a chunk a step (workers/prefill_graph.py
`ChunkedPrefill`, `Engine.prefill_chunk`). The chunks' K/V and last logits equal one whole prefill; the rows already
decoding make a token at every step while it fills; every row's tokens equal its own request alone (static and
PARSE, eager and fast path); n choices of one long prompt fill once; a row stopped while filling frees its slot.

Run alone: .venv/bin/python -m pytest tests/test_chunked_prefill.py -q
"""

from pathlib import Path

import pytest
import torch

from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.engine import Engine
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.prefill_graph import ChunkedPrefill
from rankserve.workers.sampler import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "models" / "stories260K"
LONG = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun with her dog"


def _cache(model, B: int, S: int) -> KVCache:
    cfg = model.cfg
    return KVCache(cfg.num_hidden_layers, B, S, cfg.num_key_value_heads, cfg.head_dim, dtype=model.embed.weight.dtype)


@pytest.mark.parametrize("n, chunk", [(30, 7), (32, 8), (5, 16), (64, 64)])
def test_chunks_equal_one_whole_prefill(n, chunk):
    model, _ = load_checkpoint(BUNDLED, "cpu", torch.float64)
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist()
    want_cache = _cache(model, 1, 128)
    want = model(torch.tensor([ids]), want_cache, last_only=True)[0]  # (V,)
    chunks = ChunkedPrefill(model, 128, graph=False)
    chunks.fill._k.normal_(generator=g)  # stale K/V from an earlier prompt must not leak in
    chunks.fill._v.normal_(generator=g)
    for start in range(0, n, chunk):
        got = chunks.run(ids, start, chunk)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    cache = _cache(model, 3, 128)
    cache.seqlens.copy_(torch.tensor([4, 5, 6]))
    chunks.place(cache, 1, n)
    torch.testing.assert_close(cache.k[:, 1, :n], want_cache.k[:, 0, :n], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(cache.v[:, 1, :n], want_cache.v[:, 0, :n], rtol=1e-9, atol=1e-9)
    assert cache.seqlens.tolist() == [4, n, 6]


def test_bad_chunks_are_refused():
    model, _ = load_checkpoint(BUNDLED, "cpu", torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        ChunkedPrefill(model, 64)
    chunks = ChunkedPrefill(model, 64, graph=False)
    with pytest.raises(ValueError, match="chunk must be"):
        chunks.run([1] * 10, 0, 0)
    with pytest.raises(ValueError, match="no chunk"):
        chunks.run([1] * 10, 10, 8)
    with pytest.raises(ValueError, match="no chunk"):
        chunks.run([1] * 70, 60, 8)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine.load(BUNDLED, prefill_chunk=-1)


def _run(eng: Engine, reqs: list[tuple[str, SamplingParams, int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Requests (prompt, params, the step they join at) through one BatchStream -> each one's tokens, and which rows
    made a token at each step."""
    stream = eng.stream_batch([], [])
    which: dict[int, int] = {}
    got: list[list[int]] = [[] for _ in reqs]
    steps: list[list[int]] = []
    step = 0
    while True:
        for j, (p, sp, at) in enumerate(reqs):
            if at == step:
                which[stream.add(p, sp)] = j
        try:
            events = next(stream)
        except StopIteration:
            if step > max(at for *_, at in reqs):
                break
            events = {}
        steps.append(sorted(which[i] for i in events))
        for i, ev in events.items():
            got[which[i]].append(ev.token_id)
        step += 1
    stream.close()
    return got, steps


@pytest.mark.parametrize("fast_path", ["off", "torch"])
def test_a_long_prompt_joins_a_chunk_a_step(fast_path):
    """While a long prompt fills (8 tokens a step), the decoding rows make a token every step; it makes its first
    token at the step after its last chunk (no step waits for two chunks); every row's tokens are its own request's
    alone."""
    eng = Engine.load(BUNDLED, fast_path=fast_path, prefill_chunk=8)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    n = len(eng.encode_prompt(LONG))
    assert n > 3 * 8
    reqs = [("The dog", sp, 0), (LONG, sp, 3), ("Tom", SamplingParams(max_new_tokens=30, ignore_eos=True), 4)]
    alone = [eng.generate(p, s).token_ids for p, s, _ in reqs]
    got, steps = _run(eng, reqs)
    assert got == alone
    fills = -(-n // 8)
    assert all(0 in s for s in steps[:24])  # the first row never waits
    first = next(i for i, s in enumerate(steps) if 1 in s)
    assert first == 3 + fills  # joined before step 3: chunks at steps 3 .. 3 + fills - 1, then its first token
    assert all(2 in s for s in steps[5:])  # a short prompt behind it is prefilled whole at once


@pytest.mark.parametrize("fast_path", ["off", "torch"])
def test_choices_of_a_long_prompt_fill_once(fast_path):
    eng = Engine.load(BUNDLED, fast_path=fast_path, prefill_chunk=8)
    params = [SamplingParams(max_new_tokens=10, temperature=2.0, seed=s, ignore_eos=True) for s in (1, 2)]
    alone = [eng.generate(LONG, p).token_ids for p in params]
    stream = eng.stream_batch(["The dog"], [SamplingParams(max_new_tokens=40, ignore_eos=True)])
    next(stream)
    rows = [stream.add(LONG, p) for p in params]
    got: dict[int, list[int]] = {r: [] for r in rows}
    for step in stream:
        for i, ev in step.items():
            if i in got:
                got[i].append(ev.token_id)
    assert [got[r] for r in rows] == alone
    assert stream._batch.prefills == 2  # "The dog", then the long prompt once for both choices


def test_a_slot_waiting_to_fill_stays_inside_the_cache():
    """On the fast path every slot steps, a filling row's too: one that waits for other prompts' chunks for longer
    than the cache is long must not step past its end (it crashed: `index 64 is out of bounds`)."""
    eng = Engine.load(BUNDLED, fast_path="torch", max_seq_len=64, prefill_chunk=1)  # one token a step
    sp, busy = SamplingParams(max_new_tokens=8, ignore_eos=True), SamplingParams(max_new_tokens=60, ignore_eos=True)
    longs = [LONG, "The dog ran to the park and saw a big red ball. He wanted to play with it all day",
             "Tom and Sue went to the beach. They built a big sand castle and swam in the sea"]
    assert sum(len(eng.encode_prompt(p)) for p in longs[:2]) > 60  # the last waits about as long as the cache is
    # rows decoding all along: "The dog", then one from BOS alone (one token: no chunks)
    reqs = [("The dog", busy, 0), *[(p, sp, 1) for p in longs], ([1], busy, 30)]
    alone = [eng.generate(p, s).token_ids for p, s, _ in reqs]
    got, _ = _run(eng, reqs)
    assert got == alone


def test_a_row_stopped_while_it_fills_frees_its_slot():
    eng = Engine.load(BUNDLED, max_batch_size=2, prefill_chunk=8)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    stream = eng.stream_batch(["The dog"], [sp])
    next(stream)
    late = stream.add(LONG, sp)
    assert stream.room() == 0
    next(stream)  # its first chunk
    assert stream.room() == 0 and stream._batch.filling
    stream.stop(late, "cancelled")
    next(stream)
    assert stream.room() == 1 and not stream._batch.filling
    again = stream.add(LONG, sp)
    tokens = [ev.token_id for step in stream for i, ev in step.items() if i == again]
    assert tokens == eng.generate(LONG, sp).token_ids


def test_parse_rows_fill_with_their_own_subsets(tmp_path):
    """A PARSE row filling by chunks runs its own subset's masks (eager and rank slots): its tokens are its request's
    alone."""
    from rankserve.compress.parse import TrainConfig, build_parse_checkpoint

    text = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"
    ckpt = build_parse_checkpoint(BUNDLED, tmp_path / "parse", keep=0.6, calib_text=text, train_text=text, steps=2,
                                  kd_steps=0, calib_tokens=2048, calib_seq_len=128,
                                  train=TrainConfig(windows=32, window=32, prompt_len=16, batch_size=16,
                                                    collect_batch=16, eval_every=2, save_every=2),
                                  progress=False)
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    assert Engine.load(ckpt).prefill_chunk == 512  # 0 by default only on the GPU (parse-joins-h200.md)
    for fast_path in ("off", "torch"):
        eng = Engine.load(ckpt, fast_path=fast_path, prefill_chunk=8)
        assert eng.prefix is None  # a PARSE row's K/V depend on its subset: no prefix cache
        subsets = [eng.rank_subset(p) for p in ("The dog", LONG)]
        alone = [eng.generate(p, sp, subset=s).token_ids for p, s in zip(("The dog", LONG), subsets)]
        stream = eng.stream_batch(["The dog"], [sp], subsets=[subsets[0]])
        next(stream)
        late = stream.add(LONG, sp, subsets[1], checked=True)
        got: dict[int, list[int]] = {0: [alone[0][0]], late: []}
        for step in stream:
            for i, ev in step.items():
                got[i].append(ev.token_id)
        assert [got[0], got[late]] == alone, fast_path
