"""Shrinking the routers' prompt-dependent part towards their average choice (reference model, CPU).

PARSE's routers score a matrix's components as s = R x̄ + b (workers/parse.py). Over a corpus of prompts the average
score is s̄ = R μ + b (μ: the mean pooled input). This bench routes each WikiText-2 test prompt on

    s_β = s̄ + β (s - s̄)        β = 0: one fixed subset (the average choice); β = 1: live routing

and scores the continuation against the dense model as bench/parse.py does, next to static truncation and the
bias-only subset (top-K of b). s̄ comes from the routers' own training text (WikiText-2 valid prompts). The question:
does a damped prompt-dependent term keep what a good fixed subset gains over static truncation while adding
prompt-awareness on top?

Usage: python -m rankserve.bench.parse_shrink --base basis-sharing --tag valid --pool-factor 1.25
           [--betas 0 0.25 0.5 1] [--out F]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rankserve.bench.decode import write_json
from rankserve.bench.parse import WIKI_VALID, _score, _windows, add_cached_args, load_cached, test_windows, vs_static
from rankserve.workers.parse import SUBSET_VERSION, Routers, route_scores


def subsets(scores: dict[str, torch.Tensor], routers: Routers) -> list[dict]:
    """Top-K of each matrix's scores (n, r_max) -> one subset per row."""
    picks = {m: s.topk(routers.k[m], dim=-1).indices for m, s in scores.items()}
    n = next(iter(picks.values())).shape[0]
    return [{"v": SUBSET_VERSION, "k": {m: sorted(picks[m][i].tolist()) for m in routers.k}} for i in range(n)]


def all_scores(model, routers: Routers, windows: torch.Tensor, prompt_len: int, batch: int = 16) -> dict:
    """The routers' scores (n, r_max) per matrix for the prompts (first prompt_len tokens) of the windows."""
    parts = [route_scores(model, routers, windows[i:i + batch, :prompt_len]) for i in range(0, len(windows), batch)]
    return {m: torch.cat([p[m] for p in parts]) for m in routers.k}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_shrink", description=__doc__.split("\n\n")[0])
    add_cached_args(ap, tag="valid")
    ap.add_argument("--pool-factor", type=float, default=2.0, help="r_max / K of the cached PARSE checkpoint")
    ap.add_argument("--betas", nargs="+", type=float, default=[0.0, 0.25, 0.5, 1.0])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--mean-prompts", type=int, default=512, help="WikiText-2 valid windows averaged for s̄")
    ap.add_argument("--max-tokens", type=int, default=40000, help="scored text: this many tokens in 256-token windows")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if any(b < 0 for b in a.betas):
        print("error: --betas must be >= 0", file=sys.stderr)
        return 2
    loaded = load_cached(a.cache, a.model, a.base, a.tag, a.pool_factor)
    if loaded is None:
        return 2
    tok, dense, static, model, routers = loaded
    test = test_windows(tok, 256, a.max_tokens)
    valid = _windows(Path(WIKI_VALID).read_text(encoding="utf-8", errors="replace"), tok, 256, a.mean_prompts)
    mean = {m: s.mean(0) for m, s in all_scores(model, routers, valid, a.prompt_len).items()}  # s̄ (r_max,)
    live = all_scores(model, routers, test, a.prompt_len)
    n = len(test)
    configs = {"static": (static, None),
               "bias only": (model, subsets({m: routers.b[m].expand(n, -1) for m in live}, routers))}
    for beta in a.betas:
        configs[f"beta {beta:g}"] = (model, subsets({m: mean[m] + beta * (s - mean[m]) for m, s in live.items()},
                                                    routers))
    res = vs_static(_score(dense, configs, test, a.prompt_len, 8))
    for name, r in res.items():
        print(f"{name:10s} perplexity {r['perplexity']:8.2f}  top-1 {r['top1_agreement']:.4f}  "
              f"dNLL {r['dnll']:+.4f} ± {r['ci95']:.4f}", flush=True)
    out = Path(a.out or f"bench/results/parse-shrink-{a.base}-x{a.pool_factor:g}-{a.tag}.json")
    write_json(out, dict(base=a.base, tag=a.tag, pool_factor=a.pool_factor, windows=n, prompt_len=a.prompt_len,
                         mean_prompts=len(valid), configs=res))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
