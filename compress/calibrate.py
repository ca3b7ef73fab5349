"""Calibration statistics: the Gram matrix XᵀX of every projection's input, from a text file.

The file is streamed: read in chunks of lines, tokenized chunk by chunk, cut into windows of `seq_len`
tokens (the first starts with BOS), and run through the model one decoder layer at a time over all windows
(`batch_size` windows a forward), their hidden states kept between layers: a GPU then needs one layer, its
Grams and the hidden states, never the whole model (`layer_grams`). Forward hooks on the projections add xᵀx
(fp64) of their input. q/k/v read one input and gate/up read one input, so
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

from rankserve.workers.model import CAUSAL, Transformer, proj_name
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
              progress: bool = True,
              device: str | torch.device | None = None,  # where the layers run; None = the model's device
              ) -> CalibStats:
    """Accumulate XᵀX of every projection input of `model` over the first `max_tokens` tokens of a text file.

    The model runs one decoder layer at a time over every window (`layer_grams`): with the model on the CPU and
    `device` a GPU, the GPU holds one layer, its Grams and the windows' hidden states, not the whole model.

    Raises ValueError when the file is missing, empty, or gives fewer tokens than the widest projection
    input (every Gram would then be singular: whitening needs at least `in` independent tokens).
    """
    batches, seq_len = calibration_batches(model, tokenizer, text_path, max_tokens, seq_len, batch_size, progress)
    grams: dict[str, torch.Tensor] = {}
    for layer in layer_grams(model, batches, device, progress, desc=f"calibrate {Path(text_path).name}"):
        grams.update(layer)
    return CalibStats(grams=grams, tokens=sum(b.numel() for b in batches), seq_len=seq_len, source=str(text_path))


def calibration_batches(model: Transformer, tokenizer: Tokenizer, text_path: str | Path, max_tokens: int,
                        seq_len: int | None, batch_size: int, progress: bool = True) -> tuple[list[torch.Tensor], int]:
    """The calibration windows as (B, S) token batches (on the CPU), and the window length; every check of
    `calibrate`'s arguments and text happens here, before any layer runs."""
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
    batches = list(_batches(_windows(_token_stream(path, tokenizer), seq_len, max_tokens), batch_size))
    tokens = sum(b.numel() for b in batches)
    if tokens == 0:
        raise ValueError(f"calibration text {path} is empty (it gives no tokens); pass a text file with content")
    if tokens < widest:
        raise ValueError(f"calibration text {path} gives only {tokens} tokens; at least {widest} are needed "
                         f"(the widest projection input) and thousands are better — pass a longer text")
    if tokens < max_tokens and progress:  # the text ran out first: say so
        tqdm.write(f"calibration text {path.name} gives {tokens} tokens (of the {max_tokens} allowed)",
                   file=sys.stderr)  # stdout stays the command's own output
    return batches, seq_len


@torch.inference_mode()
def layer_grams(model: Transformer, batches: list[torch.Tensor], device: str | torch.device | None = None,
                progress: bool = True, desc: str = "calibrate",
                dtype: torch.dtype | None = None,  # what each layer and the hidden states run in; None = the model's
                ) -> Iterator[dict[str, torch.Tensor]]:
    """Layer by layer, {projection name: XᵀX (in, in) fp64 on the CPU} of that layer's seven projections (the
    members of one input share one tensor), from running every batch through the layers in turn.

    The windows' hidden states (tokens x hidden) stay on `device` between layers (in the model's memory instead,
    a batch at a time visiting the device, when they would take more than a quarter of a GPU's free memory); each
    decoder layer is moved there for its pass and back after it, so the device never holds more than one layer's
    weights and Grams. With `dtype` (say fp32 for a bf16 model) each layer runs as a cast copy: the passes are
    those of a model cast whole, while the host keeps the model in its own dtype. A layer's parameters get their
    own storage back after its pass (nothing is copied back), so the model is never held twice.
    Every window starts at position 0 with no padding: the same attention as the model's own forward.
    """
    home, stored = model.embed.weight.device, model.embed.weight.dtype
    dev = torch.device(device) if device is not None else home
    run = dtype or stored
    keep_on = dev  # where the hidden states wait between layers
    if dev.type == "cuda" and dev != home:
        need = sum(b.numel() for b in batches) * model.cfg.hidden_size * run.itemsize
        if need > torch.cuda.mem_get_info(dev)[0] // 4:  # many calibration tokens: they wait in host memory
            keep_on = home
    hidden = [model.embed(b.to(home)).to(keep_on, run) for b in batches]  # [(B, S, hidden)] in `run`
    ropes = {}
    for b in batches:  # (S, D) tables per distinct window length
        S = b.shape[1]
        if S not in ropes:
            ropes[S] = (model.rope_cos[:S].to(dev), model.rope_sin[:S].to(dev))
    bar = tqdm(total=len(model.layers), unit="layer", desc=desc, disable=not progress)
    try:
        for i, blk in enumerate(model.layers):
            moved = dev != home or run != stored
            if moved:  # the layer runs as a copy on `dev` in `run`; its own storage stays where it is, untouched
                kept = [(p, p.data) for p in blk.parameters()]  # (a Block holds no buffers)
                blk.to(dev, run)
            grams: dict[str, torch.Tensor] = {}
            handles = []
            for p in ("q", "o", "gate", "down"):
                layer = getattr(blk.attn if p in ("q", "o") else blk.mlp, p)
                grams[p] = torch.zeros(layer.in_features, layer.in_features, dtype=torch.float64, device=dev)
                handles.append(layer.register_forward_hook(_accumulate(grams[p])))
            try:
                for j, x in enumerate(hidden):  # x (B, S, hidden) -> the layer's output
                    B, S = x.shape[:2]
                    pos = torch.arange(S, device=dev)[None].expand(B, S)
                    cos, sin = (t[None].expand(B, S, -1) for t in ropes[S])  # (B, S, D)
                    valid = torch.ones(B, S, dtype=torch.bool, device=dev)
                    out = blk(x.to(dev), cos, sin, i, None, pos, valid, CAUSAL)
                    if i + 1 < len(model.layers):  # the last layer's output is not needed
                        hidden[j] = out.to(keep_on)
            finally:
                for h in handles:
                    h.remove()
                if moved:
                    for p, data in kept:
                        p.data = data
            on_cpu = {p: g.cpu() for p, g in grams.items()}
            del grams
            bar.update(1)
            yield {proj_name(i, member): on_cpu[src] for member, src in INPUT_OF.items()}
    finally:
        bar.close()


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
