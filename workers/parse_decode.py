"""PARSE on the thin decode path: rank subsets as input buffers of the captured step (no recapture).

A PARSE checkpoint stores r_max components per routed matrix; a request uses K of them. For a batch of B
requests, `ParseSlots` keeps one static "slot" model whose routed factors have a fixed width
W = min(r_max, B * K) per matrix, and the FastDecoder (and its CUDA graphs) is built once over it:

    slots = ParseSlots(pool_model, routers, DecodeConfig(batch_size=B, ...))
    slots.load(subsets)          # per batch: gather the union of the B subsets into the slots (one pass
                                 # over the pool's factors), write each row's keep mask, re-pack
    logits = slots.decoder.prefill(tokens, lengths)   # eager prefill over the slot model, masks applied
    logits = slots.decoder.step(tokens)               # graph replay; the slots are what the graph reads

- B = 1: W = K and the slot holds exactly the request's components in pool order: every decode step and the
  prefill read and compute the same bytes as the static rank-K model (no mask).
- B > 1: the slot holds the union of the rows' subsets (components selected by several rows, e.g. the
  aggregated shared head, are stored once) and a (B, W) 0/1 keep mask per matrix zeroes, in the V-stage
  epilogue, the components a row does not use, so each row computes exactly U[:, S_b] V[S_b, :] x. The GEMVs
  read the full slot width W (fixed at capture), so a batch reads up to min(r_max, B K) / K times the static
  bytes; unused slot columns beyond the union are padding that every row masks out.
The gather cost (index_select of the union's V rows and U columns, then re-packing) is paid once per batch
admission and reused for every decode step (rank reuse); `bench/parse_speed.py` measures it.
"""

from __future__ import annotations

import torch
from torch import nn

from rankserve.workers.align import padded
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder, _Layer
from rankserve.workers.model import ATTN_PROJS, PROJS, Transformer, proj_name
from rankserve.workers.parse import Routers


def slot_widths(routers: Routers, batch_size: int, align: int = 1) -> dict[str, int]:
    """Slot width per routed projection: min(r_max, B K), rounded up to a multiple of `align` (zero padding)."""
    return {n: padded(min(routers.r_max[n], batch_size * k), align) for n, k in routers.k.items()}


def _slot_model(pool: Transformer, widths: dict[str, int]) -> Transformer:
    """A Transformer sharing the pool's embeddings, norms, head and unrouted projections, with fresh (W)-wide
    factors for the routed ones (no shared bases: each member gathers its own rows)."""
    dev, dt = pool.embed.weight.device, pool.embed.weight.dtype
    m = Transformer(pool.cfg, dict(widths), device="meta", dtype=dt)
    m.embed, m.norm, m.lm_head = pool.embed, pool.norm, pool.lm_head
    m.rope_cos, m.rope_sin = pool.rope_cos, pool.rope_sin
    plins = pool.projections()
    for i, (blk, pblk) in enumerate(zip(m.layers, pool.layers)):
        blk.attn_norm, blk.mlp_norm = pblk.attn_norm, pblk.mlp_norm
        for p in PROJS:
            n = proj_name(i, p)
            parent = blk.attn if p in ATTN_PROJS else blk.mlp
            if n not in widths:
                setattr(parent, p, plins[n])  # not routed: the pool's own module
                continue
            lin, W = getattr(parent, p), widths[n]
            lin.U = nn.Parameter(torch.zeros(lin.out_features, W, device=dev, dtype=dt), requires_grad=False)
            lin.V = nn.Parameter(torch.zeros(W, lin.in_features, device=dev, dtype=dt), requires_grad=False)
    return m.eval()


class ParseSlots:
    """Static rank slots + keep masks for B requests with (possibly) different PARSE subsets; see the module doc."""

    def __init__(self, pool: Transformer, routers: Routers, dcfg: DecodeConfig, align: int = 1) -> None:
        B = dcfg.batch_size
        self.pool, self.routers, self.B = pool, routers, B
        self.widths = slot_widths(routers, B, align)  # align 8 on the GPU: 16-byte rows (workers/align.py)
        self.model = _slot_model(pool, self.widths)
        dev, dt = pool.embed.weight.device, pool.embed.weight.dtype
        self.layers = [_Layer(blk, pool.cfg, fold=dcfg.fused()) for blk in self.model.layers]
        self.keep: dict[str, torch.Tensor] = {}  # proj name -> (B, W) view into a packed keep buffer
        self.masked = B > 1  # B = 1: the slot is exactly the subset, nothing to mask
        if self.masked:
            for i, L in enumerate(self.layers):
                for attr, names in (("keep_qkv", ("q", "k", "v")), ("keep_gu", ("gate", "up")),
                                    ("keep_o", ("o",)), ("keep_down", ("down",))):
                    lins = [L.proj[p] for p in names]
                    if not all(l.factorized for l in lins):
                        continue
                    buf = torch.ones(B, sum(l.rank for l in lins), device=dev, dtype=dt)  # (B, sum W)
                    setattr(L, attr, buf)
                    for p, view in zip(names, buf.split([l.rank for l in lins], dim=1)):
                        if proj_name(i, p) in self.widths:
                            self.keep[proj_name(i, p)] = view
        self.decoder = FastDecoder(self.model, dcfg, packed=self.layers)
        self._plins, self._slins = pool.projections(), self.model.projections()
        self._loaded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # what each slot holds: (idx, keep) on host
        self.last_changed = 0  # matrices the last load() gathered (0: the slots already held the batch's subsets)

    @torch.no_grad()
    def load(self, subsets: list[dict]) -> dict[str, int]:
        """Gather the batch's subsets (validated, one per row) into the slots; -> union size per projection.

        Rows beyond len(subsets) (a partly filled batch) reuse the last subset. No recapture: the decoder's
        graphs keep reading the same buffers. Index work happens on the host and travels in one copy; matrices
        whose gathered components are already in the slot (a repeated prompt, a cache hit on the same subset)
        are not gathered again.
        """
        if not 1 <= len(subsets) <= self.B:
            raise ValueError(f"expected 1..{self.B} subsets, got {len(subsets)}")
        rows = list(subsets) + [subsets[-1]] * (self.B - len(subsets))
        dev = self.pool.embed.weight.device
        sizes, idxs, keeps, changed = {}, [], [], []
        for n, W in self.widths.items():
            picks = [torch.as_tensor(s["k"][n]) for s in rows]  # (K,) each
            union = torch.unique(torch.cat(picks))  # sorted
            sizes[n] = len(union)
            if len(union) > W:  # cannot happen for validated subsets: |union| <= min(r_max, B K)
                raise ValueError(f"{n}: union of {len(union)} components exceeds the slot width {W}")
            if not self.masked and len(union) != self.routers.k[n]:  # B = 1 and not exactly K components
                raise ValueError(f"{n}: subset of {len(union)} components, expected {self.routers.k[n]}")
            idx = torch.cat([union, union[:1].expand(W - len(union))])  # padding: masked out below
            keep = torch.zeros(self.B, W)
            if self.masked:
                for b, pk in enumerate(picks):
                    keep[b, torch.searchsorted(union, pk)] = 1
            old = self._loaded.get(n)
            if old is None or not (torch.equal(old[0], idx) and torch.equal(old[1], keep)):
                changed.append(n)
                idxs.append(idx)
                keeps.append(keep.flatten())
                self._loaded[n] = (idx, keep)
        if changed:
            idx_dev = torch.cat(idxs).to(dev, non_blocking=True).split([self.widths[n] for n in changed])
            keep_dev = (torch.cat(keeps).to(dev, self.pool.embed.weight.dtype, non_blocking=True)
                        .split([self.B * self.widths[n] for n in changed]))
            for n, idx, keep in zip(changed, idx_dev, keep_dev):
                src, dst = self._plins[n], self._slins[n]
                torch.index_select(src.V, 0, idx, out=dst.V.data)  # (W, in): rows of V
                torch.index_select(src.U, 1, idx, out=dst.U.data)  # (out, W): columns of U
                if not self.masked and sizes[n] < self.widths[n]:  # alignment padding: zero components
                    dst.V.data[sizes[n]:] = 0
                    dst.U.data[:, sizes[n]:] = 0
                if self.masked:
                    self.keep[n].copy_(keep.view(self.B, -1))
            for L in self.layers:
                L.refresh()
        for n, lin in self._slins.items():  # the eager prefill masks through FactorizedLinear.mask
            if n in self.widths:
                lin.mask = self.keep[n] if self.masked else None
        self.last_changed = len(changed)
        return sizes
