"""Batch PARSE requests by subset overlap: fewer distinct components per batch, fewer bytes per decode step.

A batch of B requests with different subsets reads the union of their components in every decode step
(workers/parse_decode.py), so its cost grows with |union| / K: on the H200 at B = 8, 1.08x static at a union of
1.05 K, 1.14x at 1.2 K (bench/results/parse-log.md). When more requests wait than fit in one batch, which of them
share a batch is free to choose: `group_by_overlap` forms the batches greedily, oldest request first (so nobody
waits behind a better match forever), each then filled with the waiting requests that add the fewest new
component bytes to its union.

    members = membership(subsets, routers)          # (N, G) bool over every routed component
    groups = group_by_overlap(members, cost, batch_size)   # [[i, ...], ...], each <= batch_size, in arrival order

Once a batch is formed, `select_together` can also route its requests towards each other: every request's router
scores get a bonus for the components the rest of the batch picks, so the union shrinks (bench/parse_union.py
measures union and quality against that pull).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

import torch

from rankserve.workers.parse import SUBSET_VERSION, Routers


def bases(routers: Routers) -> np.ndarray:
    """(M + 1,) int64: matrix m (routers.k's order) owns the global component ids bases[m] .. bases[m + 1] - 1."""
    return np.concatenate([[0], np.cumsum([routers.r_max[n] for n in routers.k])]).astype(np.int64)


def subset_ids(subset: dict, routers: Routers) -> np.ndarray:
    """(sum K,) int64: the global ids (membership()'s columns) of one subset's components, matrix by matrix.
    Checks each list's length (K) and range (< r_max), vectorized over all matrices. Converting the Python lists
    is the costly part (~8 ms for a 7B subset of ~330 K indices), so callers that see a subset again keep this."""
    names, base = list(routers.k), bases(routers)
    k = np.array([routers.k[n] for n in names], dtype=np.int64)
    lists = [subset["k"][n] for n in names]
    lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    if not np.array_equal(lens, k):
        m = int(np.flatnonzero(lens != k)[0])
        raise ValueError(f"{names[m]}: subset of {lens[m]} components, expected {k[m]}")
    vals = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=int(k.sum()))
    krmax = np.repeat(base[1:] - base[:-1], k)
    bad = (vals < 0) | (vals >= krmax)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        m = int(np.searchsorted(np.cumsum(k), i, side="right"))
        raise ValueError(f"{names[m]}: component {vals[i]} is out of range")
    return vals + np.repeat(base[:-1], k)


def membership(subsets: list[dict], routers: Routers) -> np.ndarray:
    """(N, G) bool: column bases[m] + i is component i of matrix m (routers.k's order); row j = subsets[j], each
    converted and checked by subset_ids()."""
    member = np.zeros((len(subsets), int(bases(routers)[-1])), dtype=bool)
    for j, s in enumerate(subsets):
        member[j, subset_ids(s, routers)] = True
    return member


def component_cost(routers: Routers, shapes: dict[str, tuple[int, int]]) -> np.ndarray:
    """(G,) bytes-proportional cost of each component in membership()'s column order: in + out of its matrix
    (one row of V and one column of U). shapes: projection name -> (out, in)."""
    return np.concatenate([np.full(routers.r_max[n], float(sum(shapes[n])), dtype=np.float32) for n in routers.k])


def group_by_overlap(members: np.ndarray, cost: np.ndarray, batch_size: int) -> list[list[int]]:
    """Split requests 0..N-1 into batches of at most batch_size: each batch starts with the oldest waiting
    request and takes, one at a time, the waiting request whose subset adds the least cost to the batch's union
    (ties: the older one). members: (N, G) bool; cost: (G,) >= 0. Indices in each batch are sorted."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if members.ndim != 2 or cost.shape != (members.shape[1],):
        raise ValueError(f"members (N, G) and cost (G,) expected, got {members.shape} and {cost.shape}")
    waiting = list(range(members.shape[0]))
    groups = []
    while waiting:
        group = [waiting.pop(0)]
        union = members[group[0]].copy()
        while len(group) < batch_size and waiting:
            added = (members[waiting] & ~union).astype(np.float32) @ cost  # (waiting,) cost each would add
            j = int(np.argmin(added))  # first minimum: the oldest of the ties
            group.append(waiting.pop(j))
            union |= members[group[-1]]
        groups.append(sorted(group))
    return groups


def union_over_k(members: np.ndarray, routers: Routers, groups: list[list[int]]) -> float:
    """Mean over batches and routed projections of |union of the batch's subsets| / K (the quantity the decode
    cost follows; bench/parse_overlap.py reports it for in-order and grouped batches)."""
    base = bases(routers)
    k = np.array([routers.k[n] for n in routers.k], dtype=np.float64)
    fr = []
    for g in groups:
        u = members[g].any(axis=0)
        fr.extend(np.add.reduceat(u, base[:-1]) / k)
    return float(np.mean(fr))


def select_together(scores: dict[str, torch.Tensor], routers: Routers, pull: float) -> list[dict]:
    """One subset per row of a batch's router scores ({matrix: (B, r_max)}, workers.parse.route_scores), pulled
    towards the batch's common choice: each row's scores are standardized (zero mean, unit deviation over r_max),
    then pull x (the fraction of the batch whose own top-K holds the component) is added before taking the top-K.
    pull = 0 gives each row its own top-K (= select_batch); larger pulls give smaller unions, i.e. fewer bytes a
    decode step at B > 1, at some cost to each row's own choice."""
    if pull < 0:
        raise ValueError(f"pull must be >= 0, got {pull}")
    picks = {}
    for n, s in scores.items():
        k = routers.k[n]
        z = (s - s.mean(-1, keepdim=True)) / s.std(-1, keepdim=True).clamp_min(1e-12)  # (B, r_max)
        own = torch.zeros_like(z).scatter_(-1, z.topk(k, dim=-1).indices, 1.0)  # (B, r_max) each row's top-K
        picks[n] = (z + pull * own.mean(0, keepdim=True)).topk(k, dim=-1).indices  # (B, K)
    B = next(iter(scores.values())).shape[0]
    return [{"v": SUBSET_VERSION, "k": {n: sorted(picks[n][i].tolist()) for n in routers.k}} for i in range(B)]
