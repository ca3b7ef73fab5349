"""bench/lm_eval_check.py without lm-eval itself: the tokenizer directory it hands the harness, the engine's own
scores it compares against (a continuation's log-likelihood and greedy flag from prompt_logprobs), and the CLI's
refusal of a missing interpreter. The harness run is recorded in bench/results/lm-eval-cpu*.json.

Run alone:  .venv/bin/python -m pytest tests/test_bench_lm_eval.py -q
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rankserve.bench import lm_eval_check as lc
from rankserve.workers.engine import Engine

MODEL = Path(__file__).resolve().parents[1] / "models" / "stories260K"


def test_tokenizer_dir_wraps_a_sentencepiece_model(tmp_path):
    d = lc.tokenizer_dir(MODEL, tmp_path)
    assert (d / "tokenizer.model").read_bytes() == (MODEL / "tokenizer.model").read_bytes()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "LlamaTokenizer" and cfg["model_max_length"] == \
        json.loads((MODEL / "config.json").read_text())["max_position_embeddings"]
    (tmp_path / "fast").mkdir()
    (tmp_path / "fast" / "tokenizer.json").write_text("{}")
    assert lc.tokenizer_dir(tmp_path / "fast", tmp_path) == tmp_path / "fast"  # a fast tokenizer is read as is


def test_engine_scores_are_the_continuations_log_likelihood():
    """The sum of the continuation tokens' log-softmax from one forward of context + continuation (no BOS, as the
    harness sends), and the greedy flag true exactly when each continuation token is the argmax."""
    e = Engine.load(MODEL)
    ctx = e.tokenizer.encode("Tom had a red ball. He threw the ball to his", bos=False)
    cont = e.tokenizer.encode(" friend.", bos=False)
    with torch.no_grad():
        logits = e.model(torch.tensor([ctx + cont]))[0].float()  # (S, V)
    lp = torch.log_softmax(logits, -1)
    want = math.fsum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
    greedy = all(lp[len(ctx) - 1 + i].argmax().item() == t for i, t in enumerate(cont))
    (ll, flag), = lc.engine_scores(MODEL, [(ctx, cont)])
    assert ll == pytest.approx(want, abs=1e-4) and flag == greedy
    top = lp[len(ctx) - 1].argmax().item()  # a continuation that is the argmax is greedy
    assert lc.engine_scores(MODEL, [(ctx, [top])])[0][1] is True


def test_cli_refuses_a_missing_interpreter(capsys):
    with pytest.raises(SystemExit) as e:
        lc.main(["--lm-eval-python", "/nonexistent/python"])
    assert e.value.code == 2 and "is not a file" in capsys.readouterr().err
