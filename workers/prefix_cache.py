"""Prompt prefixes' K/V kept across requests, so a prompt that starts like an earlier one (a chat's system prompt and
history, a shared few-shot preamble) prefills only what differs.

Entries are copies of prompts' K/V, `block`-aligned, least recently used dropped first once `max_bytes` is reached.
A lookup takes the longest common prefix of the new prompt with any entry, rounded down to the block and leaving
at least one token to run (its logits start the reply). K/V of positions < p depend only on tokens < p (causal),
so the reuse is exact up to floating-point order. Static models only: a PARSE row's K/V depend on its rank subset.

    cache = PrefixCache(max_bytes=2**30)
    p, k, v = cache.match(ids)            # p = 0: no hit; else k, v (L, p, H_kv, D) for ids[:p]
    cache.store(ids, k_row, v_row)        # after a prefill: k_row, v_row (L, len(ids), H_kv, D)
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class PrefixCache:
    def __init__(self, max_bytes: int, block: int = 64) -> None:
        if max_bytes < 0 or block < 1:
            raise ValueError(f"max_bytes must be >= 0 and block >= 1, got {max_bytes}, {block}")
        self.max_bytes, self.block = max_bytes, block
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()  # LRU first
        self.bytes = 0
        self.hits = self.misses = 0
        self.hit_tokens = 0  # prompt tokens taken from entries instead of prefilled

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, ids: list[int]) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """-> (p, k, v): the longest block-aligned prefix of `ids` (at most len(ids) - 1 tokens) held, as views
        (L, p, H_kv, D); (0, None, None) when none is at least one block."""
        best, hit, want, b = 0, None, tuple(ids), self.block
        for key in self._entries:
            n, p = min(len(key), len(want) - 1), 0
            while p + b <= n and key[p:p + b] == want[p:p + b]:  # block by block (tuple compares run in C)
                p += b
            if p > best:
                best, hit = p, key
        if hit is None:
            self.misses += 1
            return 0, None, None
        self._entries.move_to_end(hit)
        self.hits += 1
        self.hit_tokens += best
        k, v = self._entries[hit]
        return best, k[:, :best], v[:, :best]

    def store(self, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the block-aligned prefix of a prompt whose K/V are k, v (L, >= its length, H_kv, D), unless an entry
        already holds it; drops the least recently used entries to fit."""
        n = len(ids) - len(ids) % self.block
        if n == 0:
            return
        key = tuple(ids[:n])
        for other in self._entries:
            if other[:n] == key:  # held already (as it is, or inside a longer entry)
                self._entries.move_to_end(other)
                return
        size = 2 * k[:, :n].numel() * k.element_size()
        if size > self.max_bytes:
            return
        for other in [o for o in self._entries if key[:len(o)] == o]:  # entries this one extends: now redundant
            self._drop(other)
        while self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = (k[:, :n].clone(), v[:, :n].clone())
        self.bytes += size

    def _drop(self, key: tuple[int, ...]) -> None:
        k, v = self._entries.pop(key)
        self.bytes -= k.numel() * k.element_size() + v.numel() * v.element_size()
