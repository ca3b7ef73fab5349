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
from rankserve.workers.model import Transformer
from rankserve.workers.parse import Routers, apply, load_parse, select_batch
from rankserve.workers.tokenizer import Tokenizer

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "prompts" / "fidelity.txt"
PARSE_MODES = ("route", "static", "pool")  # how a PARSE checkpoint is scored (fidelity)
PARSE_PROMPT_LEN = 64  # tokens a window's subset is routed on (bench/parse.py's protocol)


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
             stride: int | None = None, max_tokens: int | None = None, progress: bool = True,
             parse_mode: str | None = None,  # PARSE checkpoints (PARSE_MODES); None = "route"
             prompt_len: int | None = None,  # a window's first tokens, not scored; None = PARSE_PROMPT_LEN on a
             # PARSE checkpoint (every mode), else 0
             ) -> dict[str, Any]:
    """The suite's numbers for one model (with a reference: agreement, KL, greedy identity as well).

    A PARSE checkpoint is scored as it is served by default ("route"): each window's subset is routed on the
    window's first `prompt_len` tokens (its prompt), whose own targets are then not scored; "static" uses every
    window with the base's first K components (the static baseline at the same K), "pool" all r_max components
    (its memory, not its compute). A static model scored with the same `prompt_len` scores the same tokens."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens (greedy tokens compared per prompt) must be at least 1, got {n_tokens}")
    if parse_mode is not None and parse_mode not in PARSE_MODES:
        raise ValueError(f"unknown PARSE mode {parse_mode!r}; choose one of {', '.join(PARSE_MODES)}")
    path = Path(data_path)
    if not path.is_file():
        raise ValueError(f"evaluation text {path} does not exist or is not a file")
    text = path.read_text(encoding="utf-8", errors="replace")
    model, manifest = load_checkpoint(model_dir, "cpu", torch.float32)
    tok = Tokenizer.load(model_dir)
    routers = load_parse(model_dir, model)
    if routers is None and parse_mode is not None:
        raise ValueError(f"{model_dir} is not a PARSE checkpoint: it has no rank subsets to choose")
    mode = (parse_mode or "route") if routers is not None else None
    if prompt_len is None:  # a PARSE checkpoint's three modes score the same tokens
        prompt_len = PARSE_PROMPT_LEN if mode is not None else 0
    if mode == "route" and prompt_len < 1:
        raise ValueError("routing needs a prompt: the prompt length must be at least 1 (or score the static or "
                         "pool mode)")
    masks, before = parse_masks(model, routers, mode, prompt_len)
    out: dict[str, Any] = dict(model=str(model_dir), family=manifest.family, keep=manifest.keep,
                               method=manifest.provenance.get("method", manifest.family))
    if mode is not None:
        out.update(parse_mode=mode, method=f"{out['method']} ({mode})")
        if mode != "pool":  # what a request computes with: K components a matrix
            out["keep"] = manifest.methods["parse"]["keep_compute"]
    if prompt_len:
        out["prompt_len"] = prompt_len
    if reference_dir is None:
        out.update(perplexity(model, tok, text, seq_len, stride, max_tokens, progress=progress,
                              prompt_len=prompt_len, masks=masks))
        return out
    reference, ref_man = load_checkpoint(reference_dir, "cpu", torch.float32)
    out.update(reference_family=ref_man.family, reference_keep=ref_man.keep)  # normally "dense", 1.0
    if reference.cfg.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"{reference_dir} has a different vocabulary ({reference.cfg.vocab_size} tokens) "
                         f"than {model_dir} ({model.cfg.vocab_size}): not its reference")
    prompts = read_prompts(prompts_path or DEFAULT_PROMPTS)  # a bad prompt file fails before the long pass
    out.update(compare(model, reference, tok, text, seq_len, stride, max_tokens, progress=progress,
                       prompt_len=prompt_len, masks=masks))
    at = greedy_identity(model, reference, tok, prompts, n_tokens, prefixes=tuple(sorted({min(4, n_tokens), n_tokens})),
                         before=before)
    out["greedy_identity"] = at[n_tokens]
    out["greedy_identity_at"] = {str(n): v for n, v in at.items()}  # shorter prefixes separate near-misses
    out["greedy_prompts"], out["greedy_tokens"] = len(prompts), n_tokens
    return out


def parse_masks(model: Transformer, routers: Routers | None, mode: str | None, prompt_len: int):
    """(masks for a batch of windows, masks for a batch of prompts) of a PARSE mode; (None, None) to run the
    model with every component (a static model, or PARSE's "pool")."""
    if mode is None or mode == "pool":
        return None, None
    if mode == "static":
        static = routers.static_subset()
        return (lambda x: apply(model, [static] * x.shape[0]),
                lambda ids: apply(model, [static] * len(ids)))
    lens = lambda ids: torch.tensor([len(i) for i in ids])  # noqa: E731

    def prompts(ids: list[list[int]]) -> None:  # right-padded: each row routed on its own tokens
        x = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
        for b, i in enumerate(ids):
            x[b, :len(i)] = torch.tensor(i)
        apply(model, select_batch(model, routers, x, lens(ids)))

    return (lambda x: apply(model, select_batch(model, routers, x[:, :prompt_len]))), prompts


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
