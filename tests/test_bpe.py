"""Byte-level BPE: exact unicode round trip, special ids, determinism, uint16 arrays, unigram baseline.

Run alone: .venv/bin/python -m pytest tests/test_bpe.py -q
"""

import math

import numpy as np
from tokenizers import Tokenizer

from rankserve.compress.bpe import BOS_ID, EOS_ID, encode_corpus, load_tokens, train_tokenizer, unigram_perplexity

TEXT = ("The quick brown fox jumps over the lazy dog. " * 20 + "\n\n"
        + "def forward(self, x):\n    return self.w(x)  # a comment\n" * 10
        + "Ünïcödé: naïve café, 東京, ελληνικά, emoji 🦊, tab\tand trailing spaces   \n" * 5)


def _train(tmp_path, name="tok.json"):
    f = tmp_path / "text.txt"
    f.write_text(TEXT, encoding="utf-8")
    train_tokenizer([f], vocab_size=300, out_path=tmp_path / name)
    return Tokenizer.from_file(str(tmp_path / name))


def test_round_trip_and_specials(tmp_path):
    tok = _train(tmp_path)
    assert tok.get_vocab_size() == 300
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    for s in [TEXT, "never seen: Ω≈ç√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \r\n\x00 end", "", " leading space", "日本語のテキスト"]:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert 0 not in ids  # byte-level: nothing is unknown
        assert tok.decode(ids) == s
    ids = tok.encode("hello").ids
    assert ids[0] == BOS_ID and tok.decode(ids, skip_special_tokens=True) == "hello"


def test_deterministic(tmp_path):
    _train(tmp_path, "a.json")
    _train(tmp_path, "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_encode_corpus_uint16(tmp_path):
    tok = _train(tmp_path)
    docs = ["first document", "second one, a little longer", "third"]
    stats = encode_corpus(tmp_path / "tok.json", docs, tmp_path / "all.bin")
    arr = load_tokens(tmp_path / "all.bin")
    assert arr.dtype == np.uint16 and (tmp_path / "all.bin").stat().st_size == 2 * len(arr) == 2 * stats["tokens"]
    expect = [i for d in docs for i in [BOS_ID, *tok.encode(d, add_special_tokens=False).ids, EOS_ID]]
    assert arr.tolist() == expect
    assert stats["docs"] == 3 and stats["tokens_total"] == len(expect)

    capped = encode_corpus(tmp_path / "tok.json", docs, tmp_path / "cap.bin", max_tokens=7, seed=0)
    assert capped["tokens"] == 7 == len(load_tokens(tmp_path / "cap.bin"))
    assert capped["tokens_total"] == len(expect)
    assert load_tokens(tmp_path / "cap.bin")[0] == BOS_ID


def test_unigram_perplexity():
    train = np.array([3, 3, 3, 4])
    test = np.array([3, 4, 5])
    V = 6
    p = {3: 4 / 10, 4: 2 / 10, 5: 1 / 10}  # (count + 1) / (N + V)
    want = math.exp(-np.mean([math.log(p[t]) for t in test]))
    assert math.isclose(unigram_perplexity(train, test, V), want, rel_tol=1e-12)
