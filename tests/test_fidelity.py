"""Fidelity harness: hand-checkable cases (a model against itself), the table writer, bad inputs.

Run alone: .venv/bin/python -m pytest tests/test_fidelity.py -q
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rankserve.compress.evaluate import windows
from rankserve.compress.fidelity import fidelity, fidelity_table, read_prompts
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.parse import apply, clear, load_parse, select
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "stories260K"
TEXT = ROOT / "tests" / "data" / "wikitext2-raw-test-head.txt"


def test_model_against_itself_is_perfect():
    r = fidelity(MODEL, TEXT, reference_dir=MODEL, max_tokens=600, seq_len=128, n_tokens=8, progress=False)
    assert r["top1_agreement"] == 1.0 and abs(r["kl"]) < 1e-6 and r["greedy_identity"] == 1.0
    assert r["reference_family"] == "dense" and r["reference_keep"] == 1.0
    assert r["perplexity"] == pytest.approx(r["reference_perplexity"]) and r["tokens"] == 599
    md = fidelity_table([r], title="self")
    assert r["greedy_identity_at"] == {"4": 1.0, "8": 1.0}
    assert "| stories260K | dense | 1.000 |" in md and "1.000 | 0.000 | 1.00 / 1.00 | 599 |" in md


def test_without_reference_only_perplexity():
    r = fidelity(MODEL, TEXT, max_tokens=300, seq_len=128, progress=False)
    assert "top1_agreement" not in r and r["perplexity"] > 1


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        fidelity(MODEL, tmp_path / "missing.txt")
    empty = tmp_path / "p.txt"
    empty.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompts(empty)
    assert len(read_prompts(ROOT / "bench" / "prompts" / "fidelity.txt")) == 16


def test_a_parse_checkpoint_is_scored_as_served(tiny_parse):
    """route (the default): each window's subset routed on its first prompt_len tokens, which are not scored;
    static: the first K components; pool: all of them. All three score the same tokens; a window by hand agrees."""
    P, L = 24, 96
    res = {m: fidelity(tiny_parse, TEXT, max_tokens=500, seq_len=L, prompt_len=P, parse_mode=m, progress=False)
           for m in ("route", "static", "pool")}
    assert fidelity(tiny_parse, TEXT, max_tokens=500, seq_len=L, prompt_len=P, progress=False) == res["route"]
    model, man = load_checkpoint(tiny_parse, "cpu", torch.float32)
    routers, tok = load_parse(tiny_parse, model), Tokenizer.load(tiny_parse)
    ids = tok.encode(TEXT.read_text(), bos=True)[:500]
    for mode, r in res.items():
        nll = []
        for s, e, f in windows(len(ids), L, L):
            lo = max(f, s + P - 1)  # the last window overlaps the one before: it scores only what that did not
            if lo >= e:
                continue
            sub = {"route": lambda: select(model, routers, ids[s:s + P]), "static": routers.static_subset,
                   "pool": lambda: None}[mode]()
            apply(model, [sub]) if sub else clear(model)
            with torch.no_grad():
                logits = model(torch.tensor([ids[s:e]]))[0, lo - s:]
            nll.append(F.cross_entropy(logits.double(), torch.tensor(ids[lo + 1:e + 1]), reduction="none"))
        nll = torch.cat(nll)
        assert r["tokens"] == nll.numel() and r["nll"] == pytest.approx(float(nll.mean()), rel=1e-5), mode
        assert r["parse_mode"] == mode and r["prompt_len"] == P
    assert res["pool"]["keep"] == man.keep and res["route"]["keep"] == man.methods["parse"]["keep_compute"]
    assert res["route"]["nll"] != res["static"]["nll"]  # the routers do pick other subsets
    with pytest.raises(ValueError, match="not a PARSE checkpoint"):
        fidelity(MODEL, TEXT, max_tokens=300, seq_len=128, parse_mode="static", progress=False)
    with pytest.raises(ValueError, match="routing needs a prompt"):
        fidelity(tiny_parse, TEXT, max_tokens=300, seq_len=128, prompt_len=0, progress=False)


def test_parse_greedy_identity_routes_each_prompt(tiny_parse, tmp_path):
    """With a reference, the greedy prompts are routed too: route and static give different generations on this
    checkpoint, pool (every component) is the pool model's."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\nThe little dog\nLily wanted to\n")
    r = {m: fidelity(tiny_parse, TEXT, reference_dir=MODEL, prompts_path=prompts, max_tokens=300, seq_len=128,
                     n_tokens=8, parse_mode=m, progress=False) for m in ("route", "static", "pool")}
    assert all(0 <= x["greedy_identity"] <= 1 and x["tokens"] == r["pool"]["tokens"] for x in r.values())
    assert r["pool"]["kl"] < r["static"]["kl"]
