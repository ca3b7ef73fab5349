"""Calibration and router-training text from the reference model's own training sources (no WikiText).

For the PARSE quality bench's second protocol (parse-log.md, "Calibrated off WikiText"): the static baseline's whitening
and the routers both see only text of the sources the reference model was trained on that lie in ../shared/data
(tinyshakespeare, NLTK movie reviews, inaugural addresses, State of the Union), split by document: every fourth
document (seeded shuffle) into calib.txt, the rest into train.txt, so the two never share text.

With --mix-with TEXT it also writes a calibration on two domains (parse-log.md, session 49): calib-mixed.txt takes
blocks of about 6,000 characters (cut at line ends) from TEXT and from calib.txt in turn, as many of calib.txt's as
TEXT has, so any leading share of it is half each; heldout.txt holds calib.txt's remaining blocks, which neither the
mix nor train.txt contains.

Usage: python -m rankserve.bench.own_corpus_text --out .cache/owncorpus
       python -m rankserve.bench.own_corpus_text --out .cache/owncorpus --mix-with wikitext-2/valid.txt
       python -m rankserve.bench.parse --calib .cache/owncorpus/calib.txt --train-text .cache/owncorpus/train.txt \
           --cache .cache/parse-owncalib --out bench/results/parse-owncalib
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import zipfile
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
ZIPS = ("nltk-movie-reviews/movie_reviews.zip", "nltk-public-domain/inaugural.zip", "nltk-public-domain/state_union.zip")


def documents(shared: Path) -> list[str]:
    """Every document of the sources, in a fixed order: tinyshakespeare, then each zip's .txt members."""
    docs = [(shared / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")]
    for z in ZIPS:
        with zipfile.ZipFile(shared / z) as f:
            docs += [f.read(n).decode("utf-8", "replace") for n in sorted(f.namelist())
                     if n.endswith(".txt") and "README" not in n]
    return docs


def write_split(docs: list[str], out: Path, seed: int = 0) -> tuple[int, int]:
    """calib.txt (every fourth document after a seeded shuffle) and train.txt (the rest); atomic writes."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    parts = {"calib.txt": [docs[i] for j, i in enumerate(order) if j % 4 == 0],
             "train.txt": [docs[i] for j, i in enumerate(order) if j % 4 != 0]}
    out.mkdir(parents=True, exist_ok=True)
    sizes = []
    for name, texts in parts.items():
        tmp = out / (name + ".tmp")
        tmp.write_text("\n\n".join(texts), encoding="utf-8")
        os.replace(tmp, out / name)
        sizes.append(len(texts))
    return sizes[0], sizes[1]


def blocks(text: str, size: int = 6000) -> list[str]:
    """The text in consecutive pieces of at least `size` characters (the last may be shorter), each ending at a line
    end; joined, they give the text back."""
    out: list[str] = []
    cur: list[str] = []
    n = 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if n >= size:
            out.append("".join(cur))
            cur, n = [], 0
    if cur:
        out.append("".join(cur))
    return out


def write_mix(other: Path, out: Path, size: int = 6000) -> tuple[int, int]:
    """calib-mixed.txt (OTHER's blocks and calib.txt's in turn) and heldout.txt (calib.txt's blocks the mix leaves
    out); returns the two block counts of calib.txt. Atomic writes."""
    a = blocks(other.read_text(encoding="utf-8", errors="replace"), size)
    b = blocks((out / "calib.txt").read_text(encoding="utf-8"), size)
    if len(b) <= len(a):
        raise ValueError(f"{other} has {len(a)} blocks, calib.txt only {len(b)}: nothing would be left to hold out")
    parts = {"calib-mixed.txt": "".join(x + y for x, y in zip(a, b)), "heldout.txt": "".join(b[len(a):])}
    for name, text in parts.items():
        tmp = out / (name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out / name)
    return len(a), len(b) - len(a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.own_corpus_text", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".cache/owncorpus"))
    ap.add_argument("--shared", type=Path, default=SHARED, help="the shared data directory")
    ap.add_argument("--mix-with", type=Path, default=None, help="also write calib-mixed.txt (this text and calib.txt, "
                                                                "half each) and heldout.txt")
    a = ap.parse_args(argv)
    try:
        docs = documents(a.shared)
    except (OSError, zipfile.BadZipFile) as e:
        print(f"error: cannot read the sources under {a.shared}: {e}", file=sys.stderr)
        return 2
    if a.mix_with is not None and not a.mix_with.is_file():
        print(f"error: --mix-with {a.mix_with} is not a file", file=sys.stderr)
        return 2
    n_calib, n_train = write_split(docs, a.out)
    print(f"{len(docs)} documents: {n_calib} -> {a.out / 'calib.txt'}, {n_train} -> {a.out / 'train.txt'}")
    if a.mix_with is not None:
        try:
            n_mixed, n_held = write_mix(a.mix_with, a.out)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{n_mixed} blocks of each -> {a.out / 'calib-mixed.txt'}, {n_held} -> {a.out / 'heldout.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
