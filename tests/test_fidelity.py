"""Fidelity harness: hand-checkable cases (a model against itself), the table writer, bad inputs.

Run alone: .venv/bin/python -m pytest tests/test_fidelity.py -q
"""

from pathlib import Path

import pytest

from rankserve.compress.fidelity import fidelity, fidelity_table, read_prompts

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "stories260K"
TEXT = ROOT / "tests" / "data" / "wikitext2-raw-test-head.txt"


def test_model_against_itself_is_perfect():
    r = fidelity(MODEL, TEXT, reference_dir=MODEL, max_tokens=600, seq_len=128, n_tokens=8, progress=False)
    assert r["top1_agreement"] == 1.0 and abs(r["kl"]) < 1e-6 and r["greedy_identity"] == 1.0
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
