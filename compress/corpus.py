"""Training corpus for the reference model: real text available offline, deduplicated, held-out set kept out.

Sources (in this order; `max_bytes` truncates the last ones first):
  tinyshakespeare, NLTK State of the Union / Inaugural / movie reviews   ../shared/data (public domain, CC BY 4.0)
  python3.11-doc   reStructuredText sources of the Python docs             /usr/share/doc/python3.11/html/_sources
  linux-doc-6.1    kernel Documentation/ .rst and .txt (no translations)   /usr/share/doc/linux-doc-6.1/Documentation
  cpython-stdlib   the running interpreter's standard library .py files   sysconfig.get_paths()["stdlib"]
Held out (never in train): WikiText-2 raw test (evaluation) and WikiText-2 valid (calibration).

Output in `out_dir`:
  train.jsonl     one {"source", "path", "text"} per document, in source order
  test.txt        WikiText-2 raw test, byte-for-byte copy
  val.txt         WikiText-2 valid, byte-for-byte copy
  manifest.json   per source: files, documents, bytes, sha256, duplicates dropped; held-out sha256 and the
                  count of held-out paragraphs found in train (always 0, checked after writing)

Run:  python -m rankserve.compress.corpus --out .carry/corpus --shared ../shared/data
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import unicodedata
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

APT_PACKAGES = ("python3.11-doc", "linux-doc-6.1")
PYTHON_DOC_DIR = Path("/usr/share/doc/python3.11/html/_sources")
LINUX_DOC_DIR = Path("/usr/share/doc/linux-doc-6.1/Documentation")
HELDOUT = {  # name -> path under shared_dir
    "test": "wikitext-2-raw-test/wiki.test.raw",  # evaluation: held-out perplexity
    "val": "wikitext-2-pytorch-examples/valid.txt",  # calibration for compression
}
STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__",
                    "encodings"}  # encodings/: codec tables, not prose or code
STDLIB_SKIP_FILES = {"pydoc_data/topics.py"}  # a repr() of the Python docs, already in python3.11-doc

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # C0 controls except \t \n (NUL, form feed, ESC, ...)
_PARAGRAPH = re.compile(r"\n[ \t]*\n+")


@dataclass
class Source:
    """One corpus source: a name for the manifest and the files it reads (.zip members and .gz are opened)."""
    name: str
    files: list[Path]
    license: str
    root: Path | None = None  # paths in the manifest are relative to this


@dataclass
class _Stats:
    files: int = 0
    docs: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    dup_docs: int = 0
    dup_paragraphs: int = 0
    heldout_paragraphs_dropped: int = 0
    latin1_files: int = 0
    short_docs: int = 0
    sha256: object = field(default_factory=hashlib.sha256)


def find_sources(shared_dir: Path, install_missing: bool = True) -> list[Source]:
    """The reference corpus sources, installing the two Debian doc packages with apt if their files are missing."""
    shared_dir = Path(shared_dir)
    if install_missing and not (PYTHON_DOC_DIR.is_dir() and LINUX_DOC_DIR.is_dir()):
        _apt_install(APT_PACKAGES)
    for d in (PYTHON_DOC_DIR, LINUX_DOC_DIR):
        if not d.is_dir():
            raise FileNotFoundError(f"{d} is missing: run `apt-get update && apt-get install -y "
                                    f"--no-install-recommends {' '.join(APT_PACKAGES)}` (as root)")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = [shared_dir / p for p in ("tinyshakespeare/input.txt", "nltk-public-domain/state_union.zip",
                                     "nltk-public-domain/inaugural.zip", "nltk-movie-reviews/movie_reviews.zip")]
    for p in data:
        if not p.is_file():
            raise FileNotFoundError(f"{p} is missing: pass --shared pointing at the shared data folder")
    return [
        Source("tinyshakespeare", data[:1], "public domain", shared_dir),
        Source("nltk-state-union", data[1:2], "public domain", shared_dir),
        Source("nltk-inaugural", data[2:3], "public domain", shared_dir),
        Source("nltk-movie-reviews", data[3:4], "CC BY 4.0", shared_dir),
        Source("python3.11-doc", sorted(PYTHON_DOC_DIR.rglob("*.txt")), "PSF-2.0", PYTHON_DOC_DIR),
        Source("linux-doc-6.1", _linux_doc_files(LINUX_DOC_DIR), "GPL-2.0", LINUX_DOC_DIR),
        Source("cpython-stdlib", _stdlib_files(stdlib), "PSF-2.0", stdlib),
    ]


def build_corpus(out_dir: Path, shared_dir: Path, max_bytes: int = 250_000_000,
                 sources: list[Source] | None = None, min_paragraph_chars: int = 64,
                 min_doc_chars: int = 64) -> dict:
    """Gather, normalise and deduplicate the sources into `out_dir`; return the manifest (also written).

    min_paragraph_chars: paragraphs shorter than this are never deduplicated (headings, `return x` repeat naturally)
    min_doc_chars: documents shorter than this after dedup are dropped (empty __init__.py, stubs)
    max_bytes: cap on train.jsonl text bytes; sources past the cap are truncated, in order
    """
    out_dir, shared_dir = Path(out_dir), Path(shared_dir)
    sources = find_sources(shared_dir) if sources is None else sources
    heldout_paths = {k: shared_dir / v for k, v in HELDOUT.items()}
    for p in heldout_paths.values():
        if not p.is_file():
            raise FileNotFoundError(f"held-out file {p} is missing: pass --shared pointing at the shared data folder")
    heldout_keys = set()
    for p in heldout_paths.values():
        heldout_keys |= _heldout_keys(p.read_text(encoding="utf-8"), min_paragraph_chars)

    out_dir.mkdir(parents=True, exist_ok=True)
    seen_docs: set[bytes] = set()
    seen_paragraphs: set[bytes] = set()
    stats = {s.name: _Stats() for s in sources}
    total = 0
    truncated_at = None
    tmp = out_dir / "train.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f, tqdm(total=sum(len(s.files) for s in sources),
                                                      unit="file", desc="corpus") as bar:
        for src in sources:
            st = stats[src.name]
            bar.set_postfix_str(src.name)
            for path in src.files:
                bar.update(1)
                if truncated_at is not None:
                    continue
                st.files += 1
                for rel, raw in _read_docs(path, src.root):
                    st.bytes_in += len(raw)
                    text, latin1 = _normalise(raw)
                    st.latin1_files += latin1
                    key = _key(text)
                    if key in seen_docs:
                        st.dup_docs += 1
                        continue
                    seen_docs.add(key)
                    text, n_dup, n_held = _dedup_paragraphs(text, seen_paragraphs, heldout_keys, min_paragraph_chars)
                    st.dup_paragraphs += n_dup
                    st.heldout_paragraphs_dropped += n_held
                    if len(text) < min_doc_chars:
                        st.short_docs += 1
                        continue
                    n = len(text.encode("utf-8"))
                    if total + n > max_bytes:
                        truncated_at = f"{src.name}:{rel}"
                        break
                    f.write(json.dumps({"source": src.name, "path": rel, "text": text}, ensure_ascii=False) + "\n")
                    st.sha256.update(text.encode("utf-8"))
                    st.docs += 1
                    st.bytes_out += n
                    total += n
    train_path = out_dir / "train.jsonl"
    tmp.replace(train_path)
    for name, p in heldout_paths.items():
        shutil.copyfile(p, out_dir / f"{name}.txt")

    hits = count_heldout_in_train(train_path, heldout_keys, min_paragraph_chars)
    if hits:
        raise RuntimeError(f"{hits} held-out paragraphs found in {train_path} after filtering: a bug in dedup")
    manifest = {
        "format": "rankserve-corpus-1",
        "python": sys.version.split()[0],
        "apt_versions": {p: _dpkg_version(p) for p in APT_PACKAGES},
        "settings": {"max_bytes": max_bytes, "min_paragraph_chars": min_paragraph_chars,
                     "min_doc_chars": min_doc_chars},
        "sources": {s.name: {"license": s.license, "files": stats[s.name].files, "docs": stats[s.name].docs,
                             "bytes_in": stats[s.name].bytes_in, "bytes": stats[s.name].bytes_out,
                             "sha256": stats[s.name].sha256.hexdigest(), "dup_docs": stats[s.name].dup_docs,
                             "dup_paragraphs": stats[s.name].dup_paragraphs,
                             "heldout_paragraphs_dropped": stats[s.name].heldout_paragraphs_dropped,
                             "short_docs_dropped": stats[s.name].short_docs,
                             "latin1_decoded": stats[s.name].latin1_files} for s in sources},
        "train": {"file": train_path.name, "docs": sum(s.docs for s in stats.values()), "text_bytes": total,
                  "file_bytes": train_path.stat().st_size, "sha256": sha256_file(train_path),
                  "truncated_at": truncated_at},
        "heldout": {name: {"file": f"{name}.txt", "source": HELDOUT[name], "bytes": p.stat().st_size,
                           "sha256": sha256_file(p)} for name, p in heldout_paths.items()},
        "heldout_paragraphs_in_train": hits,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_train_docs(corpus_dir: Path) -> Iterator[str]:
    """The document texts of `corpus_dir/train.jsonl`, in file order."""
    with open(Path(corpus_dir) / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def count_heldout_in_train(train_path: Path, heldout_keys: set[bytes], min_paragraph_chars: int) -> int:
    """Paragraphs or lines of train.jsonl whose normalised text is a held-out paragraph (expected: 0)."""
    hits = 0
    with open(train_path, encoding="utf-8") as f:
        for line in f:
            for p in _PARAGRAPH.split(json.loads(line)["text"]):
                hits += any(k in heldout_keys for k in _paragraph_keys(p, min_paragraph_chars))
    return hits


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _apt_install(packages: tuple[str, ...]) -> None:
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    if subprocess.run(cmd).returncode != 0:  # package lists may be empty on a fresh machine
        subprocess.run(["apt-get", "update", "-q"], check=True)
        subprocess.run(cmd, check=True)


def _dpkg_version(package: str) -> str | None:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    return r.stdout or None


def _linux_doc_files(root: Path) -> list[Path]:
    # translations/ is Chinese, Japanese, Korean, Italian, Spanish: not for an English 12k-token vocabulary
    files = [p for p in root.rglob("*") if p.name.endswith((".rst.gz", ".txt.gz", ".rst", ".txt"))]
    return sorted(p for p in files if "translations" not in p.relative_to(root).parts)


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if STDLIB_SKIP_DIRS.isdisjoint(rel.parts[:-1]) and rel.as_posix() not in STDLIB_SKIP_FILES:
            files.append(p)
    return sorted(files)


def _read_docs(path: Path, root: Path | None) -> Iterator[tuple[str, bytes]]:
    """(relative name, raw bytes) of each document in `path`: zip members (.txt, sorted), .gz, or plain files."""
    rel = path.relative_to(root).as_posix() if root is not None else path.name
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as z:
            for name in sorted(z.namelist()):
                if name.endswith(".txt"):  # skips folders and README
                    yield f"{rel}/{name}", z.read(name)
    elif path.suffix == ".gz":
        yield rel, gzip.decompress(path.read_bytes())
    else:
        yield rel, path.read_bytes()


def _normalise(raw: bytes) -> tuple[str, bool]:
    """utf-8 (latin-1 fallback), NFC, LF line ends, no control characters, no trailing blank lines."""
    try:
        text, latin1 = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        text, latin1 = raw.decode("latin-1"), True
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    return _CONTROL.sub("", text).strip("\n") + "\n", latin1


def _key(text: str) -> bytes:
    return hashlib.blake2b(" ".join(text.split()).encode("utf-8"), digest_size=16).digest()


def _paragraph_keys(p: str, min_chars: int) -> list[bytes]:
    """Keys of a paragraph and of its lines, for those at least `min_chars` long once whitespace is collapsed."""
    parts = [p, *p.split("\n")] if "\n" in p else [p]
    return [_key(s) for s in parts if len(" ".join(s.split())) >= min_chars]


def _heldout_keys(text: str, min_chars: int) -> set[bytes]:
    keys = set()
    for p in _PARAGRAPH.split(text.replace("\r\n", "\n")):
        keys.update(_paragraph_keys(p, min_chars))
    return keys


def _dedup_paragraphs(text: str, seen: set[bytes], heldout: set[bytes], min_chars: int) -> tuple[str, int, int]:
    """Drop paragraphs seen before (in any document) or containing a held-out paragraph or line."""
    kept, n_dup, n_held = [], 0, 0
    for p in _PARAGRAPH.split(text):
        keys = _paragraph_keys(p, min_chars)
        if any(k in heldout for k in keys):
            n_held += 1
            continue
        if keys:  # keys[0] is the whole paragraph's: a short paragraph has no long lines
            if keys[0] in seen:
                n_dup += 1
                continue
            seen.add(keys[0])
        kept.append(p)
    return "\n\n".join(kept).strip("\n") + "\n", n_dup, n_held


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".carry/corpus"))
    ap.add_argument("--shared", type=Path, default=Path("../shared/data"), help="the shared data folder")
    ap.add_argument("--max-bytes", type=int, default=250_000_000, help="cap on train text bytes")
    a = ap.parse_args(argv)
    m = build_corpus(a.out, a.shared, max_bytes=a.max_bytes)
    for name, s in m["sources"].items():
        print(f"{name:20s} files {s['files']:6d} docs {s['docs']:6d} bytes {s['bytes']:12,d} "
              f"(in {s['bytes_in']:12,d}; dup docs {s['dup_docs']}, dup paragraphs {s['dup_paragraphs']})")
    print(f"train: {m['train']['docs']} docs, {m['train']['text_bytes']:,} text bytes -> {a.out / 'train.jsonl'}")


if __name__ == "__main__":
    main()
