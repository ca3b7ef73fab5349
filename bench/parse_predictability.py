"""How much of the per-window oracle's layer-local gain can a predictor from the prompt reach?

    python -m rankserve.bench.parse_predictability --base svd-llm --calib-text valid.txt --train-text valid.txt \
        --windows 1024 --window 256 --out parse-predictability-svd-llm.json

PARSE's router for a matrix scores its r_max components from the prompt and keeps the top K. The best any router
can do on a window is the oracle's top K by that window's own gains −a_i/Y on the positions it scores (exact for
orthogonal U such as svd-llm's; for Basis Sharing it ignores the cross term between members). This bench asks how
much of the gap between static truncation (the first K) and that oracle is within a predictor's reach,
with the routers' own training out of the picture: per matrix, ridge regressions of the windows' continuation
gains G (P, r_max) on features of the prompt, cross-validated over `folds` folds of the windows (each window scored
by a fit on the other folds), the top K of the prediction kept. Features:

    x       the router's own input, the prompt's mean input activation (what `train_routers` regresses on)
    gp      the prompt's own gains (−a/Y over the prompt's positions): what the prompt alone says it needs
    x+gp    both
    gr      the gains of the prompt's last `--recent` positions only (off unless --recent is given): what the tokens
            nearest the continuation say it needs

`x nearest` averages the gains of the prompt's nearest training windows by cosine of x (the best of the
`--neighbours` counts): a non-linear predictor, as rank retrieval is. Rows besides: `mean_gain` (one fixed order for
every window, the training folds' mean gains: what a bias alone holds) and `prompt_gain` (the prompt's own top K, no
regression). Each ridge predictor is also fitted on a random `--fraction` of its training folds, to show whether
more text would help. The ridge strength (and the neighbour count) is the one with the lowest cross-validated loss,
per matrix and predictor (a choice made on the scored windows: an optimistic figure, so an upper bound for these
predictors on these features; no `--ridges` flag, `RIDGES` below). The loss is the mean relative reconstruction
error of `RouterData.loss` over the matrices; `vs_static` = row / static − 1, and where the oracle is a bound (no
cross term) `share_of_oracle_gap` = (static − row) / (static − oracle).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from rankserve.bench.decode import write_json
from rankserve.compress.parse import RouterData, TrainConfig, _hard, build_pool, collect, sample_windows
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.parse import router_input
from rankserve.workers.tokenizer import Tokenizer

RIDGES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)  # λ × training windows
NEIGHBOURS = (4, 16, 64, 256)  # training windows a nearest-neighbour prediction averages


def fold_predict(F: torch.Tensor, G: torch.Tensor, folds: torch.Tensor, lam: float,
                 use: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-validated ridge predictions (P, r) of targets G (P, r) from features F (P, d): each fold's rows by a
    fit on the other folds' rows (only those where `use` (P,) is set, if given); features standardized on the
    training rows, the intercept free, penalty lam · n."""
    out = torch.empty_like(G)
    for f in folds.unique():
        test = folds == f
        train = ~test if use is None else ~test & use
        X, Y = F[train], G[train]
        mu, sd = X.mean(0), X.std(0).clamp_min(1e-8)
        Xs = (X - mu) / sd  # (n, d)
        g0 = Y.mean(0)  # (r,)
        n, d = Xs.shape
        W = torch.linalg.solve(Xs.T @ Xs + lam * n * torch.eye(d, dtype=Xs.dtype), Xs.T @ (Y - g0))  # (d, r)
        out[test] = ((F[test] - mu) / sd) @ W + g0
    return out


def fold_mean(G: torch.Tensor, folds: torch.Tensor) -> torch.Tensor:
    """Each fold's rows scored by the other folds' mean gains (P, r): one fixed order per fold."""
    out = torch.empty_like(G)
    for f in folds.unique():
        test = folds == f
        out[test] = G[~test].mean(0)
    return out


def fold_neighbours(F: torch.Tensor, G: torch.Tensor, folds: torch.Tensor, n: int) -> torch.Tensor:
    """Each fold's rows scored by the mean gains (P, r) of their `n` nearest rows of the other folds, by cosine of
    the features F (P, d) standardized on those rows: a non-linear predictor, as rank retrieval is."""
    out = torch.empty_like(G)
    for f in folds.unique():
        test = folds == f
        X = F[~test]
        mu, sd = X.mean(0), X.std(0).clamp_min(1e-8)
        A = torch.nn.functional.normalize((F[test] - mu) / sd, dim=-1)  # (t, d)
        B = torch.nn.functional.normalize((X - mu) / sd, dim=-1)  # (n_train, d)
        near = (A @ B.T).topk(min(n, len(B)), dim=-1).indices  # (t, n)
        out[test] = G[~test][near].mean(1)
    return out


def gains(d: RouterData, n: str) -> torch.Tensor:
    """Each component's relative layer-local gain −a/Y on `d`'s positions for matrix n (P, r), float64."""
    return (-d.a[n] / d.Y[n][:, None].clamp_min(1e-30)).double()


def predictability(cont: RouterData, prompt: RouterData, k: dict[str, int], n_folds: int = 5,
                   fraction: float = 0.5, ridges: tuple[float, ...] = RIDGES, seed: int = 0,
                   neighbours: tuple[int, ...] = NEIGHBOURS, progress: bool = True,
                   recent: RouterData | None = None) -> dict:
    """Per matrix and mean over matrices: the loss of each predictor (module docstring). `cont` has the statistics
    of the positions scored, `prompt` those of the prompt's own positions and `recent` (optional) those of the
    prompt's last positions, over the same windows in the same order (their x is not used)."""
    P = cont.n
    for name, d in (("prompt", prompt), ("recent", recent)):
        if d is not None and d.n != P:
            raise ValueError(f"the {name} statistics cover {d.n} windows, the scored ones {P}")
    if not 2 <= n_folds <= P:
        raise ValueError(f"folds must be in [2, {P}] (the windows), got {n_folds}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    g = torch.Generator().manual_seed(seed)
    folds = torch.randperm(P, generator=g) % n_folds  # (P,)
    use = torch.rand(P, generator=g) < fraction  # (P,) the rows a reduced fit may use
    every = torch.arange(P)
    rows = {}
    for n in tqdm(list(k), desc="predict gains", unit="matrix", disable=not progress):
        K = k[n]
        G, Gp = gains(cont, n), gains(prompt, n)  # (P, r) on the scored positions, on the prompt's own
        x = cont.x[router_input(n)].double()  # (P, in)
        feats = [("x", x), ("gp", Gp), ("x+gp", torch.cat([x, Gp], 1))]
        Gr = None if recent is None else gains(recent, n)  # (P, r) on the prompt's last positions
        if Gr is not None:
            feats.append(("gr", Gr))

        def loss(s: torch.Tensor) -> float:
            return cont.loss(n, every, _hard(s.float(), K)).mean().item()

        r = G.shape[1]
        row = {"static": loss(torch.linspace(1.0, -1.0, r, dtype=torch.float64).expand(P, r)), "oracle": loss(G),
               "mean_gain": loss(fold_mean(G, folds)), "prompt_gain": loss(Gp)}
        for name, F in feats:
            row[name] = min(loss(fold_predict(F, G, folds, lam)) for lam in ridges)
            row[f"{name} @{fraction:g}"] = min(loss(fold_predict(F, G, folds, lam, use)) for lam in ridges)
        row["x nearest"] = min(loss(fold_neighbours(x, G, folds, m)) for m in neighbours)
        if Gr is not None:
            row["recent_gain"] = loss(Gr)  # the last positions' own top K, no regression
        rows[n] = row
    names = list(next(iter(rows.values())))
    mean = {m: sum(r[m] for r in rows.values()) / len(rows) for m in names}
    gap = mean["static"] - mean["oracle"]
    bound = not cont.zs and gap > 0  # with a cross term (Basis Sharing) the oracle is no bound: no share of it
    share = {m: (mean["static"] - v) / gap for m, v in mean.items()} if bound else None
    return {"windows": P, "folds": n_folds, "fraction": fraction, "ridges": list(ridges),
            "neighbours": list(neighbours), "mean": mean,
            "vs_static": {m: v / mean["static"] - 1 for m, v in mean.items()}, "share_of_oracle_gap": share,
            "matrices": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_predictability",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="svd-llm", choices=["svd-llm", "basis-sharing"])
    ap.add_argument("--dense", default="models/reference", type=Path, help="the dense model")
    ap.add_argument("--calib-text", required=True, type=Path, help="the pool's whitening calibration text")
    ap.add_argument("--train-text", required=True, type=Path, help="the windows' text (the routers' training text)")
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--windows", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256, help="tokens per window, BOS first")
    ap.add_argument("--prompt-len", type=int, default=64, help="the prompt; the continuation after it is scored")
    ap.add_argument("--recent", type=int, default=0,
                    help="also predict from the gains of the prompt's last N positions (0: off)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.5, help="share of the training folds a reduced fit uses")
    ap.add_argument("--neighbours", type=int, nargs="+", default=list(NEIGHBOURS),
                    help="training windows a nearest-neighbour prediction averages (the best count is reported)")
    ap.add_argument("--out", required=True, type=Path, help="writes OUT (JSON)")
    a = ap.parse_args(argv)
    try:
        train = TrainConfig(windows=a.windows, window=a.window, prompt_len=a.prompt_len, loss_scope="continuation")
        if not 0 < a.fraction <= 1 or not 2 <= a.folds <= a.windows or min(a.neighbours) < 1:
            raise ValueError(f"need 0 < --fraction <= 1, 2 <= --folds <= --windows and --neighbours >= 1, got "
                             f"{a.fraction}, {a.folds}, {a.neighbours}")
        if not 0 <= a.recent <= a.prompt_len:
            raise ValueError(f"--recent must be in [0, --prompt-len={a.prompt_len}], got {a.recent}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in (a.calib_text, a.train_text, a.dense):
        if not p.exists():
            print(f"error: {p} does not exist", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    try:  # the windows first: a text too short fails before the pool is built; then a bad --keep
        wins = sample_windows([a.train_text], Tokenizer.load(a.dense), a.windows, a.window, train.seed)
        model, k, _ = build_pool(a.dense, a.base, a.keep, a.calib_text, progress=False)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dense_model, _ = load_checkpoint(a.dense, "cpu", torch.float32)
    dense = {n: l.dense_weight().detach() for n, l in dense_model.projections().items()}
    del dense_model
    cont = collect(model, dense, wins, a.prompt_len, train.sample_tokens, train.collect_batch, train.seed,
                   loss_from=train.loss_from)  # the positions `train-parse --loss-scope continuation` scores
    prompt = collect(model, dense, wins[:, :a.prompt_len], a.prompt_len, train.sample_tokens, train.collect_batch,
                     train.seed)
    recent = None
    if a.recent:
        recent = collect(model, dense, wins[:, :a.prompt_len], a.prompt_len, train.sample_tokens, train.collect_batch,
                         train.seed, loss_from=a.prompt_len - a.recent)
    res = predictability(cont, prompt, k, a.folds, a.fraction, neighbours=tuple(a.neighbours), recent=recent)
    cmd = "python -m rankserve.bench.parse_predictability " + " ".join(argv if argv is not None else sys.argv[1:])
    res = dict(command=cmd, base=a.base, keep=a.keep, window=a.window, prompt_len=a.prompt_len, recent=a.recent,
               torch=torch.__version__, seconds=round(time.perf_counter() - t0, 1)) | res
    write_json(a.out, res)
    print("mean relative error: " + ", ".join(f"{m} {v:.6f}" for m, v in res["mean"].items()))
    print("against static: " + ", ".join(f"{m} {100 * v:+.3f} %" for m, v in res["vs_static"].items()))
    if res["share_of_oracle_gap"] is not None:
        print("share of the oracle's gap: " + ", ".join(f"{m} {v:.3f}" for m, v in res["share_of_oracle_gap"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
