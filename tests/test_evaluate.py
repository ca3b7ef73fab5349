"""Evaluation: sliding-window perplexity, agreement / KL against a reference, greedy identity (stories260K, CPU).

Run alone: .venv/bin/python -m pytest tests/test_evaluate.py -q   (about 1 s on 2 cores)
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rankserve.compress.evaluate import compare, evaluate, greedy_identity, perplexity, windows
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
HELD_OUT = ROOT / "tests" / "data" / "wikitext2-raw-test-head.txt"
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
        "One day, she saw a big red ball in the park. She ran to get it, but a dog took it first.")


@pytest.fixture(scope="module")
def stories():
    model, _ = load_checkpoint(STORIES)
    return model, Tokenizer.load(STORIES)


def _nll_by_hand(model, ids: list[int], start: int, end: int, first: int) -> torch.Tensor:
    """NLL (nats) of targets first+1..end from one forward over ids[start:end]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[start:end]]))[0]  # (S, V)
    return F.cross_entropy(logits[first - start:].double(), torch.tensor(ids[first + 1:end + 1]), reduction="none")


@pytest.mark.parametrize("n,seq_len,stride", [(2, 8, 8), (10, 4, 4), (10, 4, 2), (100, 16, 5), (17, 16, 16),
                                               (16, 16, 16), (300, 64, 1), (50, 64, 32)])
def test_windows_score_every_token_once(n, seq_len, stride):
    wins = windows(n, seq_len, stride)
    targets = [t for _, e, f in wins for t in range(f + 1, e + 1)]
    assert targets == list(range(1, n))  # every token but the first, once, in order
    assert len({e - s for s, e, _ in wins}) == 1  # equal lengths: batches need no padding
    for s, e, f in wins:
        assert 0 <= s <= f < e <= n - 1 and e - s <= seq_len
        assert e - f <= max(stride, seq_len if f == 0 else stride)
        if s > 0:  # every scored target sees at least seq_len - stride tokens of context
            assert f + 1 - s >= seq_len - stride


def test_perplexity_is_exp_mean_nll(stories):
    model, tok = stories
    ids = tok.encode(TEXT, bos=True)
    got = perplexity(model, tok, TEXT, seq_len=len(ids))  # one window holding the whole text
    nll = _nll_by_hand(model, ids, 0, len(ids) - 1, 0)
    assert got["tokens"] == len(ids) - 1 == nll.numel()
    assert got["nll"] == pytest.approx(float(nll.mean()), rel=1e-5)
    assert got["perplexity"] == pytest.approx(float(nll.mean().exp()), rel=1e-5)


def test_a_windows_prompt_is_not_scored(stories):
    """prompt_len P: a window's targets at positions < P are its prompt's (not scored); the masks hook sees every
    batch of windows before the model runs it."""
    model, tok = stories
    ids = tok.encode(TEXT, bos=True)
    seen = []
    got = perplexity(model, tok, TEXT, seq_len=16, prompt_len=5, batch_size=2, masks=lambda x: seen.append(x.shape))
    nll = torch.cat([_nll_by_hand(model, ids, s, e, max(f, s + 4)) for s, e, f in windows(len(ids), 16, 16)
                     if max(f, s + 4) < e])  # the last window overlaps: it scores only what the others did not
    assert got["tokens"] == nll.numel() and got["nll"] == pytest.approx(float(nll.mean()), rel=1e-5)
    assert sum(b for b, _ in seen) == len(windows(len(ids), 16, 16)) and {S for _, S in seen} == {16}
    with pytest.raises(ValueError, match="shorter than the window"):
        perplexity(model, tok, TEXT, seq_len=16, prompt_len=16)


@pytest.mark.parametrize("seq_len,stride,batch_size", [(16, 16, 1), (16, 6, 3), (24, 7, 8)])
def test_sliding_windows_by_hand(stories, seq_len, stride, batch_size):
    model, tok = stories
    ids = tok.encode(TEXT, bos=True)
    got = perplexity(model, tok, TEXT, seq_len=seq_len, stride=stride, batch_size=batch_size)
    nll = torch.cat([_nll_by_hand(model, ids, s, e, f) for s, e, f in windows(len(ids), seq_len, stride)])
    assert got["tokens"] == len(ids) - 1 == nll.numel()
    assert got["nll"] == pytest.approx(float(nll.mean()), rel=1e-5)


def test_compare_with_itself(stories):
    model, tok = stories
    r = compare(model, model, tok, TEXT, seq_len=32, stride=16)
    assert r["top1_agreement"] == 1.0
    assert abs(r["kl"]) < 1e-6
    assert r["perplexity"] == r["reference_perplexity"]


def test_compare_with_a_perturbed_model(stories):
    model, tok = stories
    other, _ = load_checkpoint(STORIES)
    with torch.no_grad():
        other.layers[0].mlp.down.weight.mul_(-1.0)
    r = compare(other, model, tok, TEXT, seq_len=32)
    assert 0 <= r["top1_agreement"] < 1 and r["kl"] > 0.01
    assert r["reference_perplexity"] == pytest.approx(perplexity(model, tok, TEXT, seq_len=32)["perplexity"])


def test_greedy_identity(stories):
    model, tok = stories
    prompts = ["Once upon a time", "The dog", "Lily and Tom went to the park. They"]
    assert greedy_identity(model, model, tok, prompts, n_tokens=12) == 1.0
    other, _ = load_checkpoint(STORIES)
    with torch.no_grad():
        other.layers[0].mlp.down.weight.mul_(-1.0)
    assert greedy_identity(other, model, tok, prompts, n_tokens=12) < 1.0


def test_greedy_matches_uncached_argmax(stories):
    from rankserve.compress.evaluate import _greedy
    model, tok = stories
    prompts = [tok.encode("Once upon a time", bos=True), tok.encode("The big dog ran", bos=True), [1]]
    got = _greedy(model, prompts, 10)
    for p, g in zip(prompts, got):
        seq = list(p)
        with torch.no_grad():
            for _ in range(10):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert g == seq[len(p):]


def test_evaluate_files(tmp_path):
    r = evaluate(STORIES, HELD_OUT, reference_dir=STORIES, seq_len=128, max_tokens=1000, progress=False)
    assert r["tokens"] == 999 and r["top1_agreement"] == 1.0 and abs(r["kl"]) < 1e-6
    assert 1 < r["perplexity"] == r["reference_perplexity"] < 512
    with pytest.raises(ValueError, match="does not exist"):
        evaluate(STORIES, tmp_path / "missing.txt")
    one = tmp_path / "one.txt"
    one.write_text("")
    with pytest.raises(ValueError, match="at least 2"):
        evaluate(STORIES, one, progress=False)
