"""Calibration statistics: the Gram matrix XᵀX of every projection's input, from a text file.

The file is streamed: read in chunks of lines, tokenized chunk by chunk, cut into windows of `seq_len`
tokens (the first starts with BOS), run through the model `batch_size` windows at a time. Forward hooks
on the projections add xᵀx (fp64) of their input. q/k/v read one input and gate/up read one input, so
each layer has four distinct inputs; `CalibStats.grams` names every projection, and the members of one
input share one tensor (the same object).

    stats = calibrate(model, tokenizer, "calib.txt", max_tokens=131072, seq_len=512)
    stats.grams["layers.0.attn.k"]  # (in, in) fp64, the same tensor as stats.grams["layers.0.attn.q"]

Chunk boundaries fall on line ends; SentencePiece adds its dummy-prefix space at each chunk's start,
which changes the tokenization of one position per chunk (1 MiB of text) — noise for statistics.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from rankserve.workers.model import Transformer, proj_name
from rankserve.workers.tokenizer import Tokenizer

# the projection whose input hook feeds each projection's Gram (q/k/v and gate/up read the same x)
INPUT_OF = {"q": "q", "k": "q", "v": "q", "o": "o", "gate": "gate", "up": "gate", "down": "down"}
CHUNK_CHARS = 1 << 20  # characters read and tokenized at a time


@dataclass
class CalibStats:
    grams: dict[str, torch.Tensor]  # projection name -> XᵀX (in, in) fp64 on CPU; members of one input share a tensor
    tokens: int  # token positions summed into every Gram
    seq_len: int  # window length the statistics were gathered with
    source: str = ""  # the calibration text's path


def calibrate(model: Transformer, tokenizer: Tokenizer, text_path: str | Path,
              max_tokens: int = 131072,  # stop after this many tokens (SVD-LLM uses 256 x 2048 on LLaMA-7B)
              seq_len: int | None = None,  # window length; None = min(2048, the model's context)
              batch_size: int = 8,  # windows per forward
              progress: bool = True) -> CalibStats:
    """Accumulate XᵀX of every projection input of `model` over the first `max_tokens` tokens of a text file.

    Raises ValueError when the file is missing, empty, or gives fewer tokens than the widest projection
    input (every Gram would then be singular: whitening needs at least `in` independent tokens).
    """
    cfg = model.cfg
    seq_len = seq_len or min(2048, cfg.max_position_embeddings)
    if not 1 <= seq_len <= cfg.max_position_embeddings:
        raise ValueError(f"seq_len must be in [1, {cfg.max_position_embeddings}] (the model's context), got {seq_len}")
    if max_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_tokens and batch_size must be positive, got {max_tokens} and {batch_size}")
    widest = max(cfg.hidden_size, cfg.q_dim, cfg.intermediate_size)
    if max_tokens < widest:
        raise ValueError(f"max_tokens={max_tokens} is below {widest}, the widest projection input; every Gram "
                         "would be singular — raise max_tokens (thousands of tokens at least)")
    path = Path(text_path)
    if not path.is_file():
        raise ValueError(f"calibration text {path} does not exist or is not a file")
    device = model.embed.weight.device
    grams: dict[str, torch.Tensor] = {}
    handles = []
    for i, blk in enumerate(model.layers):
        for p in ("q", "o", "gate", "down"):
            layer = getattr(blk.attn if p in ("q", "o") else blk.mlp, p)
            g = torch.zeros(layer.in_features, layer.in_features, dtype=torch.float64, device=device)
            for member, src in INPUT_OF.items():
                if src == p:
                    grams[proj_name(i, member)] = g
            handles.append(layer.register_forward_hook(_accumulate(g)))
    tokens = 0
    bar = tqdm(total=max_tokens, unit="tok", desc=f"calibrate {path.name}", disable=not progress)
    try:
        with torch.inference_mode():
            for batch in _batches(_windows(_token_stream(path, tokenizer), seq_len, max_tokens), batch_size):
                model(batch.to(device))  # (B, S) -> hooks add xᵀx; logits are discarded
                tokens += batch.numel()
                bar.update(batch.numel())
        if tokens < max_tokens:  # the text ran out first: say so rather than leave the bar short of its end
            bar.total = tokens
            bar.refresh()
            if progress and tokens:
                tqdm.write(f"calibration text {path.name} gives {tokens} tokens (of the {max_tokens} allowed)",
                           file=sys.stderr)  # stdout stays the command's own output
    finally:
        bar.close()
        for h in handles:
            h.remove()
    if tokens == 0:
        raise ValueError(f"calibration text {path} is empty (it gives no tokens); pass a text file with content")
    if tokens < widest:
        raise ValueError(f"calibration text {path} gives only {tokens} tokens; at least {widest} are needed "
                         f"(the widest projection input) and thousands are better — pass a longer text")
    on_cpu: dict[int, torch.Tensor] = {}  # move each distinct Gram once, keeping the members' aliasing
    for g in grams.values():
        if id(g) not in on_cpu:
            on_cpu[id(g)] = g.cpu()
    grams = {k: on_cpu[id(g)] for k, g in grams.items()}
    return CalibStats(grams=grams, tokens=tokens, seq_len=seq_len, source=str(path))


def _accumulate(g: torch.Tensor):
    def hook(module, inputs, output) -> None:
        x = inputs[0].reshape(-1, g.shape[0]).to(torch.float64)  # (B*S, in)
        g.addmm_(x.T, x)
    return hook


def _token_stream(path: Path, tokenizer: Tokenizer) -> Iterator[list[int]]:
    """Token ids of the file, one list per chunk of whole lines; BOS only at the very start."""
    first = True
    with path.open(encoding="utf-8", errors="replace") as f:
        rest = ""
        while True:
            block = f.read(CHUNK_CHARS)
            text = rest + block
            if block:  # cut at the last line end; the tail joins the next chunk
                cut = text.rfind("\n") + 1
                text, rest = (text[:cut], text[cut:]) if cut > 0 else (text, "")
            if text.strip():
                ids = tokenizer.encode(text, bos=first)
                first = False
                yield ids
            if not block:
                return


def _windows(chunks: Iterator[list[int]], seq_len: int, max_tokens: int) -> Iterator[list[int]]:
    """Consecutive windows of `seq_len` tokens, the last one shorter; `max_tokens` in all."""
    buf: list[int] = []
    left = max_tokens
    for ids in chunks:
        buf.extend(ids)
        while len(buf) >= seq_len and left >= seq_len:
            yield buf[:seq_len]
            buf, left = buf[seq_len:], left - seq_len
        if left < seq_len and len(buf) >= left:
            break
    tail = buf[:min(left, seq_len)]
    if tail:
        yield tail


def _batches(windows: Iterator[list[int]], batch_size: int) -> Iterator[torch.Tensor]:
    """(B, S) batches of equal-length windows; a shorter last window goes alone."""
    batch: list[list[int]] = []
    for w in windows:
        if batch and len(w) != len(batch[0]):
            yield torch.tensor(batch)
            batch = []
        batch.append(w)
        if len(batch) == batch_size:
            yield torch.tensor(batch)
            batch = []
    if batch:
        yield torch.tensor(batch)
