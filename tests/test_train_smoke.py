"""CPU smoke of the reference trainer: corpus -> BPE -> 5 steps of a tiny LLaMA -> an HF dir transformers loads.

Run alone: .venv/bin/python -m pytest tests/test_train_smoke.py -q
"""

import json
import math

import pytest
import torch

from rankserve.compress.bpe import prepare_reference
from rankserve.compress.corpus import Source, build_corpus
from rankserve.compress.train import TrainConfig, load_hf, main, train

OUT_FILES = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "train_log.json", "loss.png", "README.md"}
SMOKE = ["--preset", "tiny", "--device", "cpu", "--max-steps", "5", "--batch-size", "4", "--seq-len", "32",
         "--no-compile", "--eval-windows", "2", "--final-eval-windows", "4", "--log-every", "1"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    shared = tmp / "shared"
    (shared / "wikitext-2-raw-test").mkdir(parents=True)
    (shared / "wikitext-2-pytorch-examples").mkdir()
    (shared / "wikitext-2-raw-test" / "wiki.test.raw").write_text(
        " = Test = \n \n" + " The river flows to the sea , and the town grew beside it . \n" * 40)
    (shared / "wikitext-2-pytorch-examples" / "valid.txt").write_text(
        " = Valid = \n \n" + " The <unk> king ruled the land for many years . \n" * 40)
    src = tmp / "src"
    src.mkdir()
    for i in range(20):
        (src / f"doc{i}.txt").write_text(f"Document {i}. The history of the town is long and old.\n\n"
                                         f"def f{i}(x):\n    return x * {i}\n\nA café in the square, number {i}.\n")
    build_corpus(tmp / "corpus", shared, sources=[Source("sample", sorted(src.glob("*.txt")), "test", src)])
    prepare_reference(tmp / "corpus", tmp / "data", vocab_size=320)
    return tmp / "data"


def test_smoke_writes_hf_dir(data_dir, tmp_path):
    out = tmp_path / "model"
    main(["--data", str(data_dir), "--out", str(out), *SMOKE])
    assert {p.name for p in out.iterdir()} == OUT_FILES  # the device returns at most 8 files
    log = json.loads((out / "train_log.json").read_text())
    f = log["final"]
    assert f["steps"] == 5 and len(log["logs"]) == 5
    assert math.isfinite(f["test_loss"]) and math.isfinite(f["train_loss"])
    assert f["unigram_test_perplexity"] > 1
    assert log["hf_check"]["max_abs_logit_diff"] < 1e-4

    from transformers import AutoTokenizer, LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(out).float().eval()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    ours = load_hf(out).eval()
    x = torch.randint(3, 320, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-4, rtol=1e-4)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The history of the town")["input_ids"]
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=True) == "The history of the town"


def test_same_seed_same_curve(data_dir, tmp_path):
    t = TrainConfig(preset="tiny", device="cpu", max_steps=4, batch_size=4, seq_len=32, compile=False,
                    eval_windows=2, final_eval_windows=2, log_every=1, warmup_steps=2, lr=1e-2)
    a = train(data_dir, tmp_path / "a", t)
    b = train(data_dir, tmp_path / "b", t)
    assert [r["train_loss"] for r in a["logs"]] == [r["train_loss"] for r in b["logs"]]
    assert a["logs"][-1]["train_loss"] < a["logs"][0]["train_loss"]  # it learns


def test_existing_output_is_refused_before_training(tmp_path, capsys):
    """A non-empty --out is never written into file by file: refused before any training time is spent."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.bin", "test.bin", "val.bin", "tokenizer.json", "manifest.json"):
        (data / name).write_bytes(b"")  # never read: the output is checked first
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("someone else's model")
    with pytest.raises(SystemExit) as e:
        main(["--data", str(data), "--out", str(out), *SMOKE])
    assert e.value.code == 2 and "exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "someone else's model"
