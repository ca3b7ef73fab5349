"""Evaluation: held-out perplexity, agreement with a reference model, greedy identity.

    evaluate("out/s260k-svdllm-0.8", "wiki.test.raw", reference_dir="models/stories260K", seq_len=512)
    # {"perplexity": ..., "nll": ..., "tokens": ..., "top1_agreement": ..., "kl": ..., "reference_perplexity": ...}

Sliding windows (the HF recipe, shifted by one so no token is lost): the text is encoded once (BOS first);
window k reads the `seq_len` input tokens ending at e_k = min(seq_len + k·stride, N − 1) and scores only the
targets e_{k-1}+1 .. e_k, i.e. those the previous window did not score. Every token after the first is
scored exactly once; with stride = seq_len the windows do not overlap and each token's context is the
part of its own window before it; a smaller stride gives every scored token at least seq_len − stride of context.
Every window has the same length, so windows batch without padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.kv_cache import KVCache
from rankserve.workers.model import Transformer
from rankserve.workers.tokenizer import Tokenizer


Masks = Callable[[torch.Tensor], None]  # called with a batch of windows (B, S) before the model runs them (PARSE)


def perplexity(model: Transformer, tokenizer: Tokenizer, text: str,
               seq_len: int | None = None,  # window length; None = min(2048, the model's context)
               stride: int | None = None,  # new tokens scored per window; None = seq_len (no overlap)
               max_tokens: int | None = None,  # evaluate only the first max_tokens tokens of `text`
               batch_size: int = 8, progress: bool = False,
               prompt_len: int = 0,  # a window's first prompt_len tokens are its prompt: their targets not scored
               masks: Masks | None = None) -> dict[str, float | int]:
    """{"perplexity": exp(nll), "nll": mean negative log-likelihood (nats/token), "tokens": tokens scored}."""
    return _score([model], tokenizer, text, seq_len, stride, max_tokens, batch_size, progress, prompt_len, masks)


def compare(model: Transformer, reference: Transformer, tokenizer: Tokenizer, text: str,
            seq_len: int | None = None, stride: int | None = None, max_tokens: int | None = None,
            batch_size: int = 8, progress: bool = False, prompt_len: int = 0,
            masks: Masks | None = None,
            per_window: list[tuple[int, float, int]] | None = None,  # appended: (tokens, model's NLL sum, agreements)
            # of every scored window, in order (to pair two runs window by window)
            ) -> dict[str, float | int]:
    """`perplexity` of both models over the same windows, plus top-1 next-token agreement (the fraction of
    scored positions where both argmaxes match) and the mean KL(reference ‖ model) per position (nats).
    `masks` sets `model`'s PARSE masks per batch of windows; the reference runs as it is.

    Keys: perplexity, nll, tokens, top1_agreement, kl, reference_perplexity, reference_nll.
    """
    return _score([model, reference], tokenizer, text, seq_len, stride, max_tokens, batch_size, progress,
                  prompt_len, masks, per_window)


def evaluate(model_dir: str | Path, data_path: str | Path, reference_dir: str | Path | None = None,
             seq_len: int | None = None, stride: int | None = None, max_tokens: int | None = None,
             batch_size: int = 8, device: str = "cpu",
             dtype: torch.dtype = torch.float32,  # evaluation precision; fp32 on CPU
             progress: bool = True) -> dict[str, float | int]:
    """Perplexity of the checkpoint `model_dir` on the text file `data_path`; with `reference_dir`, also
    top1_agreement, kl (reference ‖ model) and reference_perplexity over the same windows."""
    path = Path(data_path)
    if not path.is_file():
        raise ValueError(f"evaluation text {path} does not exist or is not a file")
    text = path.read_text(encoding="utf-8", errors="replace")
    model, _ = load_checkpoint(model_dir, device, dtype)
    tokenizer = Tokenizer.load(model_dir)
    models = [model]
    if reference_dir is not None:
        reference, _ = load_checkpoint(reference_dir, device, dtype)
        if reference.cfg.vocab_size != model.cfg.vocab_size:
            raise ValueError(f"reference {reference_dir} has vocabulary {reference.cfg.vocab_size}, "
                             f"the model {model.cfg.vocab_size}; agreement needs the same tokenizer")
        models.append(reference)
    return _score(models, tokenizer, text, seq_len, stride, max_tokens, batch_size, progress)


def greedy_identity(model: Transformer, reference: Transformer, tokenizer: Tokenizer, prompts: list[str],
                    n_tokens: int = 32, prefixes: tuple[int, ...] = (),
                    before: Callable[[list[list[int]]], None] | None = None,  # called with the encoded prompts
                    # before `model` generates (PARSE: each prompt's masks)
                    ) -> float | dict[int, float]:
    """Fraction of prompts whose first `n_tokens` greedy tokens from `model` equal the reference's.

    Generation does not stop at EOS: exactly `n_tokens` tokens are compared per prompt. With `prefixes`, the
    fraction for each prefix length n <= n_tokens from the same generations: {n: fraction}.
    """
    if not prompts:
        raise ValueError("greedy_identity needs at least one prompt")
    ids = [tokenizer.encode(p, bos=True) for p in prompts]
    if before is not None:
        before(ids)
    ours, theirs = _greedy(model, ids, n_tokens), _greedy(reference, ids, n_tokens)
    if prefixes:
        return {n: sum(a[:n] == b[:n] for a, b in zip(ours, theirs)) / len(prompts) for n in prefixes}
    return sum(a == b for a, b in zip(ours, theirs)) / len(prompts)


# --- helpers -------------------------------------------------------------------------------------
def windows(n: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first) per window over n tokens: input ids[start:end], scored targets first+1 .. end.

    The predictions used are the logits at window positions (first − start) .. (end − start − 1).
    """
    if n < 2:
        raise ValueError(f"the text gives {n} token(s); perplexity needs at least 2")
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    out, prev, k = [], 0, 0
    while prev < n - 1:
        end = min(seq_len + k * stride, n - 1)
        out.append((max(0, end - seq_len), end, prev))
        prev, k = end, k + 1
    return out


def _score(models: list[Transformer], tokenizer: Tokenizer, text: str, seq_len: int | None, stride: int | None,
           max_tokens: int | None, batch_size: int, progress: bool, prompt_len: int = 0,
           masks: Masks | None = None, per_window: list | None = None) -> dict[str, float | int]:
    cfg = models[0].cfg
    seq_len = seq_len or min(2048, cfg.max_position_embeddings)
    stride = stride or seq_len
    if not 1 <= seq_len <= min(m.cfg.max_position_embeddings for m in models):
        raise ValueError(f"seq_len must be in [1, {cfg.max_position_embeddings}] (the model's context), got {seq_len}")
    if not 0 <= prompt_len < seq_len:
        raise ValueError(f"the prompt length ({prompt_len} tokens) must be >= 0 and shorter than the window "
                         f"({seq_len} tokens)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    ids = tokenizer.encode(text, bos=True)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    wins = windows(len(ids), seq_len, stride)
    data = torch.tensor(ids)
    dev = models[0].embed.weight.device
    nll = [0.0] * len(models)
    agree, kl, count = 0, 0.0, 0
    bar = tqdm(total=len(ids) - 1, unit="tok", desc="evaluate", disable=not progress)
    with torch.inference_mode():
        for b in range(0, len(wins), batch_size):
            batch = wins[b:b + batch_size]
            x = torch.stack([data[s:e] for s, e, _ in batch]).to(dev)  # (B, S), all windows equal length
            if masks is not None:
                masks(x)
            logits = [m(x.to(m.embed.weight.device)).to(dev) for m in models]  # (B, S, V) fp32 each
            for i, (s, e, f) in enumerate(batch):  # one window at a time bounds the (T, V) temporaries
                lo = max(f - s, prompt_len - 1)  # first prediction scored: past what earlier windows scored and
                if lo >= e - s:  # past the prompt (position prompt_len - 1 predicts its first new token)
                    continue
                y = data[s + lo + 1:e + 1].to(dev)  # (T,) targets
                lps = [F.log_softmax(l[i, lo:e - s], dim=-1) for l in logits]  # (T, V) fp32
                sums = [-lp.gather(1, y[:, None]).double().sum().item() for lp in lps]
                nll = [a + b for a, b in zip(nll, sums)]
                if len(models) == 2:
                    lp, ref = lps
                    agreed = int((lp.argmax(-1) == ref.argmax(-1)).sum())
                    agree += agreed
                    kl += (ref.exp() * (ref - lp)).sum(-1).double().sum().item()
                    if per_window is not None:
                        per_window.append((y.numel(), sums[0], agreed))
                count += y.numel()
                bar.update(y.numel())
    bar.close()
    if count == 0:
        raise ValueError(f"no token to score: every window of {seq_len} tokens is within its {prompt_len}-token prompt")
    mean = [v / count for v in nll]
    out: dict[str, float | int] = {"perplexity": math.exp(mean[0]), "nll": mean[0], "tokens": count}
    if len(models) == 2:
        out.update(top1_agreement=agree / count, kl=kl / count,
                   reference_perplexity=math.exp(mean[1]), reference_nll=mean[1])
    return out


def _greedy(model: Transformer, prompts: list[list[int]], n_tokens: int) -> list[list[int]]:
    """The first `n_tokens` greedy tokens after each prompt, all prompts in one right-padded batch."""
    cfg = model.cfg
    dev = model.embed.weight.device
    lens = [len(p) for p in prompts]
    S_max = max(lens) + n_tokens
    if S_max > cfg.max_position_embeddings:
        raise ValueError(f"longest prompt ({max(lens)} tokens) + {n_tokens} new tokens exceeds the context limit "
                         f"of {cfg.max_position_embeddings} tokens")
    B = len(prompts)
    cache = KVCache(cfg.num_hidden_layers, B, S_max, cfg.num_key_value_heads, cfg.head_dim, device=dev,
                    dtype=model.embed.weight.dtype)
    tokens = torch.zeros(B, max(lens), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :lens[b]] = torch.tensor(p)
    out = torch.empty(B, n_tokens, dtype=torch.long)
    with torch.inference_mode():
        logits = model(tokens.to(dev), cache, torch.tensor(lens, dtype=torch.int32, device=dev), last_only=True)  # (B, V)
        for t in range(n_tokens):
            nxt = logits.argmax(-1)  # (B,)
            out[:, t] = nxt.cpu()
            if t + 1 < n_tokens:
                logits = model(nxt[:, None], cache, last_only=True)  # (B, 1) -> (B, V)
    return out.tolist()
