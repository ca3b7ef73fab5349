"""Corpus builder on a small sample: dedup, held-out exclusion, manifest hashes.

Run alone: .venv/bin/python -m pytest tests/test_corpus.py -q
"""

import gzip
import hashlib
import json
import zipfile

from rankserve.compress.corpus import Source, build_corpus, read_train_docs, sha256_file

HELD = "The held-out paragraph about the Battle of Hastings in 1066 must never appear in training text."
SHARED = "Copyright notice shared by two files, long enough to count as a real paragraph for dedup."


def _shared_dir(tmp_path):
    d = tmp_path / "shared"
    (d / "wikitext-2-raw-test").mkdir(parents=True)
    (d / "wikitext-2-pytorch-examples").mkdir()
    (d / "wikitext-2-raw-test" / "wiki.test.raw").write_text(f" = Hastings = \n \n {HELD} \n \n Short line . \n")
    (d / "wikitext-2-pytorch-examples" / "valid.txt").write_text(" = Valid = \n \n A calibration line that is " 
                                                                 "long enough to be a paragraph of its own . \n")
    return d


def _sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    a = "First document.\r\nIt has Windows line ends and a NUL\x00 byte.\n\n" + SHARED + "\n"
    (src / "a.txt").write_text(a)
    (src / "a_copy.txt").write_text(a)  # exact duplicate: dropped whole
    (src / "b.rst.gz").write_bytes(gzip.compress(
        f"Second document, gzipped, with unicode: café, 日本語.\n\n{SHARED}\n\n{HELD}\n\nA closing line.\n".encode()))
    with zipfile.ZipFile(src / "c.zip", "w") as z:
        z.writestr("c/README", "not a .txt member: skipped")
        z.writestr("c/one.txt", "Zip member one, a speech of moderate length for the test.\n")
        z.writestr("c/two.txt", "Zip member two, another speech of moderate length for the test.\n")
    return [Source("plain", [src / "a.txt", src / "a_copy.txt", src / "b.rst.gz"], "test", src),
            Source("zipped", [src / "c.zip"], "test", src)]


def test_dedup_heldout_and_manifest(tmp_path):
    out = tmp_path / "corpus"
    m = build_corpus(out, _shared_dir(tmp_path), sources=_sources(tmp_path), min_doc_chars=10)
    docs = list(read_train_docs(out))
    text = "\n".join(docs)
    assert len(docs) == 4  # a, b, c/one, c/two; a_copy dropped
    assert m["sources"]["plain"]["dup_docs"] == 1
    assert text.count(SHARED) == 1 and m["sources"]["plain"]["dup_paragraphs"] == 1
    assert HELD not in text and m["sources"]["plain"]["heldout_paragraphs_dropped"] == 1
    assert m["heldout_paragraphs_in_train"] == 0
    assert "\x00" not in text and "\r" not in text
    assert "café, 日本語" in text
    assert "not a .txt member" not in text
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert [r["path"] for r in rows] == ["a.txt", "b.rst.gz", "c.zip/c/one.txt", "c.zip/c/two.txt"]

    assert m["train"]["sha256"] == sha256_file(out / "train.jsonl")
    assert json.loads((out / "manifest.json").read_text()) == m
    for name in ("plain", "zipped"):
        h = hashlib.sha256("".join(r["text"] for r in rows if r["source"] == name).encode()).hexdigest()
        assert m["sources"][name]["sha256"] == h
        assert m["sources"][name]["bytes"] == sum(len(r["text"].encode()) for r in rows if r["source"] == name)
    held = tmp_path / "shared" / "wikitext-2-raw-test" / "wiki.test.raw"
    assert m["heldout"]["test"]["sha256"] == hashlib.sha256(held.read_bytes()).hexdigest()
    assert (out / "test.txt").read_bytes() == held.read_bytes()
    assert m["train"]["text_bytes"] == sum(len(d.encode()) for d in docs)


def test_max_bytes_truncates(tmp_path):
    out = tmp_path / "corpus"
    m = build_corpus(out, _shared_dir(tmp_path), sources=_sources(tmp_path), min_doc_chars=10, max_bytes=120)
    assert m["train"]["text_bytes"] <= 120
    assert m["train"]["truncated_at"] is not None
    assert m["sources"]["zipped"]["docs"] == 0


def test_deterministic(tmp_path):
    shared, sources = _shared_dir(tmp_path), _sources(tmp_path)
    m1 = build_corpus(tmp_path / "c1", shared, sources=sources, min_doc_chars=10)
    m2 = build_corpus(tmp_path / "c2", shared, sources=sources, min_doc_chars=10)
    assert m1["train"]["sha256"] == m2["train"]["sha256"]
