"""The `rankserve` command line, run as a user would: JSON outputs, and bad input as one line + exit 2, no traceback,
no partial output directory. Run alone: .venv/bin/python -m pytest tests/test_cli.py -q
"""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "models" / "stories260K"
HEAD = ROOT / "tests" / "data" / "wikitext2-raw-test-head.txt"
CALIB = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


def rankserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankserve.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def assert_clean_error(p: subprocess.CompletedProcess, pattern: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert pattern in p.stderr, p.stderr


def test_generate_json_tells_the_story():
    p = rankserve("generate", BUNDLED, "--max-new-tokens", "20", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["text"].startswith("Once upon a time, there was a little girl named Lily")
    assert out["num_prompt_tokens"] == 1 and len(out["token_ids"]) == 20


def test_inspect_json():
    out = json.loads(rankserve("inspect", BUNDLED, "--json").stdout)
    assert out["family"] == "dense" and out["keep"] == 1.0 and out["config"]["num_key_value_heads"] == 4


def test_compress_then_eval_and_import_hf_roundtrip(tmp_path):
    p = rankserve("compress", "--method", "svd-llm", "--keep", "0.8", "--calib", CALIB, "--calib-tokens", "4096",
                  BUNDLED, tmp_path / "c", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["method"] == "svd-llm" and abs(out["keep"] - 0.8) < 0.02
    e = json.loads(rankserve("eval", tmp_path / "c", "--data", HEAD, "--reference", BUNDLED, "--max-tokens", "800",
                             "--seq-len", "256", "--json").stdout)
    assert e["tokens"] == 799 and 0 < e["top1_agreement"] < 1 and e["kl"] > 0 and "greedy_identity" in e


def test_bad_inputs(tmp_path):
    assert_clean_error(rankserve("generate", tmp_path / "nope"), "is not a directory")
    assert_clean_error(rankserve("compress", "--keep", "0", BUNDLED, tmp_path / "o"), "--keep must be in (0, 1]")
    assert_clean_error(rankserve("compress", "--keep", "1.5", BUNDLED, tmp_path / "o"), "--keep must be in (0, 1]")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_clean_error(rankserve("compress", "--method", "svd-llm", "--calib", empty, BUNDLED, tmp_path / "o"), "")
    assert_clean_error(rankserve("import", "--family", "nope", BUNDLED, tmp_path / "o"), "unknown family")
    assert not (tmp_path / "o").exists()


def test_wrong_shape_and_rank(tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    subprocess.run(["cp", "-r", str(BUNDLED), str(bad)], check=True)
    sd = load_file(str(bad / "model.safetensors"))
    sd["layers.1.attn.k.weight"] = torch.randn(31, 64)
    save_file(sd, str(bad / "model.safetensors"))
    assert_clean_error(rankserve("inspect", bad), "layers.1.attn.k.weight has shape [31, 64], expected [32, 64]")
    m = json.loads((BUNDLED / "rankserve.json").read_text())
    m["ranks"]["layers.0.attn.q"] = 65
    bad2 = tmp_path / "bad2"
    subprocess.run(["cp", "-r", str(BUNDLED), str(bad2)], check=True)
    (bad2 / "rankserve.json").write_text(json.dumps(m))
    assert_clean_error(rankserve("generate", bad2), "rank 65 exceeds min(out, in) = 64")


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch " + str(Path("/tmp") / "rankserve-pwned"),))


def test_pickle_needing_code_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((BUNDLED / "config.json").read_text())
    with open(src / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model": _Evil()}, f)
    marker = Path("/tmp/rankserve-pwned")
    marker.unlink(missing_ok=True)
    p = rankserve("import", "--family", "hf", src, tmp_path / "out")
    assert_clean_error(p, "--trust-pickle")
    assert not marker.exists() and not (tmp_path / "out").exists()
