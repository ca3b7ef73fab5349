"""How much can any per-prompt subset gain? End-to-end subset oracles on held-out WikiText-2 (CPU, reference model).

bench/parse.py scores trained routers against static truncation. This asks what the best subset for each window
would give, so that the routers' tie can be read as "nothing to find" or "not found". Each held-out window (the
parse.py protocol: 256 tokens, the first 64 the prompt, the other 192 scored) gets its own K-of-r_max subset of
every matrix, fitted by gradient descent through the straight-through top-K of compress/parse.py (`ste_topk`;
the scores start at the static order, Adam), for one of two objectives:

    continuation  KL(dense || pool) over the very tokens that are scored. No router can see them: this is an
                  oracle, a bound on what choosing a subset per prompt can buy on this model and pool
    prompt        the same KL over the prompt's own next-token predictions (positions 1..63): the best a router
                  could do by fitting the prompt alone, what it sees, with the subset optimized for it directly
    first-half    the same KL over the continuation's first 96 scored tokens, judged on the other 96 (every config
                  is also scored on that second half): does a subset fitted on a stretch of a document help the
                  document's next stretch, i.e. is what it needs a property of the document or of each token?

Each window keeps the iterate with its lowest objective under hard masks (the STE's forward is the hard mask, so
every step's loss is one), static truncation (the start) included: the continuation oracle's KL is never above
static's. The pool is compress/parse.py's `build_pool` (whitening calibrated on WikiText-2 valid, as the
criterion's protocol; its first K components are static truncation exactly).

Usage: python -m rankserve.bench.parse_oracle --base svd-llm --out bench/results/parse-oracle-svd-llm.json
"""

from __future__ import annotations

import argparse
import math
import statistics as st
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rankserve.bench.parse import WIKI_VALID, test_windows
from rankserve.compress.parse import BASES, build_pool, ste_topk
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.model import Transformer
from rankserve.workers.tokenizer import Tokenizer

OBJECTIVES = ("continuation", "prompt", "first-half")


@dataclass
class OracleConfig:
    """The fit of one batch of windows' subsets."""
    steps: int = 60  # Adam steps a batch
    lr: float = 0.02  # on scores that start as the static order scaled to [-1, 0]
    temperature: float = 1.0  # the STE surrogate's T, as router training
    batch: int = 16  # windows fitted together (their losses are independent: a sum)
    prompt_len: int = 64

    def __post_init__(self) -> None:
        if self.steps < 0 or self.lr <= 0 or self.temperature <= 0 or self.batch < 1 or self.prompt_len < 2:
            raise ValueError(f"oracle: steps >= 0, lr > 0, temperature > 0, batch >= 1, prompt_len >= 2 wanted, "
                             f"got {self}")


def window_kl(ref: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(ref || p) over a window's positions, per window: (B,) from log-probs ref (B, T, V) and logits."""
    lp = F.log_softmax(logits, -1)
    return (ref.exp() * (ref - lp)).sum(-1).mean(-1)


def static_masks(k: dict[str, int], r_max: dict[str, int], batch: int) -> dict[str, torch.Tensor]:
    """The first K components of every matrix, (B, r_max) 0/1 a matrix: static truncation."""
    return {n: (torch.arange(r_max[n]) < k[n]).float().expand(batch, -1).clone() for n in k}


def fit(pool: Transformer, x: torch.Tensor, ref: torch.Tensor, span: slice, k: dict[str, int],
        r_max: dict[str, int], cfg: OracleConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Each window's best hard masks for KL(dense || pool) over positions `span` of x (B, S): {proj: (B, r_max)}
    and the best objective a window. ref: the dense log-probs at those positions (B, T, V)."""
    lins = pool.projections()
    B = x.shape[0]
    scores = {n: torch.nn.Parameter(-(torch.arange(r_max[n], dtype=torch.float32) / r_max[n]).expand(B, -1).clone())
              for n in k}
    best = static_masks(k, r_max, B)
    best_loss = torch.full((B,), math.inf)
    opt = torch.optim.Adam(scores.values(), lr=cfg.lr)
    try:
        for _ in range(cfg.steps + 1):  # the last forward only scores the last update
            masks = {n: ste_topk(s, k[n], cfg.temperature) for n, s in scores.items()}
            for n, m in masks.items():
                lins[n].mask = m
            loss = window_kl(ref, pool(x)[:, span])  # (B,): the hard masks' objective, exactly
            better = loss.detach() < best_loss
            best_loss = torch.where(better, loss.detach(), best_loss)
            for n, m in masks.items():
                best[n][better] = m.detach()[better]
            opt.zero_grad(set_to_none=True)
            loss.sum().backward()
            opt.step()
    finally:
        for n in k:
            lins[n].mask = None
    return best, best_loss.tolist()


@torch.no_grad()
def score(pool: Transformer, masks: dict[str, torch.Tensor] | None, x: torch.Tensor, ref: torch.Tensor,
          prompt_len: int, late: int = 0) -> dict[str, list[float]]:
    """Per window, over the continuation (positions prompt_len-1 .. S-2 predicting tokens prompt_len .. S-1): mean
    NLL, top-1 agreements with the dense model, KL(dense || pool); with `late` > 0 the same over the continuation's
    last `late` tokens alone, as late_nll, late_agree, late_kl."""
    lins = pool.projections()
    try:
        for n, m in (masks or {}).items():
            lins[n].mask = m
        lp = F.log_softmax(pool(x)[:, prompt_len - 1:-1], -1)  # (B, T, V)
    finally:
        for n in (masks or {}):
            lins[n].mask = None
    y = x[:, prompt_len:]
    nll = -lp.gather(-1, y[..., None])[..., 0].double()  # (B, T)
    agree = lp.argmax(-1) == ref.argmax(-1)  # (B, T)
    kl = (ref.exp() * (ref - lp)).sum(-1)  # (B, T)
    out = dict(nll=nll.mean(1).tolist(), agree=agree.sum(1).tolist(), kl=kl.mean(1).tolist())
    if late:
        out.update(late_nll=nll[:, -late:].mean(1).tolist(), late_agree=agree[:, -late:].sum(1).tolist(),
                   late_kl=kl[:, -late:].mean(1).tolist())
    return out


def summarize(per: dict[str, dict[str, list[float]]], tokens_a_window: int) -> dict[str, dict]:
    """Perplexity, top-1 agreement, KL and the paired Δ NLL against "static" (mean, 95 % interval) a config."""
    out = {}
    for name, r in per.items():
        d = [a - b for a, b in zip(r["nll"], per["static"]["nll"])]
        n = len(r["nll"])
        out[name] = dict(perplexity=math.exp(sum(r["nll"]) / n), top1_agreement=sum(r["agree"]) / (n * tokens_a_window),
                         kl=sum(r["kl"]) / n, dnll=st.mean(d), ci95=1.96 * st.stdev(d) / math.sqrt(n) if n > 1 else 0.0,
                         windows=n)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_oracle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="svd-llm", choices=BASES)
    ap.add_argument("--model", default="models/reference")
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--pool-factor", type=float, default=2.0)
    ap.add_argument("--calib", default=str(WIKI_VALID),
                    help="whitening calibration text (the criterion's: WikiText-2 valid)")
    ap.add_argument("--windows", type=int, default=0, help="held-out windows to fit (0: all of bench/parse.py's)")
    ap.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES)
    ap.add_argument("--steps", type=int, default=OracleConfig.steps)
    ap.add_argument("--lr", type=float, default=OracleConfig.lr)
    ap.add_argument("--batch", type=int, default=OracleConfig.batch)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    a = ap.parse_args(argv)
    try:
        cfg = OracleConfig(steps=a.steps, lr=a.lr, batch=a.batch)
        if not Path(a.calib).is_file():
            raise ValueError(f"--calib {a.calib}: no such file")
        if a.windows < 0:
            raise ValueError(f"--windows {a.windows}: at least 0")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    tok = Tokenizer.load(a.model)
    dense, _ = load_checkpoint(a.model, "cpu", torch.float32)
    pool, k, r_max = build_pool(a.model, a.base, a.keep, a.calib, a.pool_factor, progress=False)
    pool.requires_grad_(False)
    windows = test_windows(tok)  # the parse.py protocol: (209, 256)
    if a.windows:
        windows = windows[:a.windows]
    S, P = windows.shape[1], cfg.prompt_len
    half = (S - P) // 2  # the continuation's second half: where first-half's fit is judged
    spans = {"continuation": slice(P - 1, S - 1), "prompt": slice(0, P - 1), "first-half": slice(P - 1, S - 1 - half)}
    per: dict[str, dict[str, list[float]]] = {name: {m: [] for m in ("nll", "agree", "kl", "late_nll", "late_agree",
                                                                     "late_kl")}
                                              for name in ["static", *a.objectives]}
    fitted: dict[str, list[float]] = {o: [] for o in a.objectives}
    overlap: dict[str, list[float]] = {o: [] for o in a.objectives}
    for i in tqdm(range(0, len(windows), cfg.batch), desc=f"oracle subsets ({a.base})", unit="batch"):
        x = windows[i:i + cfg.batch]
        with torch.no_grad():
            ref_all = F.log_softmax(dense(x), -1)  # (B, S, V)
        ref = ref_all[:, P - 1:-1]
        static = static_masks(k, r_max, len(x))
        for name, r in score(pool, static, x, ref, P, half).items():
            per["static"][name] += r
        for o in a.objectives:
            masks, best = fit(pool, x, ref_all[:, spans[o]], spans[o], k, r_max, cfg)
            fitted[o] += best
            for name, r in score(pool, masks, x, ref, P, half).items():
                per[o][name] += r
            same = sum((masks[n] * static[n]).sum(1) / k[n] for n in k) / len(k)  # (B,) share of static's picks kept
            overlap[o] += same.tolist()
    res = summarize(per, S - P)
    late = summarize({name: {m[5:]: v for m, v in r.items() if m.startswith("late_")} for name, r in per.items()},
                     half)
    for o in a.objectives:
        res[o]["overlap_with_static"] = st.mean(overlap[o])
        res[o]["fitted_objective_mean"] = st.mean(fitted[o])
    for title, table in (("continuation", res), (f"continuation's last {half} tokens", late)):
        print(f"scored on the {title}:")
        for name, r in table.items():
            extra = f", {r['overlap_with_static']:.3f} of static's picks kept" if "overlap_with_static" in r else ""
            print(f"  {name}: perplexity {r['perplexity']:.2f}, top-1 {r['top1_agreement']:.4f}, KL {r['kl']:.4f}, "
                  f"Δ NLL {r['dnll']:+.4f} ± {r['ci95']:.4f}{extra}")
    if a.out:
        from rankserve.bench.decode import write_json
        write_json(Path(a.out), dict(base=a.base, keep=a.keep, pool_factor=a.pool_factor, calib=Path(a.calib).name,
                                     windows=len(windows), seq_len=S, config=asdict(cfg), results=res,
                                     results_last_half=late,
                                     seconds=round(time.time() - t0, 1),
                                     command="python -m rankserve.bench.parse_oracle "
                                             + " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
