"""Byte-level BPE for the reference model, and the tokenized arrays that travel to the GPU.

Special tokens: <unk>=0 (never produced: every byte has a token), <s>=1 (BOS, starts every document), </s>=2 (EOS).
No normalizer, so decode(encode(text)) == text for any unicode string.
Arrays: raw little-endian uint16, no header; each document is <s> tokens </s> (so the model learns to stop).
  train.bin   corpus documents, shuffled with `seed`, capped at `max_train_tokens` (the GPU upload is <= 64 MiB)
  val.bin     WikiText-2 valid (calibration)
  test.bin    WikiText-2 raw test (held-out perplexity)

Run (after compress/corpus.py):
  python -m rankserve.compress.bpe --corpus .carry/corpus --out .carry/reference
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from rankserve.compress.corpus import read_train_docs, sha256_file

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
BOS_ID = 1
EOS_ID = 2


def train_tokenizer(text_files: list[Path] | None = None, vocab_size: int = 12288,
                    out_path: Path = Path("tokenizer.json"), texts: Iterable[str] | None = None,
                    min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE on `text_files` (or the strings `texts`) and save it to `out_path`.

    Deterministic: the same input in the same order gives the same tokenizer.json.
    """
    if vocab_size > 65535:
        raise ValueError(f"vocab_size {vocab_size} does not fit the uint16 token arrays; use at most 65535")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    if texts is not None:
        tok.train_from_iterator(texts, trainer)
    else:
        tok.train([str(p) for p in text_files], trainer)
    # HF convention for LLaMA: tokenizer(text) starts with <s>
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} got id {tok.token_to_id(t)}, expected {i}"
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return tok


def encode_corpus(tokenizer_path: Path, text: str | Iterable[str], out_path: Path,
                  max_tokens: int | None = None, seed: int | None = None, batch_docs: int = 256) -> dict:
    """Encode a text (one document) or documents to `out_path` as uint16, each document as <s> ... </s>.

    seed: shuffle the documents first (so a token cap keeps the source mix); None keeps their order
    max_tokens: keep only the first this many tokens (of the shuffled documents; the last one kept is cut)
    Returns {"tokens", "tokens_total" (before the cap), "docs" (kept, whole or cut), "docs_total", "sha256"}.
    """
    tok = Tokenizer.from_file(str(tokenizer_path))
    docs = [text] if isinstance(text, str) else list(text)
    if seed is not None:
        random.Random(seed).shuffle(docs)
    lengths, chunks = [], []
    for i in tqdm(range(0, len(docs), batch_docs), desc=f"encode {Path(out_path).name}", unit="batch"):
        for enc in tok.encode_batch(docs[i:i + batch_docs], add_special_tokens=False):
            chunks.append(np.asarray([BOS_ID, *enc.ids, EOS_ID], dtype=np.uint16))
            lengths.append(len(chunks[-1]))
    ids = np.concatenate(chunks)
    kept = ids if max_tokens is None else ids[:max_tokens]
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    kept.tofile(out_path)
    n_docs = int(np.searchsorted(np.cumsum(lengths), len(kept), side="left")) + 1
    return {"tokens": len(kept), "tokens_total": len(ids), "docs": min(n_docs, len(docs)), "docs_total": len(docs),
            "sha256": sha256_file(out_path)}


def load_tokens(path: Path) -> np.ndarray:
    """A uint16 token array written by `encode_corpus`, memory-mapped."""
    return np.memmap(path, dtype=np.uint16, mode="r")


def unigram_perplexity(train_ids: np.ndarray, test_ids: np.ndarray, vocab: int) -> float:
    """Perplexity of an add-one smoothed unigram model fit on `train_ids`, scored on every token of `test_ids`.

    Pass the same target tokens the LM is scored on (test[1:]: the first <s> is never predicted).
    """
    counts = np.bincount(np.asarray(train_ids, dtype=np.int64), minlength=vocab).astype(np.float64)
    logp = np.log(counts + 1.0) - math.log(counts.sum() + vocab)
    return float(np.exp(-logp[np.asarray(test_ids, dtype=np.int64)].mean()))


def prepare_reference(corpus_dir: Path, out_dir: Path, vocab_size: int = 12288,
                      max_train_tokens: int = 20_000_000, seed: int = 0) -> dict:
    """Tokenizer + train/val/test arrays + manifest for the GPU run, from a corpus built by compress/corpus.py.

    max_train_tokens: 20M uint16 tokens = 40 MB, which keeps the whole upload (repo included) under ~45 MiB
    """
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    manifest_path = corpus_dir / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} is missing: build the corpus first "
                                f"(python -m rankserve.compress.corpus --out {corpus_dir})")
    manifest = json.loads(manifest_path.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_path = out_dir / "tokenizer.json"
    train_tokenizer(vocab_size=vocab_size, out_path=tok_path, texts=read_train_docs(corpus_dir))
    stats = {
        "train": encode_corpus(tok_path, read_train_docs(corpus_dir), out_dir / "train.bin",
                               max_tokens=max_train_tokens, seed=seed),
        "val": encode_corpus(tok_path, (corpus_dir / "val.txt").read_text(encoding="utf-8"), out_dir / "val.bin"),
        "test": encode_corpus(tok_path, (corpus_dir / "test.txt").read_text(encoding="utf-8"), out_dir / "test.bin"),
    }
    for name in ("val", "test"):
        stats[name]["text_bytes"] = manifest["heldout"][name]["bytes"]
    train, val, test = (load_tokens(out_dir / f"{n}.bin") for n in ("train", "val", "test"))
    manifest["tokens"] = {
        "dtype": "uint16", "bos_id": BOS_ID, "eos_id": EOS_ID, "vocab_size": vocab_size, "seed": seed,
        "max_train_tokens": max_train_tokens, "tokenizer_sha256": sha256_file(tok_path),
        "train_bytes_per_token": manifest["train"]["text_bytes"] / stats["train"]["tokens_total"],
        **stats,
        "unigram_test_perplexity": unigram_perplexity(train, test[1:], vocab_size),
        # stricter, in-domain baseline: the unigram fit on WikiText-2 valid instead of the corpus
        "unigram_val_fit_test_perplexity": unigram_perplexity(val, test[1:], vocab_size),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path(".carry/corpus"), help="output of compress/corpus.py")
    ap.add_argument("--out", type=Path, default=Path(".carry/reference"))
    ap.add_argument("--vocab-size", type=int, default=12288)
    ap.add_argument("--max-train-tokens", type=int, default=20_000_000, help="cap on train.bin (2 bytes a token)")
    ap.add_argument("--seed", type=int, default=0, help="document shuffle before the cap")
    a = ap.parse_args(argv)
    m = prepare_reference(a.corpus, a.out, vocab_size=a.vocab_size, max_train_tokens=a.max_train_tokens, seed=a.seed)
    t = m["tokens"]
    for name in ("train", "val", "test"):
        print(f"{name}.bin: {t[name]['tokens']:,} of {t[name]['tokens_total']:,} tokens, "
              f"{t[name]['docs']}/{t[name]['docs_total']} docs")
    print(f"train bytes/token {t['train_bytes_per_token']:.2f}; unigram perplexity on test: "
          f"{t['unigram_test_perplexity']:.1f} (fit on train), {t['unigram_val_fit_test_perplexity']:.1f} (fit on val)")


if __name__ == "__main__":
    main()
