"""A zeroth-order end-to-end stage for PARSE's routers: swaps scored by measuring them, not by the straight-through
gradient (which session 46 found proposes swaps that raise the loss, `parse_kd_trace`).

    python -m rankserve.bench.parse_swap_search --base svd-llm --calib-text valid.txt --train-text valid.txt \
        --test wiki.test.raw --windows 1024 --window 256 --loss-scope continuation \
        --batch 128 --confirm 128 --candidates 1 --sweeps 1 --out parse-swap-svd-llm.json

The start is `parse_kd_sweep.shared_start` (the pool, the router data and the layer-local routers, as
`build_parse_checkpoint` builds them before its KD stage). A move shifts one router bias b_j of one matrix: a
promotion by the δ that brings component j into the top K of `share` of the training windows that now leave it out
(each time displacing that window's weakest selected component), a demotion by the δ that drops it from `share` of
those that now select it. Moves are tried matrix by matrix in layer order, for the `candidates` components per
direction whose selection is most contested (share of windows selecting them nearest one half), and each is scored
by the KL to the dense model (or the cross-entropy to its argmax, `--loss argmax`) over the scored positions of a
fixed batch of `--batch` training windows with hard top-K masks; a move is kept when it lowers that loss by more
than `--margin` (relative), and, with `--confirm N`, also on a second, disjoint draw of N training windows (a move
that helps only the windows it was chosen on is noise). Every move tried is recorded with its relative change on
each batch it was scored on. Only layers from the move's own on run again: the residual stream entering each layer
is cached for the moves kept so far.

After each sweep it records the same loss on the first `kd_eval` held-out windows (for the KL, the KD stage's
early-stopping figure) and keeps the best sweep's biases; then it scores route vs static, for the start and for the
search, on the dev windows (the held-out windows after those) and on the evaluation text (`paired_scores`, fp32,
CPU); when no sweep beat the start, the search's routers are the start's and are not scored again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from rankserve.bench.decode import write_json
from rankserve.bench.parse_kd_sweep import Start, dev_scores, shared_start
from rankserve.bench.parse_paired import paired_scores
from rankserve.compress.parse import TrainConfig, _hard
from rankserve.workers.model import CAUSAL, Transformer
from rankserve.workers.parse import Routers, router_input

LOSSES = ("kl", "argmax")


@dataclass
class SearchConfig:
    """The swap search's knobs."""

    batch: int = 32  # training windows every move is scored on (a fixed draw)
    confirm: int = 0  # a second, disjoint draw: a move is kept only if it lowers the loss there too (0 = none)
    candidates: int = 4  # components tried per matrix, direction and sweep
    share: float = 0.5  # a move flips this share of the training windows on its side of the top-K threshold
    sweeps: int = 2
    margin: float = 1e-4  # relative drop in the batch loss a move must reach to be kept
    loss: str = "kl"  # "kl": KL(dense ‖ pool); "argmax": cross-entropy to the dense model's argmax
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch < 1 or self.candidates < 1 or self.sweeps < 1 or self.confirm < 0:
            raise ValueError("batch, candidates and sweeps must be at least 1, confirm at least 0")
        if not 0 < self.share <= 1:
            raise ValueError(f"share must be in (0, 1], got {self.share}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")


def layers_from(model: Transformer, h: torch.Tensor, first_layer: int, last_layer: int) -> torch.Tensor:
    """The residual stream h (B, S, hidden) entering layer `first_layer` -> the one leaving `last_layer - 1`, with
    every row at positions 0 .. S-1 and no cache (a plain causal forward)."""
    B, S, _ = h.shape
    pos = torch.arange(S, device=h.device)[None].expand(B, S)  # (B, S)
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]
    valid = torch.ones(B, S, dtype=torch.bool, device=h.device)
    for i in range(first_layer, last_layer):
        h = model.layers[i](h, cos, sin, i, None, pos, valid, CAUSAL)
    return h


def head_logprobs(model: Transformer, h: torch.Tensor, first: int) -> torch.Tensor:
    """The last layer's output h (B, S, hidden) -> log-probabilities (B, S - first, V) from position `first`."""
    return torch.log_softmax(F.linear(model.norm(h[:, first:]), model.head_weight()).float(), -1)


def move_delta(s: torch.Tensor, j: int, k: int, share: float, promote: bool) -> float | None:
    """The bias shift of component j that flips it in `share` of the windows on its side of the top-K threshold.

    s (P, r_max) router scores of the training windows. A promotion brings j into the top K of that share of the
    windows that leave it out (j enters where s_j + δ exceeds the K-th score); a demotion drops it from that share of
    the windows that select it (j leaves where s_j − δ falls below the (K+1)-th). None when no window is on that side.
    """
    if k >= s.shape[-1]:  # every component is selected: nothing to swap with
        return None
    top = s.topk(k + 1, dim=-1).values  # (P, K+1)
    inside = (s[:, j:j + 1] >= top[:, k - 1:k]).squeeze(1)  # (P,) j among the top K
    if promote:
        gap = (top[:, k - 1] - s[:, j])[~inside]  # > 0: how far j sits below the K-th score
    else:
        gap = (s[:, j] - top[:, k])[inside]  # > 0: how far j sits above the (K+1)-th score
    if not len(gap):
        return None
    d = float(torch.quantile(gap.double(), share)) * (1 + 1e-6) + 1e-7
    return d if promote else -d


def contested(s: torch.Tensor, k: int, n: int) -> tuple[list[int], list[int]]:
    """The n components to promote and the n to demote: those whose share of selecting windows is nearest one half
    (a promotion needs windows that leave it out, a demotion windows that select it)."""
    m = _hard(s, k)  # (P, r_max)
    freq = m.mean(0)  # (r_max,)
    order = (freq - 0.5).abs().argsort().tolist()
    up = [j for j in order if freq[j] < 1][:n]
    down = [j for j in order if freq[j] > 0][:n]
    return up, down


def train_batches(n_train: int, cfg: SearchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed, disjoint draws of training windows (indices < n_train) moves are scored and confirmed on."""
    if cfg.batch + cfg.confirm > n_train:
        raise ValueError(f"batch + confirm = {cfg.batch + cfg.confirm} windows, but only {n_train} train")
    g = torch.Generator().manual_seed(cfg.seed)
    perm = torch.randperm(n_train, generator=g)
    return perm[:cfg.batch], perm[cfg.batch:cfg.batch + cfg.confirm]


@dataclass
class _Batch:
    """One fixed draw of training windows, its dense log-probabilities and the residual stream cached for it."""

    rows: torch.Tensor  # (B,) window indices (rows of the training scores)
    x: torch.Tensor  # (B, L) tokens
    ref: torch.Tensor  # (B, T, V) the dense model's log-probabilities at the scored positions
    h: torch.Tensor | None = None  # (B, L, hidden) entering the layer the search is at
    loss: float = 0.0  # the loss with the moves kept so far


def search(st: Start, train: TrainConfig, cfg: SearchConfig, log=print) -> tuple[dict, dict]:
    """The best sweep's biases {proj: (r_max,)} (raw-input router form, R unchanged) and the search's record."""
    data, k = st.data, st.k
    lins, model = st.model.projections(), st.model
    n_layers = len(model.layers)
    n_val = int(round(data.n * train.holdout))
    tr = torch.arange(data.n - n_val)
    va = torch.arange(data.n - n_val, data.n)[:train.kd_eval]
    first = train.loss_from
    b = {n: v.clone() for n, v in st.b.items()}
    s_tr = {n: data.x[router_input(n)][tr] @ st.R[n].T + b[n] for n in k}  # (P_tr, r_max) every training window
    by_layer = [[n for n in k if n.startswith(f"layers.{i}.")] for i in range(n_layers)]
    batches = []
    with torch.no_grad():
        for rows in train_batches(len(tr), cfg):  # the training windows are the first P_tr: rows of s_tr
            if len(rows):
                x = data.windows[rows]
                batches.append(_Batch(rows, x, torch.log_softmax(st.dense(x)[:, first:], -1)))

    def loss_of(ref: torch.Tensor, lp: torch.Tensor) -> float:
        """The search's loss of log-probabilities lp against the dense model's ref, both (B, T, V)."""
        if cfg.loss == "kl":
            return float((ref.exp() * (ref - lp)).sum(-1).mean())
        return float(-lp.gather(-1, ref.argmax(-1, keepdim=True)).mean())

    def loss_on(bt: _Batch, layer: int, scores: dict[str, torch.Tensor]) -> float:
        """The batch loss with hard masks from `scores`, running layers `layer`.. on the cached stream."""
        for i in range(layer, n_layers):
            for n in by_layer[i]:
                lins[n].mask = _hard(scores[n][bt.rows], k[n])
        return loss_of(bt.ref, head_logprobs(model, layers_from(model, bt.h, layer, n_layers), first))

    def heldout() -> float:
        tot = 0.0
        s_va = {n: data.x[router_input(n)][va] @ st.R[n].T + b[n] for n in k}
        with torch.no_grad():
            for i in range(0, len(va), train.kd_batch):
                sl = slice(i, i + train.kd_batch)
                for n in k:
                    lins[n].mask = _hard(s_va[n][sl], k[n])
                xv = data.windows[va[sl]]
                r = torch.log_softmax(st.dense(xv)[:, first:], -1)
                lp = torch.log_softmax(model(xv)[:, first:], -1)
                tot += loss_of(r, lp) * len(xv)
        return tot / len(va)

    best_b = {n: v.clone() for n, v in b.items()}
    try:
        h0 = heldout()
        rec = dict(config=asdict(cfg), heldout=[h0], sweeps=[], best_sweep=0)
        best = h0
        log(f"start: held-out {cfg.loss} {h0:.4f}")
        for sweep in range(cfg.sweeps):
            t = time.perf_counter()
            kept, trials = [], []  # trials: [proj, component, promote, relative change on each batch scored]
            with torch.no_grad():
                for bt in batches:
                    bt.h = model.embed(bt.x)
                    bt.loss = loss_on(bt, 0, s_tr)
                start_loss = [bt.loss for bt in batches]
                for layer in range(n_layers):
                    for n in by_layer[layer]:
                        up, down = contested(s_tr[n], k[n], cfg.candidates)
                        for j, promote in [(j, True) for j in up] + [(j, False) for j in down]:
                            d = move_delta(s_tr[n], j, k[n], cfg.share, promote)
                            if d is None:
                                continue
                            trial = s_tr[n].clone()
                            trial[:, j] += d
                            scores = s_tr | {n: trial}
                            new, rel = [], []
                            for bt in batches:  # the confirming batch only scores what the first one keeps
                                new.append(loss_on(bt, layer, scores))
                                rel.append(new[-1] / bt.loss - 1)
                                if rel[-1] >= -cfg.margin:
                                    break
                            trials.append([n, j, promote] + [round(r, 7) for r in rel])
                            if len(new) == len(batches) and rel[-1] < -cfg.margin:
                                changed = int((_hard(trial, k[n]) != _hard(s_tr[n], k[n])).any(-1).sum())
                                s_tr[n] = trial
                                b[n][j] += d
                                for bt, v in zip(batches, new):
                                    bt.loss = v
                                kept.append(dict(proj=n, component=j, delta=d, batch_loss=new,
                                                 windows_changed=changed))
                    for bt in batches:  # the kept moves of this layer, fixed in the cached stream
                        for n in by_layer[layer]:
                            lins[n].mask = _hard(s_tr[n][bt.rows], k[n])
                        bt.h = layers_from(model, bt.h, layer, layer + 1)
            hk = heldout()
            rec["heldout"].append(hk)
            rec["sweeps"].append(dict(batch_loss_start=start_loss, batch_loss_end=[bt.loss for bt in batches],
                                      tried=len(trials), kept=kept, trials=trials,
                                      seconds=round(time.perf_counter() - t, 1)))
            log(f"sweep {sweep + 1}: batch {cfg.loss} {start_loss[0]:.4f} -> {batches[0].loss:.4f}"
                + (f" (confirm {start_loss[1]:.4f} -> {batches[1].loss:.4f})" if len(batches) > 1 else "")
                + f", {len(kept)} of {len(trials)} moves kept, held-out {cfg.loss} {hk:.4f} "
                f"({time.perf_counter() - t:.0f} s)")
            if hk < best:
                best, rec["best_sweep"] = hk, sweep + 1
                best_b = {n: v.clone() for n, v in b.items()}
    finally:
        for n in k:
            lins[n].mask = None
        for bt in batches:
            bt.h = None
    return best_b, rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_swap_search",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="svd-llm", choices=["svd-llm", "basis-sharing"])
    ap.add_argument("--dense", default="models/reference", help="the dense model (the teacher and the reference)")
    ap.add_argument("--calib-text", required=True, type=Path)
    ap.add_argument("--train-text", required=True, type=Path)
    ap.add_argument("--test", required=True, type=Path, help="the evaluation text")
    ap.add_argument("--seq-len", type=int, default=256, help="the evaluation's window")
    ap.add_argument("--max-tokens", type=int, default=0, help="score the evaluation text's first N tokens (0 = all)")
    ap.add_argument("--loss-scope", default="window", choices=["window", "continuation"])
    ap.add_argument("--windows", type=int, default=2048, help="router training windows (the last tenth held out)")
    ap.add_argument("--window", type=int, default=128, help="tokens per training window")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--kd-eval", type=int, default=64, help="held-out windows that pick the best sweep; the rest "
                    "are dev")
    d = SearchConfig()
    ap.add_argument("--batch", type=int, default=d.batch, help="training windows every move is scored on")
    ap.add_argument("--confirm", type=int, default=d.confirm, help="a second draw of training windows a move must "
                    "also improve (0 = none)")
    ap.add_argument("--candidates", type=int, default=d.candidates, help="components per matrix and direction")
    ap.add_argument("--share", type=float, default=d.share, help="share of windows a move flips")
    ap.add_argument("--sweeps", type=int, default=d.sweeps)
    ap.add_argument("--margin", type=float, default=d.margin, help="relative loss drop a move must reach")
    ap.add_argument("--loss", default=d.loss, choices=LOSSES)
    ap.add_argument("--out", required=True, type=Path, help="writes OUT (JSON)")
    a = ap.parse_args(argv)
    try:
        cfg = SearchConfig(batch=a.batch, confirm=a.confirm, candidates=a.candidates, share=a.share,
                           sweeps=a.sweeps, margin=a.margin, loss=a.loss)
        train = TrainConfig(windows=a.windows, window=a.window, prompt_len=a.prompt_len, kd_eval=a.kd_eval,
                            loss_scope=a.loss_scope)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in (a.calib_text, a.train_text, a.test, Path(a.dense)):
        if not p.exists():
            print(f"error: {p} does not exist", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    st = shared_start(Path(a.dense), a.base, a.calib_text, a.train_text, "cpu", 0.6, train, 100)
    cmd = "python -m rankserve.bench.parse_swap_search " + " ".join(argv if argv is not None else sys.argv[1:])
    res = dict(command=cmd, base=a.base, train=dict(windows=a.windows, window=a.window, prompt_len=a.prompt_len,
                                                    loss_scope=a.loss_scope, kd_eval=a.kd_eval),
               torch=torch.__version__, start_s=round(time.perf_counter() - t0, 1))
    print(f"{a.base}: start in {res['start_s']} s", flush=True)
    t = time.perf_counter()
    b, res["search"] = search(st, train, cfg, log=lambda s: print(s, flush=True))
    res["search_s"] = round(time.perf_counter() - t, 1)
    n_val = int(round(st.data.n * train.holdout))
    dev = st.data.windows[st.data.n - n_val + train.kd_eval:]
    text = a.test.read_text(encoding="utf-8", errors="replace")
    perm = {n: torch.arange(r) for n, r in st.r_max.items()}
    res["rows"] = []
    for name, bias in (("start", st.b), ("search", b)):
        if name == "search" and res["search"]["best_sweep"] == 0:
            print("the search kept the start (no sweep lowered the held-out loss): not scored again", flush=True)
            break
        t = time.perf_counter()
        routers = Routers(R=st.R, b=bias, k=st.k, r_max=st.r_max, head={}, perm=perm)
        row = dict(variant=name, dev=dev_scores(st.model, st.dense, routers, dev, train.prompt_len) if len(dev)
                   else None, test=paired_scores(st.model, st.dense, routers, st.tok, text, a.seq_len,
                                                 train.prompt_len, a.max_tokens))
        row["seconds"] = round(time.perf_counter() - t, 1)
        res["rows"].append(row)
        print(json.dumps({"variant": name, "dev": row["dev"] and row["dev"]["route_minus_static"],
                          "test": row["test"]["route_minus_static"]}), flush=True)
        write_json(a.out, res)  # after every row: a stopped run keeps what it scored
    return 0


if __name__ == "__main__":
    sys.exit(main())
