"""Next-token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept; 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = nondeterministic
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first one
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits (V,) -> one token id. Sampling runs on the CPU so a seed gives the same tokens on any device."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    x = logits.detach().float().cpu() / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p  # keep the smallest prefix reaching top_p
        x = x.scatter(0, idx, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
