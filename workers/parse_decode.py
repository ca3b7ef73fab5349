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
- B > 1: the slot holds the union of the rows' subsets first (components selected by several rows, e.g. the
  aggregated shared head, are stored once) and a (B, W) 0/1 keep mask per matrix zeroes, in the V-stage
  epilogue, the components a row does not use, so each row computes exactly U[:, S_b] V[S_b, :] x. The slot
  width W = min(r_max, B K) is fixed at capture, but the union's size is a device-side "live" width per matrix
  (`_Layer.live`, int32): the V-stage skips blocks of rows no row keeps and the U-stage reads only the first
  `live` components, so a batch reads |union| / K times the static bytes, not W / K. Real routed subsets overlap
  heavily (measured on the reference model: a batch of 8 WikiText-2 prompts has a union of 1.04-1.20 K on
  average, the aggregated head being shared); random subsets are the worst case (~2 K). The eager prefill reads
  the same live prefix (`FactorizedLinear.live`).
The gather cost (index_select of the union's V rows and U columns, then re-packing) is paid once per batch
admission and reused for every decode step (rank reuse); `bench/parse_speed.py` measures it.

A request joining a running batch (continuous batching) is one load with that row's subset changed: the other
rows' subsets are not converted again, the keep bits are written on the device, and `prefill(ids, cache, slot)`
runs its prompt through `prefills` (one-row CUDA graphs over the slot model, set by the engine) with the slot
model's masks pointed at that row's keep bits and each routed matrix read up to PREFILL_CAP K. What a join costs,
before and after: bench/results/parse-joins-h200.md.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch
from torch import nn

from rankserve.workers.align import padded
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder, _Layer, auto_one_launch
from rankserve.workers.host import upload, upload_into
from rankserve.workers.model import ATTN_PROJS, PROJS, Transformer, proj_name
from rankserve.workers.parse import Routers
from rankserve.workers.parse_batching import bases, subset_ids
from rankserve.workers.prefill_graph import PrefillGraphs


LIVE_ALIGN = 16  # the kernels read live widths in groups of 16 components (kernels/lowrank_linear.py gemv)
# a joining row's one-row prefill graph (ParseSlots.prefill) reads each routed matrix up to this many times K: a
# batch whose union is wider somewhere prefills eagerly (routed subsets of 8 prompts: unions of 1.04-1.20 K)
PREFILL_CAP = 1.25


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
        # align GPU_ALIGN on the GPU (workers/align.py); B > 1: at least LIVE_ALIGN (the live widths' granularity)
        self.widths = slot_widths(routers, B, align if B == 1 else max(align, LIVE_ALIGN))
        self.model = _slot_model(pool, self.widths)
        dcfg = auto_one_launch(dcfg, self.model)  # before packing: the one-launch steps fold the norms
        dev, dt = pool.embed.weight.device, pool.embed.weight.dtype
        self.layers = [_Layer(blk, pool.cfg, fold=dcfg.fused()) for blk in self.model.layers]
        self.masked = B > 1  # B = 1: the slot is exactly the subset, nothing to mask
        self.names = list(routers.k)  # routed projections, in membership()'s order (= self.widths')
        self._where = {proj_name(i, p): (i, PROJS.index(p)) for i in range(len(self.layers)) for p in PROJS}
        # host-side index plan (numpy, built once): component i of matrix m has the global id gbase[m] + i
        # (workers/parse_batching.py membership: the same order, routers.k's)
        base = bases(routers)
        self._k = np.array([routers.k[n] for n in self.names], dtype=np.int64)
        self._W = np.array([self.widths[n] for n in self.names], dtype=np.int64)
        self._gbase = base[:-1]
        self._mat_of_gid = np.repeat(np.arange(len(self.names)), base[1:] - base[:-1])  # (G,)
        self._sbase = np.concatenate([[0], np.cumsum(self._W)[:-1]])  # slot offset of each matrix in (sum W,)
        self._idx: np.ndarray | None = None  # what the slots hold: (sum W,) pool indices
        self._ids: dict[int, tuple[dict, np.ndarray]] = {}  # id(subset) -> (subset, subset_ids): the batch's rows
        self._member = np.zeros((self.B, int(base[-1])), dtype=bool)  # (B, G): each row's components
        self._member_ids: list[np.ndarray | None] = [None] * self.B  # the subset_ids each row of _member holds
        self._live_at = np.array([self._where[n][0] * len(PROJS) + self._where[n][1] for n in self.names])
        # B > 1: one (B, cols) keep buffer on the device for every layer's packed groups (the kernels take a row
        # stride), so a load is one copy; unrouted members of a group keep every component (ones)
        self.keep: dict[str, torch.Tensor] = {}  # proj name -> (B, W) view
        self.live = torch.full((len(self.layers), len(PROJS)), 2 ** 30, dtype=torch.int32)  # PROJS order
        self.live_dev = self.live.to(dev) if self.masked else None
        if self.masked:
            groups = (("keep_qkv", ("q", "k", "v")), ("keep_gu", ("gate", "up")), ("keep_o", ("o",)),
                      ("keep_down", ("down",)))
            spans, col = [], 0
            for i, L in enumerate(self.layers):
                L.live = self.live_dev[i]  # (7,) view: the kernels read it on every replay
                for attr, names in groups:
                    lins = [L.proj[p] for p in names]
                    if all(l.factorized for l in lins):
                        spans.append((i, attr, names, col))
                        col += sum(l.rank for l in lins)
                    else:  # a mixed group is not packed (fast_decode._proj_torch): a routed member masks alone
                        for p in names:
                            if proj_name(i, p) in self.widths:
                                spans.append((i, None, (p,), col))
                                col += L.proj[p].rank
            self.keep_all = torch.ones(B, col, device=dev, dtype=dt)  # (B, cols)
            # one row's keep bits, what the one-row prefill graphs read (prefill); per projection, views like keep's
            self.row_keep = torch.ones(1, col, device=dev, dtype=dt)
            self._row_mask: dict[str, torch.Tensor] = {}
            slot_col = np.zeros(int(self._W.sum()), dtype=np.int64)  # slot position -> keep column
            for i, attr, names, c0 in spans:
                L = self.layers[i]
                width = sum(L.proj[p].rank for p in names)
                if attr is None:
                    L.keep_proj[names[0]] = self.keep_all[:, c0:c0 + width]
                else:
                    setattr(L, attr, self.keep_all[:, c0:c0 + width])
                    # the split-K plan sizes the V stages by the union's expected size (~K), not the slot width
                    L.rows_in_use[attr[len("keep_"):]] = sum(routers.k.get(proj_name(i, p), L.proj[p].rank)
                                                             for p in names)
                for p in names:
                    n, r = proj_name(i, p), L.proj[p].rank
                    if n in self.widths:
                        self.keep[n] = self.keep_all[:, c0:c0 + r]
                        self._row_mask[n] = self.row_keep[:, c0:c0 + r]
                        m = self.names.index(n)
                        slot_col[self._sbase[m]:self._sbase[m] + r] = np.arange(c0, c0 + r)
                    c0 += r
            self._slot_col = slot_col
            self._routed_cols = torch.from_numpy(slot_col).to(dev)  # every routed slot's keep column
        self._live = self._W.copy()  # (M,) live widths as the last load set them (host)
        self._cap = np.minimum(padded(np.ceil(PREFILL_CAP * self._k).astype(np.int64), LIVE_ALIGN), self._W)  # (M,)
        self.prefills: PrefillGraphs | None = None  # one-row prefills over self.model, set by the owner (prefill)
        # B = 1: no masks or live widths (the slot is the subset), so the one-launch step runs it (fixed buffers,
        # refilled in place); B > 1: kernels/step_rows.py masked, where auto_one_launch turns it on (Hopper)
        self.decoder = FastDecoder(self.model, dcfg, packed=self.layers)
        self._plins, self._slins = pool.projections(), self.model.projections()
        self.last_changed = 0  # matrices the last load() gathered (0: the slots already held the batch's subsets)

    def _subset_ids(self, rows: list[dict]) -> list[np.ndarray]:
        """Each row's subset_ids(), converted (and checked) once per subset object: a row that stays in the batch
        costs nothing at the next load, a joining one ~8 ms at the 7B shape (its Python lists)."""
        out, kept = [], {}
        for s in rows:
            hit = self._ids.get(id(s))
            if hit is None or hit[0] is not s:
                hit = (s, subset_ids(s, self.routers))
            kept[id(s)] = hit  # holds s, so its id is not reused while cached
            out.append(hit[1])
        self._ids = kept
        return out

    @torch.no_grad()
    def load(self, subsets: list[dict]) -> dict[str, int]:
        """Gather the batch's subsets (validated, one per row) into the slots; -> union size per projection.

        Rows beyond len(subsets) (a partly filled batch) reuse the last subset. No recapture: the decoder's
        graphs keep reading the same buffers. The host work is vectorized over all matrices, each subset's lists
        are converted once while it stays in the batch (known by identity: a subset is not changed in place; a
        re-routed row gets a new one), and the index plan and keep bits travel in one copy each;
        matrices whose slot already holds the union's components in place (a repeated prompt, a cache hit on
        the same subset) are not gathered again. The keep masks are written on the device.
        """
        if not 1 <= len(subsets) <= self.B:
            raise ValueError(f"expected 1..{self.B} subsets, got {len(subsets)}")
        rows = list(subsets) + [subsets[-1]] * (self.B - len(subsets))
        dev = self.pool.embed.weight.device
        member = self._member  # (B, G): only the rows whose subset changed are rewritten
        for j, g in enumerate(self._subset_ids(rows)):
            if self._member_ids[j] is not g:
                member[j] = False
                member[j, g] = True
                self._member_ids[j] = g
        ugid = np.flatnonzero(member.any(0))  # the union, sorted (matrix by matrix, then component)
        umat = self._mat_of_gid[ugid]
        size = np.bincount(umat, minlength=len(self.names))  # (M,)
        if (size > self._W).any():  # cannot happen for well-formed subsets: |union| <= min(r_max, B K)
            m = int(np.flatnonzero(size > self._W)[0])
            raise ValueError(f"{self.names[m]}: union of {size[m]} components exceeds the slot width {self._W[m]}")
        if not self.masked and (dup := np.flatnonzero(size != self._k)).size:  # B = 1: repeated indices
            m = int(dup[0])
            raise ValueError(f"{self.names[m]}: subset of {size[m]} distinct components, expected {self._k[m]}")
        ustart = np.concatenate([[0], np.cumsum(size)[:-1]])
        pos = self._sbase[umat] + np.arange(len(ugid)) - ustart[umat]  # slot position of each union component
        local = ugid - self._gbase[umat]
        idx = np.repeat(local[ustart], self._W)  # padding repeats the matrix's first component, masked out
        idx[pos] = local
        changed = (np.ones(len(self.names), dtype=bool) if self._idx is None
                   else np.logical_or.reduceat(idx != self._idx, self._sbase))
        self._idx = None  # set again once the gathers are done: a load that fails midway gathers everything next
        sizes = {n: int(c) for n, c in zip(self.names, size)}
        if self.masked:  # queued before the gathers: an upload waits for nothing queued ahead of it
            cols = upload(torch.from_numpy(self._slot_col[pos]), dev)  # (|U|,)
            bits = upload(torch.from_numpy(member[:, ugid]), dev)  # (B, |U|) bool
            # live widths: the union rounded up to LIVE_ALIGN, as the kernels read (the padding is masked out)
            live = np.minimum(padded(size, LIVE_ALIGN), self._W)  # (M,)
            self.live.view(-1)[torch.from_numpy(self._live_at)] = torch.from_numpy(live.astype(np.int32))
            self._live = live
            upload_into(self.live_dev, self.live)
            self.keep_all.index_fill_(1, self._routed_cols, 0)  # every routed column off, the union's rows on
            self.keep_all.index_copy_(1, cols, bits.to(self.keep_all.dtype))
        if changed.any():
            idx_dev = upload(torch.from_numpy(idx), dev)
            for m in np.flatnonzero(changed):
                n, W, s0 = self.names[m], int(self._W[m]), int(self._sbase[m])
                src, dst = self._plins[n], self._slins[n]
                torch.index_select(src.V, 0, idx_dev[s0:s0 + W], out=dst.V.data)  # (W, in): rows of V
                torch.index_select(src.U, 1, idx_dev[s0:s0 + W], out=dst.U.data)  # (out, W): columns of U
                if not self.masked and sizes[n] < W:  # alignment padding: zero components
                    dst.V.data[sizes[n]:] = 0
                    dst.U.data[:, sizes[n]:] = 0
            for i in sorted({self._where[self.names[m]][0] for m in np.flatnonzero(changed)}):
                self.layers[i].refresh()  # re-pack only the layers whose factors changed
        self._idx = idx
        if self.masked:  # the eager prefill masks through FactorizedLinear.mask and reads its live prefix
            for m, n in enumerate(self.names):  # (module attribute writes are slow: only what changed)
                lin = self._slins[n]
                if lin.mask is not self.keep[n]:
                    lin.mask = self.keep[n]
                if lin.live != live[m]:
                    lin.live = int(live[m])
        self.last_changed = int(changed.sum())
        return sizes

    def prefill(self, ids: list[int], cache, slot: int) -> torch.Tensor | None:
        """Row `slot`'s prompt into its row of `cache` through `self.prefills` (CUDA graphs of a one-row prefill over
        the slot model), with the row's own components: its keep bits copied into the row buffer the graphs read,
        each routed matrix read up to its cap (PREFILL_CAP K; past the union it is masked padding). -> its last
        logits (V,) fp32; None when there are no prefills or the union is wider than a cap (prefill it eagerly)."""
        if self.prefills is None or (self.masked and (self._live > self._cap).any()):
            return None
        if self.masked:
            self.row_keep.copy_(self.keep_all[slot:slot + 1])
        # a replay reads row_keep and the caps its graph captured, and runs no module: _row_mode's attribute writes
        # (two a routed matrix each way; 1.2 ms of host time for 32 layers on our 2-core CPU) are for a capture or an
        # eager run only
        with contextlib.nullcontext() if self.prefills.replays(len(ids)) else self._row_mode():
            return self.prefills.prefill(ids, cache, slot)

    @contextlib.contextmanager
    def _row_mode(self) -> Iterator[None]:
        """The routed projections of the slot model read the one-row keep buffer up to their caps (what a graph
        captures, and what the CPU's eager stand-in runs), then the batch's masks and live widths again. B = 1:
        nothing to change (the slot is the row's subset)."""
        if not self.masked:
            yield
            return
        lins = [self._slins[n] for n in self.names]
        saved = [(lin.mask, lin.live) for lin in lins]
        try:
            for m, (n, lin) in enumerate(zip(self.names, lins)):
                lin.mask, lin.live = self._row_mask[n], int(self._cap[m])
            yield
        finally:
            for lin, (mask, live) in zip(lins, saved):
                lin.mask, lin.live = mask, live
