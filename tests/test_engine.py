"""Engine: greedy text of the bundled model, batching, streaming, stop handling, sampling.

Run alone: .venv/bin/python -m pytest tests/test_engine.py -q
"""

from pathlib import Path

import pytest
import torch

from rankserve.workers.engine import Engine
from rankserve.workers.sampler import SamplingParams, sample

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "stories260K"


@pytest.fixture(scope="module")
def engine():
    return Engine.load(BUNDLED)


def test_bundled_model_tells_its_story(engine):
    r = engine.generate("", SamplingParams(max_new_tokens=40))
    assert r.text.startswith("Once upon a time, there was a little girl named Lily. She loved to play outside")
    assert r.num_prompt_tokens == 1 and r.finish_reason == "length" and len(r.token_ids) == 40


def test_batch_equals_single(engine):
    prompts = ["Once upon a time", "The dog", "Lily and Ben went to the park"]
    params = [SamplingParams(max_new_tokens=n) for n in (12, 20, 7)]
    batch = engine.generate_batch(prompts, params)
    for p, sp, b in zip(prompts, params, batch):
        single = engine.generate(p, sp)
        assert single.token_ids == b.token_ids and single.text == b.text


def test_stream_batch_is_each_request_alone(engine):
    """A batch stream: each row's events are its own stream's; a row stopped from outside ends there while the
    others go on unchanged; rows finish at different steps (None after that)."""
    prompts = ["Once upon a time", "The dog", "Lily and Ben went to the park"]
    params = [SamplingParams(max_new_tokens=n, logprobs=1) for n in (12, 20, 7)]
    alone = [list(engine.stream(p, sp)) for p, sp in zip(prompts, params)]
    batch = engine.stream_batch(prompts, params)
    got: list[list] = [[], [], []]
    for i, step in enumerate(batch):
        for j, ev in step.items():
            got[j].append(ev)
        if i == 4:
            batch.stop(1, "cancelled")
            row1 = batch.rows[1]
    batch.close()

    def key(events):  # logprobs agree to float rounding (a padded batch sums in another order)
        return [(e.token_id, e.text, e.finish_reason, [l.token for l in e.logprobs]) for e in events]

    def lps(events):
        return [l.logprob for e in events for l in e.logprobs]

    assert key(got[0]) == key(alone[0]) and key(got[2]) == key(alone[2])
    assert key(got[1]) == key(alone[1][:5]) and row1.finish == "cancelled" and not batch.rows
    for g, a in zip(got, alone):
        assert lps(g) == pytest.approx(lps(a)[:len(lps(g))], abs=1e-5)
    with pytest.raises(ValueError, match="no PARSE rank experts"):
        engine.stream_batch(prompts[:1], params[:1], [{"v": 1, "k": {}}])


def test_prompt_logprobs_score_what_generation_produced(engine):
    """Scoring prompt + completion (echo) gives the completion's tokens the logprobs and alternatives generation
    reported, and the prompt's tokens spell the prompt with their offsets."""
    prompt = "Once upon a time"
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=12, logprobs=3, ignore_eos=True))
    p_ids = engine.tokenizer.encode(prompt)
    assert engine.tokenizer.encode(prompt + gen.text) == p_ids + gen.token_ids  # the text round-trips
    scored = engine.prompt_logprobs(prompt + gen.text, 3)
    assert len(scored) == len(p_ids) - 1 + len(gen.token_ids)  # every token but the BOS
    head, tail = scored[:len(p_ids) - 1], scored[len(p_ids) - 1:]
    assert "".join(e.token for e in head) == prompt
    assert [e.offset for e in head] == [len("".join(x.token for x in head[:i])) for i in range(len(head))]
    assert all(e.logprob is not None and e.logprob <= 0 and len(e.top) == 3 for e in scored)
    assert [e.token for e in tail] == [e.token for e in gen.logprobs]
    assert [e.logprob for e in tail] == pytest.approx([e.logprob for e in gen.logprobs], abs=1e-4)
    assert [[t for t, _, _ in e.top] for e in tail] == [[t for t, _, _ in e.top] for e in gen.logprobs]
    assert [e.offset - len(prompt) for e in tail] == [e.offset for e in gen.logprobs]
    assert engine.prompt_logprobs(prompt)[0].top == []  # top 0: no alternatives
    for top in (-1, 21):  # a torch RuntimeError (topk of -1) before
        with pytest.raises(ValueError, match=r"top must be in \[0, 20\]"):
            engine.prompt_logprobs(prompt, top)


def test_prompt_logprobs_in_pieces_equal_whole(engine, monkeypatch):
    """The head applied to 3 positions at a time (a long prompt's pieces) gives the same entries."""
    import rankserve.workers.engine as engine_module

    text = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    whole = engine.prompt_logprobs(text, 2)
    monkeypatch.setattr(engine_module, "PROMPT_CHUNK", 3)
    pieces = engine.prompt_logprobs(text, 2)
    assert [(e.token, e.offset, [t for t, _, _ in e.top]) for e in pieces] == \
        [(e.token, e.offset, [t for t, _, _ in e.top]) for e in whole]
    # fp32: the head's GEMM over 3 rows blocks its sums differently from one over every row (2.8e-6 measured on a
    # 2-core CPU; 1e-6 passed on another), so 1e-5: far below any real difference between two tokens' logprobs
    assert [e.logprob for e in pieces] == pytest.approx([e.logprob for e in whole], abs=1e-5)
    assert len(engine.prompt_logprobs("Once", 1)) == 1  # one token after the BOS: one piece


def test_stream_concatenates_to_generate(engine):
    sp = SamplingParams(max_new_tokens=30, stop=("park",))
    events = list(engine.stream("Once upon a time", sp))
    full = engine.generate("Once upon a time", sp)
    assert "".join(e.text for e in events) == full.text
    assert events[-1].finish_reason == full.finish_reason
    assert all(e.finish_reason is None for e in events[:-1])


def test_stop_string_cuts_text(engine):
    r = engine.generate("", SamplingParams(max_new_tokens=40, stop=("Lily",)))
    assert r.finish_reason == "stop" and r.text == "Once upon a time, there was a little girl named "


def test_one_stop_string_is_not_split_into_characters(engine):
    """stop="Lily" (a string, as OpenAI's `stop` may be) is one stop string, not the stops "L", "i", "l", "y"."""
    assert SamplingParams(stop="Lily").stop == ("Lily",)
    r = engine.generate("", SamplingParams(max_new_tokens=40, stop="Lily"))
    assert r.finish_reason == "stop" and r.text == "Once upon a time, there was a little girl named "


def test_stop_token(engine):
    first = engine.generate("", SamplingParams(max_new_tokens=5)).token_ids
    r = engine.generate("", SamplingParams(max_new_tokens=5, stop_token_ids=(first[2],)))
    assert r.finish_reason == "stop" and r.token_ids == first[:2]


def test_held_back_text_is_released_when_the_row_ends_otherwise(engine):
    """A tail held back because it could start a stop string ("little" of "little boy") is text the model wrote:
    a row that then ends on a stop token or at the context limit still returns it."""
    ids = engine.generate("", SamplingParams(max_new_tokens=16)).token_ids
    at = next(i for i in range(1, 16) if engine.tokenizer.decode(ids[:i]).endswith(" little"))
    r = engine.generate("", SamplingParams(max_new_tokens=16, stop=("little boy",), stop_token_ids=(ids[at],)))
    assert r.finish_reason == "stop" and r.token_ids == ids[:at]
    assert r.text == engine.tokenizer.decode(ids[:at]) and r.text.endswith("little")
    events = list(engine.stream("", SamplingParams(max_new_tokens=16, stop=("little boy",),
                                                   stop_token_ids=(ids[at],))))
    assert "".join(e.text for e in events) == r.text
    short = Engine.load(BUNDLED, max_seq_len=at + 1)  # BOS + `at` tokens fill the context
    r = short.generate("", SamplingParams(max_new_tokens=50, stop=("little boy",)))
    assert r.finish_reason == "length" and r.token_ids == ids[:at] and r.text.endswith("little")


def test_bundled_model_ends_its_story_at_bos(engine):
    """llama2.c models end a story with BOS (id 1): generation stops there instead of running into the next."""
    assert 1 in engine.eos
    r = engine.generate("", SamplingParams(max_new_tokens=400))
    assert r.finish_reason == "stop" and 1 not in r.token_ids and len(r.token_ids) < 400


def test_seeded_sampling_reproducible(engine):
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    a, b = engine.generate("The cat", sp), engine.generate("The cat", sp)
    assert a.token_ids == b.token_ids
    c = engine.generate("The cat", SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=8))
    assert c.token_ids != a.token_ids


def test_top_k_and_top_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.randn(50)
    g = torch.Generator().manual_seed(0)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert {sample(logits, SamplingParams(temperature=1.0, top_k=3), g) for _ in range(200)} <= top3
    probs = torch.softmax(logits, -1)
    order = torch.argsort(probs, descending=True)
    need = int((torch.cumsum(probs[order], 0) < 0.5).sum()) + 1  # smallest prefix with mass >= 0.5
    allowed = set(order[:need].tolist())
    assert {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), g) for _ in range(300)} <= allowed


def test_ties_resolve_as_argmax_does():
    """top_k=1 and a tiny top_p are greedy even where logits tie (common in bf16): the lowest id wins, as argmax."""
    logits = torch.tensor([1.0, 3.0, 3.0, 0.5, 3.0])
    g = torch.Generator().manual_seed(0)
    for sp in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        assert {sample(logits, sp, g) for _ in range(100)} == {int(torch.argmax(logits))} == {1}
    assert {sample(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)} == {1, 2}


def test_unseeded_sampling_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    a = torch.rand(3)
    torch.manual_seed(123)
    SamplingParams(temperature=1.0).generator()
    assert torch.equal(torch.rand(3), a)


def test_token_id_prompts_are_used_as_given(engine):
    """A prompt of token ids generates and scores exactly as its text does when the ids are the text's (BOS
    included); no BOS is added to ids; an id outside the vocabulary is refused, naming it; decode_prompt gives the
    text back."""
    text = "Once upon a time, there was a little girl"
    ids = engine.tokenizer.encode(text, bos=True)
    sp = SamplingParams(max_new_tokens=8, temperature=0, logprobs=2)
    a, b = engine.generate(text, sp), engine.generate(ids, sp)
    assert (b.token_ids, b.text, b.num_prompt_tokens) == (a.token_ids, a.text, a.num_prompt_tokens)
    assert engine.encode_prompt(ids[1:]) == ids[1:]  # without a BOS: none added
    assert [e.token for e in engine.prompt_logprobs(ids, 2)] == [e.token for e in engine.prompt_logprobs(text, 2)]
    bare = engine.prompt_logprobs(ids[1:], 2)  # nothing precedes the first token: no logprob, as OpenAI's
    assert bare[0].logprob is None and all(e.logprob is not None for e in bare[1:])
    assert len(bare) == len(ids) - 1
    assert engine.decode_prompt(ids) == text
    ev = list(engine.stream(ids, SamplingParams(max_new_tokens=8, temperature=0)))
    assert [e.token_id for e in ev] == a.token_ids
    n = engine.tokenizer.vocab_size
    for bad in ([1, n], [-1], [1, True], [2.0]):
        with pytest.raises(ValueError, match=f"token id {bad[-1]!r} at position {len(bad) - 1} is not a token"):
            engine.encode_prompt(bad)
    with pytest.raises(ValueError, match="not a token"):
        engine.decode_prompt([n + 5])
    with pytest.raises(ValueError, match="context limit"):
        engine.generate(ids * 200)


def test_empty_prompt_without_bos_is_refused():
    e = Engine.load(BUNDLED)
    e.tokenizer.bos_id = None
    with pytest.raises(ValueError, match="prompt is empty"):
        e.generate("", SamplingParams(max_new_tokens=3))


def test_empty_ids_prompt_is_refused_for_what_it_is(engine):
    """An empty list of ids is refused as such, not blamed on a tokenizer without BOS (this one has one)."""
    assert engine.tokenizer.bos_id is not None
    with pytest.raises(ValueError, match="the prompt has no token ids"):
        engine.generate([], SamplingParams(max_new_tokens=3))


def test_bad_params_and_long_prompt(engine):
    for kw in (dict(max_new_tokens=0), dict(temperature=-1), dict(temperature=1e-40), dict(top_p=0), dict(top_p=1.5),
               dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="temperature must be 0 .greedy. or finite"):  # inf sampled uniformly
        SamplingParams(temperature=float("inf"))
    for seed in (2**63, -2**63 - 1, 2**70):  # torch's own error said only "Overflow when unpacking long long"
        with pytest.raises(ValueError, match=r"seed must be in \[-9223372036854775808, 9223372036854775807\]"):
            SamplingParams(temperature=1.0, seed=seed)
    lo, hi = SamplingParams(seed=-2**63).generator(), SamplingParams(seed=2**63 - 1).generator()
    assert lo.initial_seed() != hi.initial_seed()  # the range's ends are two generator states
    with pytest.raises(ValueError, match="context limit"):
        engine.generate("Once upon a time " * 200)
    # a prompt of exactly the context: the message says why it does not fit ("512 tokens; the limit is 512" did not)
    with pytest.raises(ValueError, match="is 512 tokens; the context limit is 512 tokens for the prompt and its first "
                                         "generated token: shorten it by 1"):
        engine.generate([1] * 512)
    assert len(engine.prompt_logprobs([1] * 512)) == 511  # scoring alone needs no room


def test_text_keeps_the_leading_space(engine):
    """SentencePiece drops a word's leading space when it starts the decoded ids: the engine decodes in context."""
    r = engine.generate("Once upon a time, there was a little girl named Lily.", SamplingParams(max_new_tokens=5))
    assert r.text.startswith(" ") and engine.tokenizer.decode(r.token_ids) == r.text.lstrip(" ")


@pytest.mark.parametrize("model", ["stories260K", "reference"])
def test_incremental_text_equals_decoding_everything(model):
    """A row's text is decoded a window at a time; at every step it equals decoding the prompt's last tokens and
    every generated token again (the old way): natural text, and random ids (byte pieces that start characters
    they never finish, specials, words), SentencePiece (stories260K) and a tokenizer.json (reference)."""
    from rankserve.workers.engine import _Row
    from rankserve.workers.tokenizer import Tokenizer

    tok = Tokenizer.load(BUNDLED.parent / model)
    text = "Once upon a time, there was a girl named Zoë who said: \u201cna\u00efve caf\u00e9s\u201d \u2014 ok \U0001f600!"
    g = torch.Generator().manual_seed(0)
    seqs = [tok.encode(text), torch.randint(0, tok.vocab_size, (300,), generator=g).tolist(),
            torch.randint(0, min(tok.vocab_size, 300), (300,), generator=g).tolist()]  # bytes, specials
    for prompt, ids in [([], seqs[0]), (tok.encode("The dog"), seqs[0][1:]), (tok.encode("Hi"), seqs[1]),
                        ([1], seqs[2])]:
        row = _Row(prompt, SamplingParams(max_new_tokens=1000, ignore_eos=True), ())
        for t in ids:
            row.ids.append(t)
            got = row._text(tok)
            whole, before = tok.decode(row.context + row.ids), tok.decode(row.context)
            assert got == (whole[len(before):] if whole.startswith(before) else tok.decode(row.ids)), len(row.ids)
        assert row._start > 0 or len(ids) < 8  # it did move on


def test_incremental_text_keeps_the_spaces_after_a_lone_space_piece(engine):
    """SentencePiece drops every leading "▁" piece of a text ("▁", "▁li" reads "li"): a window starting at a lone
    "▁" lost the spaces after it. The bundled model wrote "sky.", "▁", "▁li", "ved" (temperature 1.5, seed 50)."""
    from rankserve.workers.engine import _Row

    tok = engine.tokenizer
    prompt = tok.encode("Once upon a time")
    for pieces in [[".", "▁", "▁li", "ved"], ["ce", "▁", "▁", "▁Once"], ["▁", "▁", "▁", "k"]]:
        row = _Row(prompt, SamplingParams(max_new_tokens=10), ())
        for p in pieces:
            row.ids.append(tok._impl.piece_to_id(p))
            got = row._text(tok)
            whole, before = tok.decode(row.context + row.ids), tok.decode(row.context)
            assert got == whole[len(before):], pieces
    r = engine.generate("Once upon a time", SamplingParams(max_new_tokens=120, temperature=1.5, seed=50,
                                                           ignore_eos=True))
    whole, before = tok.decode(prompt[-4:] + r.token_ids), tok.decode(prompt[-4:])
    assert r.text == whole[len(before):] and "sky.  lived" in r.text


def test_fast_path_gives_the_eager_tokens():
    """The engine's thin decode path (torch backend, no graphs on CPU) generates what the eager loop does."""
    fast = Engine.load(BUNDLED, fast_path="torch")
    eager = Engine.load(BUNDLED, fast_path="off")
    prompts = ["Once upon a time", "The dog ran", "Lily"]
    params = [SamplingParams(max_new_tokens=n, stop=("park",)) for n in (30, 12, 21)]
    for a, b in zip(fast.generate_batch(prompts, params), eager.generate_batch(prompts, params)):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
    sp = SamplingParams(max_new_tokens=25, temperature=0.9, top_k=20, seed=3)
    assert fast.generate("The cat", sp).token_ids == eager.generate("The cat", sp).token_ids
    # more rows joining at once than the prefill graphs take (PREFILL_GRAPH_ROWS): one eager forward for them all
    six = prompts * 2
    assert [r.token_ids for r in fast.generate_batch(six, params * 2)] == \
        [r.token_ids for r in eager.generate_batch(six, params * 2)]
    # greedy rows take the argmax the step took on the device, sampled rows sample on the host, in one batch
    mixed = [SamplingParams(max_new_tokens=14), SamplingParams(max_new_tokens=14, temperature=0.8, seed=5)]
    assert [r.token_ids for r in fast.generate_batch(prompts[:2], mixed)] == \
        [r.token_ids for r in eager.generate_batch(prompts[:2], mixed)]
    assert all(d.dcfg.greedy for d in fast._decoders.values())
    # one decoder per (batch-size bucket, cache bucket): the batch of 3 ran in the bucket of 4, one row idle, and
    # moved to 2 and 1 as its rows ended
    assert sorted(fast._decoders) == [(1, 256), (2, 256), (4, 256), (8, 256)]
    # packed weights shared per layout (the torch backend has one: no fused norms)
    assert all(d.layers is fast._packed[False] for d in fast._decoders.values())


def test_decoders_held_within_their_memory_budget():
    """Decoders past `decoder_memory_bytes` go least recently used first; generation is unchanged."""
    eager = Engine.load(BUNDLED, fast_path="off")
    one = Engine.load(BUNDLED, fast_path="torch")
    assert one.decoder_memory_bytes is None  # CPU: unbounded by default (CUDA: 40 % of the GPU's memory)
    one.generate("The dog", SamplingParams(max_new_tokens=4))
    size = next(iter(one._held.values()))  # one B = 1, S = 256 decoder's KV cache
    assert size > 0
    fixed = one._prefill_bytes()  # the one-row prefill caches built while generating: they stay
    tight = Engine.load(BUNDLED, fast_path="torch", decoder_memory_bytes=3 * size + fixed)
    sp = SamplingParams(max_new_tokens=10)
    prompts = ["Once upon a time", "The dog ran", "Lily"]
    for batch in ([prompts[0]], prompts[:2], [prompts[0]]):  # B = 1, then 2 (needs 2 x size: B = 1 goes), then 1
        got = tight.generate_batch(batch, [sp] * len(batch))
        assert [g.token_ids for g in got] == [r.token_ids for r in eager.generate_batch(batch, [sp] * len(batch))]
        assert sum(tight._held.values()) + tight._prefill_bytes() <= 3 * size + fixed
    assert list(tight._held) == [("dec", 2, 256), ("dec", 1, 256)] and sorted(tight._decoders) == [(1, 256), (2, 256)]
    tight.generate_batch(prompts, [sp] * 3)  # B = 3 -> the bucket of 4 (4 x size): everything else goes
    assert list(tight._held) == [("dec", 4, 256)]


def test_one_row_prefill_caches_count_against_the_decoder_budget():
    """The one-row caches a joining prompt is prefilled into (the prefill graphs' staging cache: the whole context)
    stay once built, so they come off `decoder_memory_bytes`: two decoders that fit a budget beside them are held
    together, a budget short of them by their bytes keeps only the most recent."""
    sp = SamplingParams(max_new_tokens=4)
    probe = Engine.load(BUNDLED, fast_path="torch")
    probe.generate("The dog", sp)
    size = next(iter(probe._held.values()))  # a B = 1, S = 256 decoder's KV cache
    stage = probe._prefill_graphs().stage.nbytes()  # one row of the whole context (512 positions)
    assert probe._prefill_bytes() >= stage > size
    fixed = probe._prefill_bytes()  # the staging cache and the chunked prefill's fill cache
    for budget, held in ((3 * size + fixed, [("dec", 1, 256), ("dec", 2, 256)]),  # 1 + 2 sizes fit beside them
                         (3 * size, [("dec", 2, 256)]),  # they did without counting them
                         (int(2.5 * size) + fixed, [("dec", 2, 256)])):
        e = Engine.load(BUNDLED, fast_path="torch", decoder_memory_bytes=budget)
        e.generate_batch(["Once upon a time"], [sp])
        e.generate_batch(["Once upon a time", "The dog ran"], [sp] * 2)  # B = 2: ~2 x size more
        assert e._prefill_bytes() == probe._prefill_bytes()  # built while generating, as in the probe
        assert list(e._held) == held
        assert sum(e._held.values()) + e._prefill_bytes() <= max(budget, 2 * size + fixed)  # the newest is kept


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_models_own(engine, temperature):
    """Each token's logprob and its step's top-n equal log_softmax of a teacher-forced forward of the whole sequence
    (fp64 reference), whatever the temperature; the tokens' texts add up to the text."""
    prompt = "Once upon a time"
    sp = SamplingParams(max_new_tokens=12, temperature=temperature, seed=1, logprobs=3)
    r = engine.generate(prompt, sp)
    assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids) == 12
    assert "".join(l.token for l in r.logprobs) == r.text

    ids = engine.encode_prompt(prompt, sp) + r.token_ids
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids]))[0].double()  # (S, V)
    ref = torch.log_softmax(logits, -1)[len(ids) - 13:-1]  # the steps that chose each generated token
    got = torch.tensor([l.logprob for l in r.logprobs], dtype=torch.float64)
    want = ref[torch.arange(12), torch.tensor(r.token_ids)]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    for step, l in enumerate(r.logprobs):
        top = torch.topk(ref[step], 3)
        assert torch.allclose(torch.tensor([v for _, v, _ in l.top], dtype=torch.float64), top.values, atol=1e-4)
        assert [t.strip() for t, _, _ in l.top] == [engine.tokenizer.decode([i]).strip() for i in top.indices.tolist()]
    if temperature == 0:  # greedy: the chosen token is the most likely one
        assert all(l.token == l.top[0][0] and l.logprob == l.top[0][1] for l in r.logprobs)

    assert [l.offset for l in r.logprobs] == [len("".join(x.token for x in r.logprobs[:i])) for i in range(12)]
    assert all(bytes(l.bytes).decode() == l.token.lstrip() or bytes(l.bytes).decode() == l.token
               for l in r.logprobs)
    events = list(engine.stream(prompt, sp))
    assert [l for e in events for l in e.logprobs] == r.logprobs  # same seed, same tokens, same entries
    assert engine.generate(prompt, SamplingParams(max_new_tokens=4)).logprobs is None  # not asked: none


def test_logprobs_end_where_the_text_ends(engine):
    """Tokens cut off by a stop string, and a stop token, write no text: they get no entry. Streamed, an entry comes
    with the event that releases its token's text."""
    free = engine.generate("Once upon a time", SamplingParams(max_new_tokens=8, logprobs=1))
    assert free.text == ", there was a little girl"
    sp = SamplingParams(max_new_tokens=8, logprobs=1, stop=("s a ",))  # cuts " was" after "wa"
    r = engine.generate("Once upon a time", sp)
    assert r.text == ", there wa" and [l.token for l in r.logprobs] == [",", " there", " was"]
    events = list(engine.stream("Once upon a time", sp))
    assert [(e.text, [l.token for l in e.logprobs]) for e in events] == [
        (",", [","]), (" there", [" there"]), (" wa", [" was"]), ("", []), ("", [])]

    eos = engine.generate("", SamplingParams(max_new_tokens=5)).token_ids[2]
    r = engine.generate("", SamplingParams(max_new_tokens=5, stop_token_ids=(eos,), logprobs=0))
    assert r.finish_reason == "stop" and len(r.logprobs) == len(r.token_ids) == 2


def test_generation_config_eos_ends_a_reply(tmp_path):
    """A chat model's end-of-turn id, listed in generation_config.json only, stops generation like EOS."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(BUNDLED, d)
    first = Engine.load(d).generate("", SamplingParams(max_new_tokens=5)).token_ids
    (d / "generation_config.json").write_text(f'{{"eos_token_id": [2, {first[3]}]}}')
    e = Engine.load(d)
    assert first[3] in e.eos and 2 in e.eos
    r = e.generate("", SamplingParams(max_new_tokens=5))
    assert r.finish_reason == "stop" and r.token_ids == first[:3]
    r = e.generate("", SamplingParams(max_new_tokens=5, ignore_eos=True))  # the request's ignore_eos
    assert r.finish_reason == "length" and r.token_ids == first
    (d / "generation_config.json").write_text("[1, 2]")  # not an object: ignored
    assert first[3] not in Engine.load(d).eos


@pytest.mark.parametrize("fast_path", ["off", "torch"])
def test_rows_join_a_running_batch(fast_path):
    """Continuous batching: requests added between steps join the running batch (into a free slot, or moving the
    batch to a larger bucket or a longer cache), finished rows leave (the batch shrinks to a smaller bucket), and
    every row's tokens are what it gets alone."""
    eng = Engine.load(BUNDLED, fast_path=fast_path)
    # (prompt, max_new_tokens, temperature, the step it joins at)
    reqs = [("Once upon a time", 30, 0.0, 0), ("The dog", 12, 0.0, 3), ("Lily and Ben went to the park", 20, 0.8, 3),
            ("The cat", 300, 0.0, 9), ("Tom", 8, 0.0, 15), ("Sue had a red ball", 6, 0.0, 40)]
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=7, ignore_eos=True) for _, n, t, _ in reqs]
    alone = [eng.generate(p, sp).token_ids for (p, *_), sp in zip(reqs, params)]
    stream = eng.stream_batch([reqs[0][0]], [params[0]])
    which, got, step = {0: 0}, [[] for _ in reqs], 0
    sizes = []
    while True:
        for j, (p, _, _, at) in enumerate(reqs):
            if at == step and j:
                assert stream.room() > 0
                which[stream.add(p, params[j])] = j
        try:
            events = next(stream)
        except StopIteration:
            break
        sizes.append(stream._batch.B)
        for i, ev in events.items():
            got[which[i]].append(ev.token_id)
        step += 1
    assert got == alone
    assert [len(g) for g in got] == [n for _, n, _, _ in reqs]
    assert sizes[0] == 1 and 4 in sizes and sizes[-1] == 1  # 1 -> 2 -> 4 rows' bucket, back to 1 as rows ended
    assert stream._batch.moves >= 3 and stream._batch.S == 512  # "The cat" + 300 tokens moved the cache to 512
    with pytest.raises(ValueError, match="context limit"):
        stream.add("Once " * 600, params[0])


def test_a_full_batch_refuses_another_row(engine):
    sp = SamplingParams(max_new_tokens=4)
    stream = engine.stream_batch(["The dog"] * engine.max_batch_size, [sp] * engine.max_batch_size)
    assert stream.room() == 0
    with pytest.raises(ValueError, match="full"):
        stream.add("The cat", sp)
    assert sum(len(e) for e in stream) == 4 * engine.max_batch_size


def test_more_prompts_than_a_batch_join_as_rows_end(engine):
    """generate_batch past max_batch_size: later prompts take the places of rows that ended (one running batch),
    and each result is the prompt's own."""
    small = Engine.load(BUNDLED, max_batch_size=2)
    prompts = ["Once upon a time", "The dog", "Lily and Ben went to the park", "One day", "Tom had a ball"]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 3, 9, 5, 7)]
    steps = []
    real = small._run_rows

    def spy(rows, subsets):
        steps.append(len(rows))
        return real(rows, subsets)

    small._run_rows = spy
    got = small.generate_batch(prompts, params)
    assert steps == [5]  # one running batch for all five
    assert [g.token_ids for g in got] == [engine.generate(p, sp).token_ids for p, sp in zip(prompts, params)]


def test_admits_waits_for_join_min_places():
    """BatchStream.admits: an idle batch takes what it has room for; a running one takes waiting rows only once
    Engine.join_min places are free (or all that wait fit)."""
    eng = Engine.load(BUNDLED, max_batch_size=4)
    assert eng.join_min == 1  # a static model (and PARSE off the GPU)
    eng.join_min = 2
    stream = eng.stream_batch([], [])
    assert stream.admits(6) == 4
    short, long = SamplingParams(max_new_tokens=2, ignore_eos=True), SamplingParams(max_new_tokens=9, ignore_eos=True)
    for sp in (short, long, long):
        stream.add("The dog", sp)
    next(stream)
    assert stream.room() == 1 and stream.admits(5) == 0 and stream.admits(1) == 1
    next(stream)  # the short row ends
    next(stream)
    assert stream.room() == 2 and stream.admits(5) == 2


def test_a_row_stopped_before_it_joins_never_runs(engine):
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    stream = engine.stream_batch(["The dog"], [sp])
    next(stream)
    late = stream.add("Once upon a time", sp)
    stream.stop(late, "cancelled")
    events = [next(stream) for _ in range(3)]
    assert all(late not in e for e in events) and [sorted(e) for e in events] == [[0]] * 3
    assert stream._batch.B == 1  # it never took a place
    assert list(stream) == []


@pytest.mark.parametrize("fast_path", ["off", "torch"])
def test_streams_read_in_turn_keep_their_own_caches(fast_path):
    """Two streams of one engine open at once, read in turn: each gets its own request's tokens (the fast path's
    decoders and the fill cache of a prompt going in by chunks are the engine's: the second stream ran in the first
    one's KV cache). The engine's own caches go back to the next stream once the first is closed."""
    eng = Engine.load(BUNDLED, fast_path=fast_path, prefill_chunk=8)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompts = ["The dog", "Tom and Sue", "Once upon a time there was a little girl named Lily. She loved to play",
               "The dog ran to the park and saw a big red ball. He wanted to play with it"]
    alone = [eng.generate(p, sp).token_ids for p in prompts]
    pair = [eng.stream(p, sp) for p in prompts[:2]]
    assert [[a.token_id, b.token_id] for a, b in zip(*pair)] == [list(t) for t in zip(*alone[:2])]
    a, b = eng.stream_batch(["Tom"], [sp]), eng.stream_batch(["Sue"], [sp])  # long prompts join both, by chunks in a
    next(a), next(b)
    got = {(a, a.add(prompts[2], sp)): [], (b, b.add(prompts[3], sp)): []}
    while any(s.rows for s in (a, b)):
        for s in (a, b):
            for i, ev in next(s, {}).items():
                got.get((s, i), []).append(ev.token_id)
    assert list(got.values()) == alone[2:] and a._batch.chunks > 0
    a.close(), b.close()
    assert eng.stream_batch(["Tom"], [sp])._batch.owns


@pytest.mark.parametrize("fast_path", ["off", "torch"])
def test_choices_of_one_prompt_share_its_prefill(fast_path):
    """Rows joining with the same prompt (a request's n choices) run it once and copy its cache; each still samples
    its own tokens, equal to its own request alone."""
    eng = Engine.load(BUNDLED, fast_path=fast_path)
    params = [SamplingParams(max_new_tokens=10, temperature=2.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    alone = [eng.generate("Once upon a time", sp).token_ids for sp in params]
    stream = eng.stream_batch(["Once upon a time"] * 3 + ["The dog"], params + [params[0]])
    got: dict[int, list[int]] = {}
    for step in stream:
        for i, ev in step.items():
            got.setdefault(i, []).append(ev.token_id)
    assert [got[i] for i in range(3)] == alone and len({tuple(a) for a in alone}) == 3
    assert stream._batch.prefills == 2


def test_rows_step_serves_a_continuous_batch(tmp_path, monkeypatch):
    """The engine's B > 1 decoders through the one-launch rows step (kernels/step_rows.py; forced here, the default
    takes it on Hopper GPUs only), on a compressed bundled model: rows join a running batch at different positions
    and leave it, and each row's greedy tokens are what it gets alone on the eager runtime (fp32, the interpreter).
    The decoders of every batch size share one folded pack."""
    from dataclasses import replace

    import rankserve.workers.engine as engine_module
    from rankserve.compress.factorize import compress_model
    from rankserve.kernels.step_rows import RowsStepKernel

    d = compress_model(BUNDLED, tmp_path / "svd", "svd", 0.8, progress=False)
    alone = Engine.load(d, fast_path="off")
    monkeypatch.setattr(engine_module, "auto_one_launch",
                        lambda dcfg, model: replace(dcfg, one_launch=2 <= dcfg.batch_size <= 16))
    eng = Engine.load(d, fast_path="triton")
    reqs = [("Once upon a time", 10, 0), ("The dog", 6, 2), ("Lily and Ben went to the park", 8, 2), ("Tom", 5, 7)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for _, n, _ in reqs]
    want = [alone.generate(p, sp).token_ids for (p, *_), sp in zip(reqs, params)]
    stream = eng.stream_batch([reqs[0][0]], [params[0]])
    which, got, step = {0: 0}, [[] for _ in reqs], 0
    while True:
        for j, (p, _, at) in enumerate(reqs):
            if at == step and j:
                which[stream.add(p, params[j])] = j
        try:
            events = next(stream)
        except StopIteration:
            break
        for i, ev in events.items():
            got[which[i]].append(ev.token_id)
        step += 1
    assert got == want
    kernels = [dec.step_kernel for (B, _), dec in eng._decoders.items() if B > 1]
    assert kernels and all(isinstance(k, RowsStepKernel) for k in kernels)
    assert len({id(dec.layers) for dec in eng._decoders.values()}) == 1  # one folded pack for every batch size
