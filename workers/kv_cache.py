"""Dense KV cache, preallocated at its maximum size: `[B, S_max, H_kv, D]` per layer (flash-attn layout).

K is stored after RoPE. `seqlens[b]` (int32, on the device) counts the tokens already cached for row b;
the model advances it in place, so a decode step needs no host-side bookkeeping.
One extra slot at the end of the sequence axis takes the writes of padding tokens, which are discarded.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 device=None, dtype=torch.float32) -> None:
        self.max_seq_len = max_seq_len
        shape = (num_layers, batch_size, max_seq_len + 1, num_kv_heads, head_dim)  # +1: scratch slot for padding
        self._k = torch.zeros(shape, device=device, dtype=dtype)
        self._v = torch.zeros(shape, device=device, dtype=dtype)
        self.k = self._k[:, :, :max_seq_len]  # (L, B, S_max, H_kv, D) views without the scratch slot
        self.v = self._v[:, :, :max_seq_len]
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)

    @property
    def batch_size(self) -> int:
        return self.seqlens.shape[0]

    def rows(self, a: int, b: int) -> "KVCache":
        """Rows a..b-1 as a cache of their own, sharing this one's storage (a prefill of joining rows)."""
        view = KVCache.__new__(KVCache)
        view.max_seq_len = self.max_seq_len
        view._k, view._v = self._k[:, a:b], self._v[:, a:b]  # (L, b - a, S_max + 1, H_kv, D)
        view.k, view.v = self.k[:, a:b], self.v[:, a:b]
        view.seqlens = self.seqlens[a:b]
        return view

    def reset(self) -> None:
        self.seqlens.zero_()

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              valid: torch.Tensor | None = None) -> None:
        """Store k, v (B, S, H_kv, D) at positions pos (B, S); rows' padding (valid False) goes to the scratch slot."""
        if valid is not None:
            pos = torch.where(valid, pos, self.max_seq_len)
        b = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)
        self._k[layer][b, pos] = k.to(self._k.dtype)
        self._v[layer][b, pos] = v.to(self._v.dtype)

    def nbytes(self) -> int:
        """Bytes of the keys and values held (every position, the scratch slot included)."""
        return 2 * self._k.numel() * self._k.element_size()

    def nbytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        L, _, _, H, D = self._k.shape
        return 2 * L * H * D * self._k.element_size()
