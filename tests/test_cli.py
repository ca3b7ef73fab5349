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


def test_generate_from_token_ids():
    """--prompt-ids: the prompt as token ids, used as given; the text's own ids (BOS first) give the text's reply; bad
    ids and --prompt with --prompt-ids are one-line errors."""
    by_text = json.loads(rankserve("generate", BUNDLED, "--prompt", "Once upon a time", "--max-new-tokens", "8",
                                   "--json").stdout)
    p = rankserve("generate", BUNDLED, "--prompt-ids", "1,403,407,261,378", "--max-new-tokens", "8", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == by_text
    assert rankserve("generate", BUNDLED, "--prompt-ids", "1,403,407,261,378", "--max-new-tokens", "8").stdout \
        .startswith("Once upon a time" + by_text["text"])
    assert_clean_error(rankserve("generate", BUNDLED, "--prompt-ids", "1,x"), "comma-separated integers")
    assert_clean_error(rankserve("generate", BUNDLED, "--prompt-ids", "1,99999"), "token id 99999 at position 1")
    assert_clean_error(rankserve("generate", BUNDLED, "--prompt", "a", "--prompt-ids", "1"), "exclude each other")


def test_inspect_json():
    out = json.loads(rankserve("inspect", BUNDLED, "--json").stdout)
    assert out["family"] == "dense" and out["keep"] == 1.0 and out["config"]["num_key_value_heads"] == 4


def test_compress_then_eval_and_import_hf_roundtrip(tmp_path):
    p = rankserve("compress", "--method", "svd-llm", "--keep", "0.8", "--calib", CALIB, "--calib-tokens", "4096",
                  "--svd-route", "eigh", BUNDLED, tmp_path / "c", "--json")
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
    assert_clean_error(rankserve("compress", "--method", "basis-sharing", BUNDLED, tmp_path / "o"),
                       "--method basis-sharing whitens with calibration statistics: pass --calib TEXT")
    assert_clean_error(rankserve("import", "--family", "nope", BUNDLED, tmp_path / "o"), "unknown family")
    assert_clean_error(rankserve("compress", "--method", "svd", "--svd-route", "qr", BUNDLED, tmp_path / "o"),
                       "unknown --svd-route 'qr'")
    for n, msg in [("0", "--calib-tokens must be positive, got 0"),  # before the model loads
                   ("100", "--calib-tokens=100 is below 172, the widest projection input")]:
        assert_clean_error(rankserve("compress", "--method", "svd-llm", "--calib", CALIB, "--calib-tokens", n, BUNDLED,
                                     tmp_path / "o"), msg)
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
    torch.save({"model": _Evil()}, src / "pytorch_model.bin")  # a torch file: --trust-pickle would load it
    marker = Path("/tmp/rankserve-pwned")
    marker.unlink(missing_ok=True)
    p = rankserve("import", "--family", "hf", src, tmp_path / "out")
    assert_clean_error(p, "needs arbitrary pickled code to load (it calls posix.system)")
    assert "--trust-pickle" in p.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()
    with open(src / "pytorch_model.bin", "wb") as f:  # a plain pickle is no torch file, with or without trust
        pickle.dump({"model": _Evil()}, f)
    assert_clean_error(rankserve("import", "--family", "hf", src, tmp_path / "out"), "is not a readable torch file")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_unreadable_weights_are_not_called_pickles_needing_code(tmp_path):
    """A truncated, empty or garbage .bin / .safetensors is unreadable, not "needs code"; --trust-pickle alike."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((BUNDLED / "config.json").read_text())
    torch.save({"embed.weight": torch.zeros(4, 4)}, tmp_path / "good.bin")
    whole = (tmp_path / "good.bin").read_bytes()
    for data, trust in [(whole[:len(whole) // 2], []), (b"", []), (b"", ["--trust-pickle"]),
                        (b"garbage " * 20, ["--trust-pickle"])]:
        (src / "pytorch_model.bin").write_bytes(data)
        p = rankserve("import", "--family", "hf", src, tmp_path / "out", *trust)
        assert_clean_error(p, "is not a readable torch file")
        assert "needs arbitrary pickled code" not in p.stderr
    (src / "pytorch_model.bin").unlink()
    (src / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    assert_clean_error(rankserve("import", "--family", "hf", src, tmp_path / "out"), "is not a readable safetensors file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.bin", "src"]


def test_malformed_hf_config_is_a_one_line_error(tmp_path):
    """A source config.json with a field of the wrong type, or no object at all: one line naming the file."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "remapping_weight.pt").write_bytes(b"")  # a Dobi-SVD remapping dir: its config is read first
    good = json.loads((BUNDLED / "config.json").read_text())
    for config, msg, families in [({**good, "hidden_size": [64]}, "a field has the wrong type", ["hf"]),
                                  ({**good, "rope_scaling": 3}, "a field has the wrong type", ["basis-sharing"]),
                                  (7, "must hold a JSON object, not a int", ["hf", "dobi-svd"])]:
        (src / "config.json").write_text(json.dumps(config))
        for family in families:
            assert_clean_error(rankserve("import", "--family", family, src, tmp_path / "out"),
                               f"{src / 'config.json'}: {msg}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_import_without_a_tokenizer_says_so(tmp_path):
    """An HF dir with weights and config but no tokenizer imports, and the import says that generate will need one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tmp_path / "src"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(src)
    p = rankserve("import", "--family", "hf", src, tmp_path / "out", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["family"] == "dense"
    assert "note: no tokenizer was found beside" in p.stderr and str(tmp_path / "out") in p.stderr


# ---- PARSE ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parse_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parse") / "p"
    p = rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--router-chunk", "7", "--json")  # a layer at a time
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["out"] == str(out) and info["base"] == "svd-llm" and info["matrices"] == 35
    assert json.loads((out / "rankserve.json").read_text())["methods"]["parse"]["training"]["router_chunk"] == 7
    assert info["k"] < info["r_max"] and abs(info["keep_compute"] - 0.6) < 0.02 and info["resumed"] is False
    assert not (out.parent / ".p.parse-work").exists()  # intermediates go once the checkpoint is in place
    return out


def test_inspect_and_eval_tell_a_parse_checkpoints_compute_from_its_memory(parse_model):
    """inspect: the pool's keep (memory) and a request's (compute, K); eval: routed per window by default, the
    static and pool modes on the same tokens."""
    info = json.loads(rankserve("inspect", parse_model, "--json").stdout)
    assert info["keep"] > 1 and abs(info["parse"]["keep_compute"] - 0.6) < 0.02 and info["parse"]["matrices"] == 35
    p = rankserve("inspect", parse_model)
    assert "a request computes with keep 0.5801 (asked 0.6)" in p.stdout and "the pool stores keep 1.1601" in p.stdout
    ev = {m: json.loads(rankserve("eval", parse_model, "--data", HEAD, "--max-tokens", "400", "--seq-len", "128",
                                  *(["--parse-mode", m] if m else []), "--json").stdout) for m in (None, "static")}
    assert ev[None]["parse_mode"] == "route" and ev["static"]["parse_mode"] == "static"
    assert ev[None]["prompt_len"] == 64 and ev[None]["tokens"] == ev["static"]["tokens"] < 399
    p = rankserve("eval", parse_model, "--data", HEAD, "--max-tokens", "400", "--seq-len", "128")
    assert p.returncode == 0 and "PARSE: each window's subset routed on its prompt" in p.stdout, p.stderr
    assert_clean_error(rankserve("eval", BUNDLED, "--data", HEAD, "--parse-mode", "static"), "not a PARSE checkpoint")


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
    plain = json.loads(rankserve("generate", parse_model, *prompt, "--json").stdout)  # routes all the same
    assert plain["token_ids"] == routed["token_ids"] and plain["subset"] == routed["subset"]

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
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--router-chunk", "-1"),
                       "--router-chunk must be >= 0")
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--kd-offload", "yes"),
                       "unknown --kd-offload 'yes'; choose one of: auto, on, off")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--train-text", empty), "is empty")
    other = tmp_path / ".o.parse-work"  # a work dir left by a run with other arguments
    other.mkdir()
    (other / "settings.json").write_text("{}")
    (other / ".rankserve-parse-work").touch()
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS), "holds an unfinished run with other "
                       "arguments; pass --no-resume to discard it, or --work-dir to start elsewhere")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [".o.parse-work", "empty.txt"]
    assert_clean_error(rankserve("train-parse", BUNDLED, tmp_path, *PARSE_ARGS), "already exists")
    both = "give --calib-text (a pool built from DENSE by --base) or --pool CHECKPOINT (its own components), not both"
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--pool", BUNDLED), both)
    assert_clean_error(rankserve("train-parse", BUNDLED, out, "--train-text", CALIB), both)
    assert_clean_error(rankserve("train-parse", BUNDLED, out, "--train-text", CALIB, "--pool", BUNDLED),
                       "no factorized projection")
    assert_clean_error(rankserve("train-parse", BUNDLED, out, "--train-text", CALIB, "--pool", tmp_path / "nope"),
                       "is not a directory")
    assert not out.exists()


def test_train_parse_from_a_low_rank_checkpoint(tmp_path):
    """--pool: the experts are a compressed checkpoint's own components (no calibration of its own)."""
    pool = tmp_path / "pool"
    assert rankserve("compress", "--method", "svd-llm", "--keep", "0.8", "--calib", CALIB, "--calib-tokens", "2048",
                     BUNDLED, pool).returncode == 0
    out = tmp_path / "p"
    args = [a for a in PARSE_ARGS[4:] if a not in ("--calib-seq-len", "128")]  # no --calib-text, --calib-seq-len
    p = rankserve("train-parse", BUNDLED, out, "--keep", "0.6", "--pool", pool, *args, "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["base"] == "svd-llm" and info["pool"] == str(pool) and info["k"] < info["r_max"]


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


# ---- user errors found in review: one line, exit 2, nothing left behind ---------------------------------------

def test_train_parse_never_deletes_a_dir_it_did_not_create(tmp_path):
    """--no-resume removes only a marked PARSE work dir, and only once the inputs are checked."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "settings.json").write_text("{}")  # looks like a work dir, but holds someone's files
    (precious / "notes.txt").write_text("keep me")
    for dense in (BUNDLED, tmp_path / "nope"):
        p = rankserve("train-parse", dense, tmp_path / "o", *PARSE_ARGS, "--work-dir", precious, "--no-resume")
        assert_clean_error(p, "is not a directory" if dense != BUNDLED else "is not a PARSE work dir")
        assert sorted(f.name for f in precious.iterdir()) == ["notes.txt", "settings.json"]
    marked = tmp_path / ".o.parse-work"  # an earlier run's (marked) work dir: --no-resume starts over
    marked.mkdir()
    (marked / ".rankserve-parse-work").touch()
    (marked / "settings.json").write_text("{}")
    assert_clean_error(rankserve("train-parse", tmp_path / "nope", tmp_path / "o", *PARSE_ARGS, "--no-resume"),
                       "is not a directory")
    assert (marked / "settings.json").is_file()  # bad input: nothing deleted
    p = rankserve("train-parse", BUNDLED, tmp_path / "o", "--train-text", CALIB, "--pool", BUNDLED, "--no-resume")
    assert_clean_error(p, "no factorized projection")  # a pool refused once the inputs are read: nothing deleted
    assert (marked / "settings.json").is_file()
    p = rankserve("train-parse", BUNDLED, tmp_path / "o", *PARSE_ARGS, "--no-resume", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed"] is False and not marked.exists()


def test_train_parse_failures_leave_no_work_dir(tmp_path):
    """A failed run removes the work dir it created, so the corrected command is not refused as "other settings"."""
    out = tmp_path / "o"
    for flags, msg in [(["--pool-factor", "inf"], "--pool-factor must be a finite number >= 1"),
                       (["--pool-factor", "nan"], "--pool-factor must be a finite number >= 1"),
                       (["--group-size", "0"], "--group-size must be at least 1"),
                       (["--group-size", "-1"], "--group-size must be at least 1"),
                       (["--svd-route", "qr"], "unknown --svd-route 'qr'")]:
        assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, *flags), msg)
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"text": "Once upon a time"}\n{"txt": "a line without text"}\n')
    p = rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--train-text", bad, "--json")
    assert_clean_error(p, f'training text {bad} line 2 has no "text" string')
    assert sorted(f.name for f in tmp_path.iterdir()) == ["corpus.jsonl"]


def test_bench_options_reach_the_bench_module():
    """`rankserve bench X --opt` hands --opt to bench/X.py's argparse (typer used to answer "No such option")."""
    p = rankserve("bench", "load", "--help")
    assert p.returncode == 0 and "usage: rankserve bench load" in p.stdout and "--json" in p.stdout, p.stderr
    p = rankserve("bench", "decode", "--help")
    assert p.returncode == 0 and "usage: rankserve bench decode" in p.stdout and "--out" in p.stdout, p.stderr
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bench decode would run the benchmark")
    p = rankserve("bench", "decode", "--out", "/nonexistent/decode.json", "--batches", "1")
    assert_clean_error(p, "needs a CUDA GPU")


def test_output_paths_checked_before_the_work(tmp_path):
    (tmp_path / "file").write_text("x")
    under_file = tmp_path / "file" / "out"
    assert_clean_error(rankserve("compress", "--method", "svd", BUNDLED, under_file), "file is not a directory")
    assert_clean_error(rankserve("import", "--family", "hf", BUNDLED, under_file), "file is not a directory")
    p = rankserve("generate", BUNDLED, "--parse", "--subset-out", tmp_path, "--max-new-tokens", "2")
    assert_clean_error(p, f"--subset-out {tmp_path} is a directory")
    p = rankserve("eval", BUNDLED, "--data", HEAD, "--max-tokens", "64", "--markdown", tmp_path)
    assert_clean_error(p, f"--markdown {tmp_path} is a directory")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["file"]  # no .tmp files


def test_malformed_manifest_and_tokenizer_are_one_line_errors(tmp_path):
    def clone(name: str) -> Path:
        d = tmp_path / name
        subprocess.run(["cp", "-r", str(BUNDLED), str(d)], check=True)
        return d

    man = json.loads((BUNDLED / "rankserve.json").read_text())
    for name, patch, msg in [("list", [1], "must hold a JSON object"),
                             ("groups", {"groups": {"g": [5]}}, "group 'g' must be a list of projection names"),
                             ("parse", {"methods": {"parse": {"k": 5}}}, "methods.parse.k must map")]:
        d = clone(name)
        (d / "rankserve.json").write_text(json.dumps(patch if isinstance(patch, list) else {**man, **patch}))
        assert_clean_error(rankserve("generate", d, "--max-new-tokens", "2"), msg)
    d = clone("foreign-tokenizer")  # the reference model's tokenizer.json (12288 tokens) beside a 512-token model
    (d / "tokenizer.json").write_bytes((ROOT / "models" / "reference" / "tokenizer.json").read_bytes())
    msg = "the tokenizer has 12288 tokens but the model only 512"
    assert_clean_error(rankserve("generate", d, "--max-new-tokens", "2"), msg)
    assert_clean_error(rankserve("eval", d, "--data", HEAD, "--max-tokens", "64"), msg)
    d = clone("corrupt-tokenizer")
    (d / "tokenizer.model").write_bytes(b"garbage")
    assert_clean_error(rankserve("generate", d, "--max-new-tokens", "2"), "is not a readable SentencePiece model")


def test_eval_arguments_and_nan_perplexity(tmp_path):
    assert_clean_error(rankserve("eval", BUNDLED, "--data", HEAD, "--max-tokens", "-5"), "--max-tokens must be >= 0")
    for n in ("0", "-3"):
        assert_clean_error(rankserve("eval", BUNDLED, "--data", HEAD, "--reference", BUNDLED, "--greedy-tokens", n),
                           "--greedy-tokens must be at least 1")
    nan = tmp_path / "nan"
    subprocess.run(["cp", "-r", str(BUNDLED), str(nan)], check=True)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(nan / "model.safetensors"))
    sd["norm.weight"][:] = float("nan")
    save_file(sd, str(nan / "model.safetensors"))
    p = rankserve("eval", nan, "--data", HEAD, "--max-tokens", "64", "--json", "--markdown", tmp_path / "t.md")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))["perplexity"] is None
    assert "| nan |" in (tmp_path / "t.md").read_text()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["nan", "t.md"]


def test_sampling_errors_name_the_flags():
    for flags, msg in [(["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
                       (["--top-p", "0"], "--top-p must be in (0, 1]"), (["--top-k", "-1"], "--top-k must be >= 0"),
                       (["--temperature", "inf"], "--temperature must be 0 (greedy) or finite"),
                       (["--temperature", "1", "--seed", str(2**64)], "--seed must be in [-9223372036854775808, ")]:
        assert_clean_error(rankserve("generate", BUNDLED, *flags), msg)


def test_unusable_device_is_a_one_line_error(tmp_path):
    assert_clean_error(rankserve("generate", BUNDLED, "--device", "bogus", "--max-new-tokens", "2"),
                       "--device 'bogus' is not usable here")
    # the offline tools too, before any work and with nothing written (cuda:99 is refused with or without a GPU)
    out = tmp_path / "o"
    assert_clean_error(rankserve("compress", "--method", "svd", "--keep", "0.5", "--device", "cuda:99", BUNDLED, out),
                       "--device 'cuda:99' is not usable here")
    assert_clean_error(rankserve("train-parse", BUNDLED, out, *PARSE_ARGS, "--device", "bogus"),
                       "--device 'bogus' is not usable here")
    assert_clean_error(rankserve("compress", "--method", "svd", "--keep", "0.5", "--device", "meta", BUNDLED, out),
                       "device type 'meta' is not supported")  # torch places tensors there, but computes nothing
    assert sorted(tmp_path.iterdir()) == []
    if not torch.cuda.is_available():
        assert_clean_error(rankserve("generate", BUNDLED, "--device", "cuda", "--max-new-tokens", "2"),
                           "--device 'cuda' is not usable here")


def test_sigterm_during_a_save_leaves_no_temp_dir(tmp_path):
    """SIGTERM unwinds like Ctrl-C: the checkpoint's temp dir is removed and the command says "interrupted"."""
    import signal
    import time

    for attempt in range(5):  # on a loaded machine the save can finish between two polls: then try again
        out = tmp_path / f"out{attempt}"
        p = subprocess.Popen([sys.executable, "-m", "rankserve.cli", "compress", "--method", "svd", "--keep", "0.6",
                              ROOT / "models" / "reference", out, "--json"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        while p.poll() is None and not any(f.name.startswith(f".{out.name}.tmp-") for f in tmp_path.iterdir()):
            time.sleep(0.0005)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        if p.returncode != 0:
            break
    assert p.returncode == 2 and err.strip().splitlines()[-1] == "error: interrupted", (p.returncode, err)
    assert not any(".tmp-" in f.name for f in tmp_path.iterdir())
    assert not out.exists() or (out / "model.safetensors").is_file()  # the signal may land just after the rename


def test_bench_load_family_option_needs_key_and_value():
    from rankserve.bench.load import main

    with pytest.raises(SystemExit) as e:
        main(["--family-option", "join_running"])  # refused before any service starts
    assert e.value.code == 2
