"""Next-token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


MIN_TEMPERATURE = 1e-5  # below it logits / T overflow towards inf for no purpose: such requests mean greedy (0)
MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's chat limit)
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # int64, as the HTTP and gRPC seed: one generator state per seed


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept; 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = nondeterministic
    stop: tuple[str, ...] = ()  # stop strings (or one string); the text is cut before the first one
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n = each token's log-probability and the n most likely at its step

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)  # not one stop per character
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or finite and >= {MIN_TEMPERATURE:g}, "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (int64), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()  # a nondeterministic seed for this generator only; torch's global RNG is left alone
        else:
            g.manual_seed(self.seed)
        return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits (V,) -> one token id. Sampling runs on the CPU so a seed gives the same tokens on any device."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    x = logits.detach().float().cpu() / params.temperature
    # stable sorts: among tied logits the lowest id ranks first, as argmax picks it, so top_k=1 or a tiny top_p
    # is greedy even where bf16 logits tie
    if params.top_k > 0 and params.top_k < x.numel():
        keep = torch.sort(x, descending=True, stable=True).indices[:params.top_k]
        x = torch.full_like(x, float("-inf")).scatter(0, keep, x[keep])
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p  # keep the smallest prefix reaching top_p
        x = x.scatter(0, idx, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
