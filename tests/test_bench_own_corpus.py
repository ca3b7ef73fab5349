"""bench/own_corpus_text.py: the calibration / router-training split of the reference model's own sources."""

import zipfile

from rankserve.bench.own_corpus_text import ZIPS, documents, main, write_split


def test_split_is_disjoint_and_deterministic(tmp_path):
    docs = [f"document {i} " * 3 for i in range(40)]
    n_calib, n_train = write_split(docs, tmp_path / "a")
    assert (n_calib, n_train) == (10, 30)
    calib = (tmp_path / "a" / "calib.txt").read_text().split("\n\n")
    train = (tmp_path / "a" / "train.txt").read_text().split("\n\n")
    assert sorted(calib + train) == sorted(docs) and not set(calib) & set(train)
    write_split(docs, tmp_path / "b")
    assert (tmp_path / "b" / "calib.txt").read_text() == (tmp_path / "a" / "calib.txt").read_text()
    assert not list((tmp_path / "a").glob("*.tmp"))


def test_sources_and_bad_directory(tmp_path, capsys):
    shared = tmp_path / "shared"  # the layout of ../shared/data, a few documents each (tests never read ../shared)
    (shared / "tinyshakespeare").mkdir(parents=True)
    (shared / "tinyshakespeare" / "input.txt").write_text("ROMEO: hello")
    for z in ZIPS:
        (shared / z).parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(shared / z, "w") as f:
            f.writestr("corpus/README", "not a document")
            for i in range(3):
                f.writestr(f"corpus/{z[-8:-4]}-{i}.txt", f"{z} doc {i}")
    docs = documents(shared)
    assert len(docs) == 10 and docs[0] == "ROMEO: hello" and all("README" not in d for d in docs)
    assert main(["--shared", str(shared), "--out", str(tmp_path / "ok")]) == 0
    assert main(["--shared", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "cannot read" in capsys.readouterr().err and not (tmp_path / "o").exists()
