"""PARSE at serving time: run the routers at prefill, turn a rank subset into per-row component masks.

    routers = load_parse(model_dir, model)          # None for a checkpoint without PARSE routers
    subset = select(model, routers, prompt_ids)     # {"v": 1, "k": {proj: [indices...]}}, JSON-serialisable
    digest(subset)                                  # "sha256:…": a short name for logs and `generate --json`
    apply(model, [validate(subset, routers)])       # FactorizedLinear.mask = (B, r_max) 0/1 rows
    ... prefill and every decode step of the request (rank reuse) ...
    clear(model)

A subset names, for every routed projection, the K component indices (into the stored, frequency-sorted pool
of r_max components) the request uses. Masks implement it on the eager path: y = U (mask ⊙ (V x)), exactly the
gathered product U[:, S] V[S, :] x. The offline half (pool, router training, aggregation) is `compress/parse.py`.

Cost: `select` runs one extra eager forward over the prompt with every component on (the "router-only" prefill)
and one GEMV per matrix, R x̄ + b; the serving layer skips it on a rank-cache hit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from rankserve.workers.checkpoint import CheckpointError, read_config, read_method_tensors
from rankserve.workers.model import Transformer

SUBSET_VERSION = 1
INPUT_OF = {"q": "q", "k": "q", "v": "q", "o": "o", "gate": "gate", "up": "gate", "down": "down"}  # shared inputs


@dataclass
class Routers:
    """The PARSE state of a checkpoint: one linear router per routed projection, s = R x̄ + b."""

    R: dict[str, torch.Tensor]  # proj -> [r_max, in], on the model's device, fp32
    b: dict[str, torch.Tensor]  # proj -> [r_max]
    k: dict[str, int]  # components each request uses
    r_max: dict[str, int]  # components stored
    head: dict[str, int]  # leading components selected by most prompts (the shared head)
    perm: dict[str, torch.Tensor]  # proj -> (r_max,) stored index → index in the base's SVD order

    def static_subset(self) -> dict:
        """The subset equal to the static baseline: the base's first K components of every matrix."""
        return {"v": SUBSET_VERSION, "k": {n: sorted((self.perm[n] < k).nonzero().flatten().tolist())
                                           for n, k in self.k.items()}}


def load_parse(model_dir: str | Path, model: Transformer) -> Routers | None:
    """The routers of the checkpoint `model_dir` (already loaded as `model`); None without PARSE state."""
    _, manifest = read_config(model_dir)
    state = manifest.methods.get("parse")
    if state is None:
        return None
    _check_state(model_dir, state)
    tensors = read_method_tensors(model_dir, "parse")
    lins = model.projections()
    dev = model.embed.weight.device
    R, b, perm = {}, {}, {}
    for n, k in state["k"].items():
        lin = lins.get(n)
        if lin is None or not lin.factorized:
            raise CheckpointError(f"{model_dir}: PARSE routes {n}, which is not a factorized projection")
        r = lin.rank
        if state["r_max"].get(n) != r or not 1 <= k <= r:
            raise CheckpointError(f"{model_dir}: PARSE {n} has K={k}, r_max={state['r_max'].get(n)}; the "
                                  f"projection stores {r} components")
        for name, shape in ((f"{n}.R", (r, lin.in_features)), (f"{n}.b", (r,))):
            if name not in tensors or tuple(tensors[name].shape) != shape:
                got = list(tensors[name].shape) if name in tensors else "missing"
                raise CheckpointError(f"{model_dir}: tensor methods.parse.{name} is {got}, expected {list(shape)}")
        R[n], b[n] = tensors[f"{n}.R"].float().to(dev), tensors[f"{n}.b"].float().to(dev)
        perm[n] = tensors.get(f"{n}.perm", torch.arange(r)).long()
        if not torch.equal(perm[n].sort().values, torch.arange(r)):
            raise CheckpointError(f"{model_dir}: methods.parse.{n}.perm is not a permutation of {r} components")
    return Routers(R=R, b=b, k=dict(state["k"]), r_max=dict(state["r_max"]), head=dict(state.get("head", {})),
                   perm=perm)


def _check_state(model_dir: str | Path, state: object) -> None:
    """The JSON types of manifest.methods["parse"], before anything walks them."""
    where = f"{model_dir}: rankserve.json methods.parse"
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} must be an object, not a {type(state).__name__}")
    for key in ("k", "r_max", "head"):
        d = state.get(key, {})
        if key != "head" and key not in state:
            raise CheckpointError(f"{where} lacks the field {key!r}")
        if not isinstance(d, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in d.values()):
            raise CheckpointError(f"{where}.{key} must map projection names to integers, got {d!r}"[:300])


@torch.inference_mode()
def select_batch(model: Transformer, routers: Routers, tokens: torch.Tensor,
                 lengths: torch.Tensor | None = None) -> list[dict]:
    """One subset per row of `tokens` (B, S), right-padded to `lengths` (B,): top-K of R x̄ + b per matrix, where
    x̄ is the matrix's input mean-pooled over the row's real tokens, from one forward with every component on."""
    scores = route_scores(model, routers, tokens, lengths)
    picks = {n: s.topk(routers.k[n], dim=-1).indices for n, s in scores.items()}  # (B, K)
    return [{"v": SUBSET_VERSION, "k": {n: sorted(picks[n][i].tolist()) for n in routers.k}}
            for i in range(tokens.shape[0])]


def route_scores(model: Transformer, routers: Routers, tokens: torch.Tensor,
                 lengths: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The routers' scores R x̄ + b (B, r_max) per matrix for the rows of `tokens` (see select_batch)."""
    B, S = tokens.shape
    dev = model.embed.weight.device
    tokens = tokens.to(dev)
    lengths = torch.full((B,), S, device=dev) if lengths is None else lengths.to(dev)
    w = (torch.arange(S, device=dev)[None] < lengths[:, None]).float() / lengths[:, None].float()  # (B, S)
    lins = model.projections()
    pooled: dict[str, torch.Tensor] = {}
    sources = {router_input(n) for n in routers.k}

    def hook(name: str):
        def fn(module, inputs):
            pooled[name] = torch.einsum("bs,bsi->bi", w, inputs[0].float())  # (B, in)
        return fn

    saved = {n: lins[n].mask for n in routers.k}
    handles = [lins[n].register_forward_pre_hook(hook(n)) for n in sources]
    try:
        for n in routers.k:
            lins[n].mask = None  # route on the r_max model, whatever the request's masks are
        model(tokens, lengths=lengths.to(torch.int32))
    finally:
        for h in handles:
            h.remove()
        for n, m in saved.items():
            lins[n].mask = m
    return {n: pooled[router_input(n)] @ routers.R[n].T + routers.b[n] for n in routers.k}  # (B, r_max)


def select(model: Transformer, routers: Routers, prompt_ids: list[int]) -> dict:
    """The rank subset the routers choose for one prompt (token ids, BOS included)."""
    if not prompt_ids:
        raise ValueError("cannot route an empty prompt")
    return select_batch(model, routers, torch.tensor([prompt_ids]))[0]


def validate(subset: dict, routers: Routers) -> dict:
    """Check a subset from outside (the rank cache, a client): version, projections, K distinct in-range indices
    each. Returns it with sorted indices (the lists given, where they are sorted already); raises ValueError saying
    what is wrong. The index checks run over all matrices at once (a 7B subset holds ~330 K indices; a worker checks
    each rank-cache hit on its engine thread, between the running batch's steps)."""
    if not isinstance(subset, dict) or subset.get("v") != SUBSET_VERSION or not isinstance(subset.get("k"), dict):
        raise ValueError(f'a rank subset is {{"v": {SUBSET_VERSION}, "k": {{projection: [indices]}}}}; '
                         f"got {str(subset)[:80]}")
    picks = subset["k"]
    unknown = set(picks) - set(routers.k)
    if unknown:
        raise ValueError(f"rank subset names projections this model does not route: {sorted(unknown)[:3]}")
    missing = set(routers.k) - set(picks)
    if missing:
        raise ValueError(f"rank subset lacks projections: {sorted(missing)[:3]} (it must name all {len(routers.k)})")
    names = list(routers.k)
    lists = [picks[n] for n in names]
    for n, idx in zip(names, lists):
        if not isinstance(idx, list) or not set(map(type, idx)) <= {int}:  # bool, float, str: refused
            raise ValueError(f"rank subset {n}: expected a list of integer indices")

    def distinct_error(m: int) -> ValueError:
        idx = lists[m]
        return ValueError(f"rank subset {names[m]}: expected {routers.k[names[m]]} distinct indices, got {len(idx)} "
                          f"({len(set(idx))} distinct)")

    def range_error(m: int) -> ValueError:
        idx, r = lists[m], routers.r_max[names[m]]
        return ValueError(f"rank subset {names[m]}: indices must be in [0, {r}), got {min(idx)}..{max(idx)}")

    k = np.array([routers.k[n] for n in names], dtype=np.int64)
    lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    if (lens != k).any():
        raise distinct_error(int(np.flatnonzero(lens != k)[0]))
    ends = np.cumsum(k)
    try:
        vals = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=int(ends[-1]))
    except OverflowError:  # an index beyond int64
        raise range_error(next(m for m, idx in enumerate(lists) if any(abs(i) >= 2 ** 63 for i in idx))) from None
    step = np.diff(vals) > 0  # strictly increasing within a matrix: sorted and distinct
    step[ends[:-1] - 1] = True  # (a matrix's first index follows the previous matrix's last)
    unsorted = set(np.searchsorted(ends, np.flatnonzero(~step) + 1, side="right").tolist())
    for m in sorted(unsorted):
        if np.unique(vals[ends[m] - k[m]:ends[m]]).size != k[m]:
            raise distinct_error(m)
    rmax = np.repeat(np.array([routers.r_max[n] for n in names], dtype=np.int64), k)
    bad = np.flatnonzero((vals < 0) | (vals >= rmax))
    if bad.size:
        raise range_error(int(np.searchsorted(ends, bad[0], side="right")))
    return {"v": SUBSET_VERSION, "k": {n: sorted(idx) if m in unsorted else idx
                                       for m, (n, idx) in enumerate(zip(names, lists))}}


def digest(subset: dict) -> str:
    """A short stable name of a subset ("sha256:" + 16 hex digits of its canonical JSON, indices sorted): two
    subsets choose the same components exactly when their digests match (up to hash collisions)."""
    canon = {"v": subset["v"], "k": {n: sorted(idx) for n, idx in subset["k"].items()}}
    return "sha256:" + hashlib.sha256(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def apply(model: Transformer, subsets: list[dict | None]) -> None:
    """Set every named projection's mask to (B, r) rows, one per subset; a None row (or a projection a subset
    does not name) keeps all components. Subsets are trusted here: `validate` them at the boundary."""
    lins = model.projections()
    names = {n for s in subsets if s is not None for n in s["k"]}
    for n, lin in lins.items():
        if n not in names and lin.factorized:
            lin.mask = None
    for n in names:
        lin = lins[n]
        m = torch.ones(len(subsets), lin.rank, device=lin.U.device, dtype=lin.U.dtype)  # (B, r)
        for i, s in enumerate(subsets):
            if s is not None and n in s["k"]:
                m[i].zero_()
                m[i, s["k"][n]] = 1
        lin.mask = m


def clear(model: Transformer) -> None:
    """Every projection back to all of its components."""
    for lin in model.projections().values():
        if lin.factorized:
            lin.mask = None


def router_input(proj: str) -> str:
    """The projection whose input a projection's router reads (q/k/v share one, gate/up share one)."""
    head, p = proj.rsplit(".", 1)
    return f"{head}.{INPUT_OF[p]}"
