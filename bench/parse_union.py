"""Routing a batch together: how much smaller the union gets, and what it costs in quality (reference model, CPU).

At B > 1 a decode step reads the union of the batch's subsets (workers/parse_decode.py), so its cost follows
|union| / K (H200, B = 8: 1.08x static at a union of 1.04 K, 1.15x at 1.15 K; parse-log.md). `select_together`
(workers/parse_batching.py) adds to every request's standardized router scores `pull` x the fraction of the batch
whose own top-K holds the component. This bench routes WikiText-2 test windows in batches of B consecutive windows
(prompt = the first `prompt_len` tokens), for each pull reports the mean union / K over batches and matrices and
scores the continuation against the dense model as bench/parse.py does, next to static truncation.

Usage: python -m rankserve.bench.parse_union --base svd-llm --tag valid+train --pulls 0 0.5 1 2 4 [--out F]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rankserve.bench.decode import write_json
from rankserve.bench.parse import _score, add_cached_args, load_cached, test_windows, vs_static
from rankserve.workers.parse import route_scores
from rankserve.workers.parse_batching import membership, select_together, union_over_k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_union", description=__doc__.split("\n\n")[0])
    add_cached_args(ap, tag="valid+train")
    ap.add_argument("--pulls", nargs="+", type=float, default=[0.0, 0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=40000, help="scored text: this many tokens in 256-token windows")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    loaded = load_cached(a.cache, a.model, a.base, a.tag)
    if loaded is None:
        return 2
    tok, dense, static, model, routers = loaded
    windows = test_windows(tok, 256, a.max_tokens)
    subsets: dict[float, list[dict]] = {p: [] for p in a.pulls}
    with torch.inference_mode():
        for i in range(0, len(windows), a.batch):
            scores = route_scores(model, routers, windows[i:i + a.batch, :a.prompt_len])
            for p in a.pulls:
                subsets[p] += select_together(scores, routers, p)
    groups = [list(range(i, min(i + a.batch, len(windows)))) for i in range(0, len(windows), a.batch)]
    unions = {p: union_over_k(membership(s, routers), routers, groups) for p, s in subsets.items()}
    configs = {"static": (static, None)}
    configs.update({f"pull {p:g}": (model, s) for p, s in subsets.items()})
    res = _score(dense, configs, windows, a.prompt_len, a.batch)
    out = vs_static(res)
    for name, o in out.items():
        pull = None if name == "static" else float(name.split()[1])
        o["union_over_k"] = 1.0 if pull is None else unions[pull]
        print(f"{name:10s} union/K {o['union_over_k']:.3f}  perplexity {o['perplexity']:.2f}  "
              f"top-1 {o['top1_agreement']:.4f}  ΔNLL vs static {o['dnll']:+.4f} ± {o['ci95']:.4f}", flush=True)
    if a.out:
        write_json(Path(a.out), dict(base=a.base, tag=a.tag, batch=a.batch, prompt_len=a.prompt_len,
                                     windows=len(windows), results=out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
