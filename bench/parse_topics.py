"""Does a calibration of the prompt's own topic beat one calibration for all? (CPU, reference model, WikiText-2)

Every PARSE route measured so far picks components from one decomposition, whose whitening saw all of WikiText-2
valid; none beat its first K on the test set. This asks the question one level up: if the decomposition itself is
fitted to the prompt's topic, is there anything to gain? WikiText-2 valid is cut into its articles, the articles are
clustered by their MiniLM embeddings (the rank cache's `Embedder`, cosine k-means), and each cluster gets its own
SVD-LLM / Basis Sharing factors at the same K, whitened on

    alpha * (the cluster's Gram / its tokens) + (1 - alpha) * (all of valid's Gram / its tokens)

A test window's prompt (its first 64 tokens, decoded) is embedded the same way and scored by its nearest cluster's
factors. The control is the same pipeline on random clusters of articles, of the same number: a gain that random
clusters give too is the blend's extra calibration tokens, not the topic. Configs:

    static             the criterion's static truncation: the first 131,072 tokens of valid (bench/parse.py's)
    static-all         the same with every token of valid (more calibration text, one decomposition)
    topic-a<alpha>     the nearest topic cluster's factors, per window
    random-a<alpha>    the nearest random cluster's factors, per window
    *-best             the best of the C cluster models per window: an in-sample choice, a bound, not a router

Scored as bench/parse_oracle.py scores (teacher-forced continuation after the prompt, against the dense model):
perplexity, top-1 agreement, KL and the paired per-window Δ NLL against static.

Usage: python -m rankserve.bench.parse_topics --base svd-llm --out bench/results/parse-topics-svd-llm.json
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rankserve.bench.decode import write_json
from rankserve.bench.parse import WIKI_VALID, test_windows
from rankserve.bench.parse_oracle import score, summarize
from rankserve.compress.calibrate import CalibStats, calibrate
from rankserve.compress.factorize import factorized, plan_factors
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.model import Transformer
from rankserve.workers.tokenizer import Tokenizer

HEADING = re.compile(r"\n(?= = [^=].* = \n)")  # a WikiText article starts at its " = Title = " line


def split_articles(text: str, min_chars: int = 500) -> list[str]:
    """WikiText's articles, each from its title line to the next (section headings " = = x = = " stay inside)."""
    return [a for a in HEADING.split(text) if len(a) >= min_chars]


def kmeans(X: torch.Tensor, k: int, iters: int = 50, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine k-means of unit rows X (n, d): unit centroids (k, d) and each row's cluster (n,)."""
    if not 1 <= k <= len(X):
        raise ValueError(f"k-means: 1 <= k <= {len(X)} rows wanted, got k={k}")
    g = torch.Generator().manual_seed(seed)
    cent = X[torch.randperm(len(X), generator=g)[:k]].clone()
    for _ in range(iters):
        a = (X @ cent.T).argmax(1)
        for j in range(k):
            if bool((a == j).any()):
                c = X[a == j].mean(0)
                cent[j] = c / c.norm()
    return cent, (X @ cent.T).argmax(1)


def centroids(X: torch.Tensor, assign: torch.Tensor, k: int) -> torch.Tensor:
    """Unit mean of each cluster's rows (k, d); every cluster must have one."""
    empty = [j for j in range(k) if not bool((assign == j).any())]
    if empty:
        raise ValueError(f"clusters {empty} have no rows; ask for fewer clusters")
    cent = torch.stack([X[assign == j].mean(0) for j in range(k)])
    return cent / cent.norm(dim=1, keepdim=True)


def blend(whole: CalibStats, part: CalibStats, alpha: float) -> CalibStats:
    """alpha * part's per-token Gram + (1 - alpha) * whole's, every projection; members of one input keep sharing
    one tensor (whitening is computed once an input)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    grams: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for n, g in whole.grams.items():
        if id(g) not in done:
            done[id(g)] = (1 - alpha) * g / whole.tokens + alpha * part.grams[n] / part.tokens
        grams[n] = done[id(g)]
    return CalibStats(grams=grams, tokens=whole.tokens + part.tokens, seq_len=whole.seq_len, source="blend")


def factorize(src: Transformer, dense: dict[str, torch.Tensor], stats: CalibStats, base: str,
              keep: float) -> Transformer:
    """`compress_model`'s factors of src (its dense weights W (out, in) given) at keep from these statistics, in
    memory (fp32)."""
    ranks, groups = plan_factors(src.cfg, base, keep, 2)
    return factorized(src, dense, stats, base, ranks, groups, False)[0].eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="svd-llm", choices=["svd-llm", "basis-sharing"])
    ap.add_argument("--model", default="models/reference")
    ap.add_argument("--clusters", type=int, default=4)
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="windows a forward")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.clusters < 2 or not 0 < args.keep < 1 or any(not 0 <= a <= 1 for a in args.alphas):
        ap.error("--clusters >= 2, 0 < --keep < 1 and every alpha in [0, 1] wanted")
    from rankserve.rank_cache.embedder import Embedder  # the serving extra's MiniLM

    torch.manual_seed(0)
    t0 = time.time()
    src, _ = load_checkpoint(args.model, "cpu", torch.float32)
    dense = {n: lin.dense_weight().detach() for n, lin in src.projections().items()}  # W (out, in), every model's
    tok = Tokenizer.load(args.model)
    articles = split_articles(WIKI_VALID.read_text(encoding="utf-8"))
    emb = Embedder()
    E = torch.tensor(emb.embed([a[:2000] for a in articles]), dtype=torch.float32)  # (n, 384) unit rows
    W = test_windows(tok)  # (n_w, 256)
    P = torch.tensor(emb.embed([tok.decode(w[1:args.prompt_len].tolist()) for w in W]), dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.cat([F.log_softmax(src(W[i:i + args.batch])[:, args.prompt_len - 1:-1], -1)
                         for i in range(0, len(W), args.batch)])  # (n_w, T, V)

    def per_window(model: Transformer) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for i in range(0, len(W), args.batch):
            for key, v in score(model, None, W[i:i + args.batch], ref[i:i + args.batch], args.prompt_len).items():
                out.setdefault(key, []).extend(v)
        return out

    def stats_of(ids: list[int]) -> CalibStats:
        with tempfile.TemporaryDirectory(prefix="parse-topics-") as d:  # calibrate() reads a text file
            path = Path(d) / "articles.txt"
            path.write_text("".join(articles[i] for i in ids), encoding="utf-8")
            return calibrate(src, tok, path, max_tokens=10 ** 8, progress=False)

    per: dict[str, dict[str, list[float]]] = {}
    static = calibrate(src, tok, WIKI_VALID, max_tokens=131072, progress=False)
    per["static"] = per_window(factorize(src, dense, static, args.base, args.keep))
    whole = stats_of(list(range(len(articles))))
    per["static-all"] = per_window(factorize(src, dense, whole, args.base, args.keep))
    C = args.clusters
    splits = {}
    _, assign = kmeans(E, C)
    splits["topic"] = (centroids(E, assign, C), assign)  # refuses an empty cluster (its factors need text)
    rnd = torch.randint(0, C, (len(articles),), generator=torch.Generator().manual_seed(1))
    splits["random"] = (centroids(E, rnd, C), rnd)
    info: dict[str, dict] = {}
    idx = torch.arange(len(W))
    bar = tqdm(total=len(splits) * C * len(args.alphas), desc=f"cluster factors ({args.base})", unit="model")
    for label, (cent, assign) in splits.items():
        parts = [stats_of(torch.nonzero(assign == j)[:, 0].tolist()) for j in range(C)]
        pick = (P @ cent.T).argmax(1)  # (n_w,) nearest centroid of each prompt
        info[label] = dict(articles=[int((assign == j).sum()) for j in range(C)], tokens=[p.tokens for p in parts],
                           test_windows=torch.bincount(pick, minlength=C).tolist())
        for a in args.alphas:
            outs = []
            for p in parts:
                outs.append(per_window(factorize(src, dense, blend(whole, p, a), args.base, args.keep)))
                bar.update()
            nll = torch.tensor([o["nll"] for o in outs])  # (C, n_w)
            best = nll.argmin(0)
            for name, choice in ((f"{label}-a{a:g}", pick), (f"{label}-a{a:g}-best", best)):
                per[name] = {key: [outs[int(c)][key][w] for w, c in zip(idx.tolist(), choice.tolist())]
                             for key in outs[0]}
    bar.close()
    res = summarize(per, W.shape[1] - args.prompt_len)
    for name, r in res.items():
        print(f"{name:18s} perplexity {r['perplexity']:8.2f}  top-1 {r['top1_agreement']:.4f}  KL {r['kl']:.3f}  "
              f"Δ NLL {r['dnll']:+.4f} ± {r['ci95']:.4f}")
    out = dict(base=args.base, model=args.model, keep=args.keep, clusters=C, alphas=args.alphas,
               prompt_len=args.prompt_len, windows=len(W), whole_tokens=whole.tokens, splits=info, results=res,
               seconds=round(time.time() - t0, 1), command="python -m rankserve.bench.parse_topics " + " ".join(
                   sys.argv[1:] if argv is None else argv))
    path = Path(args.out)
    write_json(path, out)
    print(f"wrote {path} in {out['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
