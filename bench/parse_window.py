"""PARSE quality when the whole window is the prompt (the subset routed from the very tokens that are scored).

`bench/parse.py` routes on each window's first 64 tokens and scores the rest (a request that generates). Here
each held-out window is routed on all of its tokens and every token after BOS is scored, as a prefill-time
perplexity evaluation would do; the subset then "sees" the future of every scored position, so this is the
most favourable protocol for PARSE, reported as a bound next to the strict one. Uses the checkpoints that
`bench/parse.py` cached (static and PARSE, reference model, keep 0.6, r_max = 2 K).

Usage: python -m rankserve.bench.parse_window --base svd-llm --tag valid [--seq-len 256] [--max-tokens 40000]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rankserve.bench.decode import write_json
from rankserve.bench.parse import _score, add_cached_args, load_cached, test_windows, vs_static
from rankserve.workers.parse import select_batch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_window", description=__doc__.split("\n\n")[0])
    add_cached_args(ap)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=40000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    loaded = load_cached(a.cache, a.model, a.base, a.tag)
    if loaded is None:
        return 2
    tok, dense, static, model, routers = loaded
    windows = test_windows(tok, a.seq_len, a.max_tokens)
    with torch.inference_mode():
        subsets = [s for i in range(0, len(windows), 8) for s in select_batch(model, routers, windows[i:i + 8])]
        res = _score(dense, {"static": (static, None), "parse (whole-window routing)": (model, subsets)},
                     windows, 1, 8)
    d = vs_static(res)["parse (whole-window routing)"]
    paired = dict(mean=d["dnll"], ci95=d["ci95"], windows=len(windows))
    for name, r in res.items():
        print(f"{name}: perplexity {r['perplexity']:.2f}, top-1 agreement {r['top1_agreement']:.4f}, "
              f"KL {r['kl']:.4f}, {r['tokens']} tokens")
    print(f"paired Δ NLL (PARSE − static) {paired['mean']:+.4f} ± {paired['ci95']:.4f} over {paired['windows']} windows")
    if a.out:
        write_json(Path(a.out), dict(base=a.base, tag=a.tag, seq_len=a.seq_len, paired=paired,
                                     results={k: {m: v for m, v in r.items() if m != "window_nll"}
                                              for k, r in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
