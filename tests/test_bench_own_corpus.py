"""bench/own_corpus_text.py: the calibration / router-training split of the reference model's own sources."""

import zipfile

import pytest

from rankserve.bench.own_corpus_text import ZIPS, blocks, documents, main, write_mix, write_split


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


def test_blocks_and_the_two_domain_mix(tmp_path):
    text = "".join(f"line {i:03d}\n" for i in range(50))  # 9 characters a line
    parts = blocks(text, 40)
    assert "".join(parts) == text and all(p.endswith("\n") for p in parts)
    assert all(len(p) >= 40 for p in parts[:-1]) and len(parts) == 10
    out = tmp_path / "o"
    out.mkdir()
    (out / "calib.txt").write_text("".join(f"own {i:04d}\n" for i in range(100)))  # 20 blocks of 40+
    other = tmp_path / "wiki.txt"
    other.write_text("".join(f"wik {i:04d}\n" for i in range(30)))  # 6 blocks
    assert write_mix(other, out, 40) == (6, 14)
    mixed = (out / "calib-mixed.txt").read_text().splitlines()
    assert mixed[:5] == [f"wik {i:04d}" for i in range(5)] and mixed[5:10] == [f"own {i:04d}" for i in range(5)]
    held = (out / "heldout.txt").read_text().splitlines()
    assert held[0] == "own 0030" and not set(held) & set(mixed) and len(held) + 30 == 100
    assert not list(out.glob("*.tmp"))
    other.write_text("".join(f"wik {i:04d}\n" for i in range(200)))  # more blocks than calib.txt: refused
    with pytest.raises(ValueError, match="nothing would be left"):
        write_mix(other, out, 40)


def test_mix_cli_refuses_a_missing_text(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "o"), "--mix-with", str(tmp_path / "none.txt")]) == 2
    assert "not a file" in capsys.readouterr().err and not (tmp_path / "o").exists()
