"""Fidelity harness: every compression method reports through this one suite.

For a model and its dense reference: held-out perplexity (sliding window), top-1 next-token agreement and mean
KL(reference ‖ model) over the same windows, and greedy identity (the fraction of fixed prompts whose first N
greedy tokens equal the reference's). `fidelity_table` writes rows of several runs as a markdown table.

    rankserve eval MODEL --data wiki.test.raw --reference DENSE --prompts bench/prompts/fidelity.txt --json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rankserve.compress.evaluate import compare, greedy_identity, perplexity
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.tokenizer import Tokenizer

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "prompts" / "fidelity.txt"


def read_prompts(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    prompts = [l.strip() for l in path.read_text().splitlines() if l.strip() and not l.startswith("#")]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def fidelity(model_dir: str | Path, data_path: str | Path, reference_dir: str | Path | None = None,
             prompts_path: str | Path | None = None, n_tokens: int = 16, seq_len: int | None = None,
             stride: int | None = None, max_tokens: int | None = None, progress: bool = True) -> dict[str, Any]:
    """The suite's numbers for one model (with a reference: agreement, KL, greedy identity as well)."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens (greedy tokens compared per prompt) must be at least 1, got {n_tokens}")
    path = Path(data_path)
    if not path.is_file():
        raise ValueError(f"evaluation text {path} does not exist or is not a file")
    text = path.read_text(encoding="utf-8", errors="replace")
    model, manifest = load_checkpoint(model_dir, "cpu", torch.float32)
    tok = Tokenizer.load(model_dir)
    out: dict[str, Any] = dict(model=str(model_dir), family=manifest.family, keep=manifest.keep,
                               method=manifest.provenance.get("method", manifest.family))
    if reference_dir is None:
        out.update(perplexity(model, tok, text, seq_len, stride, max_tokens, progress=progress))
        return out
    reference, _ = load_checkpoint(reference_dir, "cpu", torch.float32)
    if reference.cfg.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"{reference_dir} has a different vocabulary ({reference.cfg.vocab_size} tokens) "
                         f"than {model_dir} ({model.cfg.vocab_size}): not its reference")
    out.update(compare(model, reference, tok, text, seq_len, stride, max_tokens, progress=progress))
    prompts = read_prompts(prompts_path or DEFAULT_PROMPTS)
    at = greedy_identity(model, reference, tok, prompts, n_tokens, prefixes=tuple(sorted({min(4, n_tokens), n_tokens})))
    out["greedy_identity"] = at[n_tokens]
    out["greedy_identity_at"] = {str(n): v for n, v in at.items()}  # shorter prefixes separate near-misses
    out["greedy_prompts"], out["greedy_tokens"] = len(prompts), n_tokens
    return out


def fidelity_table(rows: list[dict[str, Any]], title: str = "") -> str:
    """Markdown table of `fidelity` results (one row each)."""
    lines = [f"### {title}", ""] if title else []
    lines += ["| model | method | keep | perplexity | top-1 agreement | KL | greedy identity (first 4 / 16 tokens) | tokens |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        f = lambda k, fmt: (fmt.format(r[k]) if k in r else "–")  # noqa: E731
        lines.append(f"| {Path(r['model']).name} | {r.get('method', '')} | {r.get('keep', 1.0):.3f} | "
                     f"{f('perplexity', '{:.2f}')} | {f('top1_agreement', '{:.3f}')} | {f('kl', '{:.3f}')} | "
                     f"{_greedy_cell(r)} | {r.get('tokens', '')} |")
    return "\n".join(lines) + "\n"


def _greedy_cell(r: dict[str, Any]) -> str:
    at = r.get("greedy_identity_at")
    if at:
        return " / ".join(f"{at[k]:.2f}" for k in sorted(at, key=int))
    return f"{r['greedy_identity']:.2f}" if "greedy_identity" in r else "–"
