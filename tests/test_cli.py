"""The `rankserve` command line, run as a user would: JSON outputs, and bad input as one line + exit 2, no traceback,
no partial output directory. PARSE: train-parse (a tiny build, and a resumed one), generate --parse / --subset, and
build-rank-cache against a real redis-server. Run alone: .venv/bin/python -m pytest tests/test_cli.py -q
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
# a tiny PARSE build (the test_parse.py fixtures' sizes): seconds, not a trained result
PARSE_ARGS = ["--keep", "0.6", "--calib-text", CALIB, "--train-text", CALIB, "--calib-tokens", "2048",
              "--calib-seq-len", "128", "--windows", "48", "--window", "32", "--prompt-len", "16", "--batch-size", "16",
              "--kd-batch", "4", "--steps", "4", "--kd-steps", "2"]


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


# ---- PARSE ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parse_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parse") / "p"
    p = rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["out"] == str(out) and info["base"] == "svd-llm" and info["matrices"] == 35
    assert info["k"] < info["r_max"] and abs(info["keep_compute"] - 0.6) < 0.02 and info["resumed"] is False
    assert not (out.parent / ".p.parse-work").exists()  # intermediates go once the checkpoint is in place
    return out


def test_generate_parse_and_replayed_subset_agree(parse_model, tmp_path):
    from rankserve.workers.parse import digest

    prompt = ["--prompt", "Once upon a time", "--max-new-tokens", "12"]
    p = rankserve("generate", parse_model, *prompt, "--parse", "--subset-out", tmp_path / "s.json", "--json")
    assert p.returncode == 0, p.stderr
    routed = json.loads(p.stdout)
    subset = json.loads((tmp_path / "s.json").read_text())
    assert routed["subset"]["digest"] == digest(subset)
    assert routed["subset"]["k"] == {n: len(idx) for n, idx in subset["k"].items()} and len(subset["k"]) == 35
    replayed = json.loads(rankserve("generate", parse_model, *prompt, "--subset", tmp_path / "s.json", "--json").stdout)
    assert replayed["token_ids"] == routed["token_ids"] and replayed["subset"] == routed["subset"]

    assert_clean_error(rankserve("generate", BUNDLED, "--parse"), "has no PARSE routers")
    subset["k"].pop("layers.0.attn.q")
    (tmp_path / "bad.json").write_text(json.dumps(subset))
    assert_clean_error(rankserve("generate", parse_model, "--subset", tmp_path / "bad.json"), "lacks projections")


def test_train_parse_resumes_from_its_work_dir(tmp_path):
    """An interrupted run leaves its work dir; the same command picks it up (here: every stage already done)."""
    from rankserve.compress.parse import TrainConfig, build_parse_checkpoint

    out = tmp_path / "p"
    work = tmp_path / ".p.parse-work"  # train-parse's default work dir for OUT
    build_parse_checkpoint(BUNDLED, tmp_path / "earlier", keep=0.6, calib_text=str(CALIB), train_text=[str(CALIB)],
                           steps=4, kd_steps=2, train=TrainConfig(windows=48, window=32, prompt_len=16, batch_size=16,
                                                                  kd_batch=4),
                           calib_tokens=2048, calib_seq_len=128, work_dir=work, keep_work=True, progress=False)
    assert (work / "settings.json").is_file() and (work / "data.safetensors").is_file()
    p = rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed"] is True and (out / "model.safetensors").is_file() and not work.exists()


def test_train_parse_bad_inputs(tmp_path):
    out = tmp_path / "o"
    assert_clean_error(rankserve("train-parse", tmp_path / "nope", out, *PARSE_ARGS), "is not a directory")
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--keep", "0"), "--keep must be in (0, 1]")
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--keep", "1.5"), "--keep must be in (0, 1]")
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--base", "dobi"), "unknown PARSE base")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--train-text", empty), "is empty")
    other = tmp_path / ".o.parse-work"  # a work dir left by a run with other arguments
    other.mkdir()
    (other / "settings.json").write_text("{}")
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS), "holds a run with other settings")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [".o.parse-work", "empty.txt"]
    assert_clean_error(rankserve("train-parse", BUNDLED, tmp_path, *PARSE_ARGS), "already exists")


@pytest.mark.serve
def test_build_rank_cache_fills_what_the_router_looks_up(parse_model, tmp_path):
    from servers import RedisServer

    from rankserve.rank_cache import Embedder, RankCache, model_version
    from rankserve.workers.engine import Engine

    prompts = ["The little cat climbed the tall tree to see the birds.", "Tom found a shiny red box under his bed.",
               "The little cat climbed up the tall tree to see the birds.",  # a paraphrase of the first: answered
               "", "Tom found a shiny red box under his bed."]  # a blank line and a repeat
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    redis = RedisServer(tmp_path).start()
    try:
        p = rankserve("build-rank-cache", parse_model, "--prompts", tmp_path / "prompts.txt", "--redis-url", redis.url,
                      "--family", "parse-tiny", "--json")
        assert p.returncode == 0, p.stderr
        info = json.loads(p.stdout)
        version = model_version(parse_model)
        assert info["model_version"] == version and info["prompts"] == 4
        assert (info["written"], info["skipped"], info["entries"]) == (2, 2, 2)

        cache = RankCache(redis.url)  # what a router replica does at start
        cache.start([("parse-tiny", version)])
        try:
            engine, embedder = Engine.load(parse_model), Embedder()
            for text in prompts[:2]:
                hit = cache.lookup("parse-tiny", version, embedder.embed_one(text))
                assert hit is not None and hit.subset == engine.rank_subset(text)
        finally:
            cache.close()
    finally:
        redis.stop()
    assert_clean_error(rankserve("build-rank-cache", parse_model, "--prompts", tmp_path / "prompts.txt",
                                 "--redis-url", redis.url, "--family", "parse-tiny"), f"cannot reach Redis at {redis.url}")


def test_bench_parse_speed_without_a_gpu_says_so():
    """`rankserve bench parse-speed` on a machine without CUDA: a clear error and exit 2, no traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would run the benchmark")
    r = subprocess.run([sys.executable, "-m", "rankserve.cli", "bench", "parse-speed", "--", "--batches", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
