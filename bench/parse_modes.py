"""Can a per-token choice among a few fixed subsets keep what choosing single components per token gains? (CPU)

bench/parse_pertoken.py found that choosing each token's K components one by one (by output energy |c_i| ||u_i||,
from c = V x over the whole pool) beats static truncation at the same K by a wide margin, while choosing them in
blocks of consecutive components keeps little of it; and bench/select_probe.py found no GPU loop that turns a
component-by-component choice into time. A choice among M *fixed* subsets (modes) would run as static truncation
does: a shared head of K - t components, then one of M tails of t components, each stored contiguously, so a token
reads exactly K components of V and of U, wherever its choice lands. The question is whether M tails fitted offline
can hold what each token would pick.

The modes of each matrix are fitted on WikiText-2 valid (not the scored text): the head is the first K - t
components (static's own), the tails are chosen among the pool's other components by a Lloyd iteration on the
tokens' tail energies (assign each token to the tail holding most of its energy; make each tail the t components of
largest summed energy over its tokens). Tail 0 starts as static's last t components. Configs:

    static         the first K components (static truncation; the criterion's baseline)
    modes-oracle   per token and matrix, the tail that holds most of the token's energy, from c over the pool:
                   an upper bound for any mode selector (reading V at the pool would cost what per-token choice does)
    modes-sketch   the same argmax, with each tail's energy estimated from a rank-s sketch of its quadratic form
                   (||S_m x||^2 + b_m, S_m (s, in): the top s directions of that tail's energy over the fitting
                   tokens, b_m the mean energy they miss there), so choosing reads M s extra rows of V, not the pool
    token-energy   the K components of largest energy per token (parse_pertoken's, for reference)

Scored as bench/parse_oracle.py scores (teacher-forced continuation after a 64-token prompt, against the dense
model): perplexity, top-1 agreement, KL and the paired per-window Δ NLL against static.

Usage: python -m rankserve.bench.parse_modes --base svd-llm --out bench/results/parse-modes-svd-llm.json
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rankserve.bench.parse import WIKI_VALID, _windows, test_windows
from rankserve.bench.parse_oracle import summarize
from rankserve.bench.parse_pertoken import record_inputs, restore, score_configs, token_topk
from rankserve.compress.parse import BASES, build_pool
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.model import FactorizedLinear, Transformer
from rankserve.workers.tokenizer import Tokenizer

CONFIGS = ("static", "modes-oracle", "modes-sketch", "token-energy")


@dataclass
class Modes:
    """One matrix's modes: a shared head of `head` components, M tails of t pool components each."""
    head: int
    tails: torch.Tensor  # (M, t) int64 component indices, each >= head
    sketch: torch.Tensor | None = None  # (M, s, in): ||sketch[m] x||^2 + bias[m] estimates tail m's energy
    bias: torch.Tensor | None = None  # (M,): each tail's mean energy outside its sketch, over the fitting tokens

    def masks(self, r_max: int) -> torch.Tensor:
        """(M, r_max) 0/1: the head plus each tail."""
        m = torch.zeros(self.tails.shape[0], r_max)
        m[:, :self.head] = 1.0
        return m.scatter_(1, self.tails, 1.0)


def fit_modes(e2: torch.Tensor, head: int, t: int, modes: int, iters: int = 10) -> torch.Tensor:
    """Tails (modes, t) over the components >= head from the tokens' squared energies e2 (N, r_max): a Lloyd
    iteration that assigns each token to the tail holding most of its energy and refits each tail as the t
    components of largest summed energy over its tokens. Tail 0 starts as static's last t components; each further
    tail starts from the tokens the tails so far serve worst."""
    cand = e2[:, head:]  # (N, C)
    C = cand.shape[1]
    if t < 1 or t > C:
        raise ValueError(f"tail of {t} components: 1..{C} wanted")
    tails = [torch.arange(t)]
    for _ in range(1, modes):
        have = torch.stack([cand[:, s].sum(1) for s in tails], 1).amax(1)  # (N,)
        worst = (cand.sum(1) - have).topk(max(1, len(cand) // modes)).indices
        tails.append(cand[worst].sum(0).topk(t).indices)
    tails_t = torch.stack(tails)  # (M, t)
    for _ in range(iters):
        onehot = torch.zeros(modes, C).scatter_(1, tails_t, 1.0)
        assign = (cand @ onehot.T).argmax(1)  # (N,)
        new = []
        for m in range(modes):
            mine = cand[assign == m]
            new.append(mine.sum(0).topk(t).indices if len(mine) else tails_t[m])
        new_t = torch.stack(new)
        if torch.equal(new_t.sort(1).values, tails_t.sort(1).values):
            break
        tails_t = new_t
    return tails_t.sort(1).values + head


def fit_sketch(lin: FactorizedLinear, x: torch.Tensor, tails: torch.Tensor,
               s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sketch (M, s, in) and bias (M,): for each tail, the s directions of its energy ||P x||^2 (P = diag(||u_i||)
    V_tail) that carry most of it over the fitting inputs x (N, in), and the mean energy they miss there, so that
    ||S x||^2 + bias estimates the tail's energy without a tail favoured for being easier to sketch."""
    unorm = lin.U.norm(dim=0)
    out, bias = [], []
    for tail in tails:
        P = unorm[tail, None] * lin.V[tail]  # (t, in)
        Y = x @ P.T  # (N, t)
        _, _, vh = torch.linalg.svd(Y, full_matrices=False)  # vh (t, t): directions in tail space
        S = vh[:s] @ P  # (s, in)
        out.append(S)
        bias.append((Y.pow(2).sum(1) - (x @ S.T).pow(2).sum(1)).mean())
    return torch.stack(out), torch.stack(bias)


def mode_forward(lin: FactorizedLinear, x: torch.Tensor, md: Modes, masks: torch.Tensor, sketch: bool,
                 counts: torch.Tensor) -> torch.Tensor:
    """y = U (m ⊙ V x) with m, per token, the head plus the tail chosen by true (or sketched) energy."""
    c = F.linear(x, lin.V)  # (..., r_max)
    if sketch:
        score_m = torch.einsum("msi,...i->...ms", md.sketch, x).pow(2).sum(-1) + md.bias  # (..., M)
    else:
        score_m = ((c * lin.U.norm(dim=0)) ** 2) @ masks.T  # (..., M); the head is common to all
    pick = score_m.argmax(-1)  # (...,)
    counts += torch.bincount(pick.flatten(), minlength=len(masks)).to(counts.dtype)
    return F.linear(c * masks[pick], lin.U)


@torch.no_grad()
def fit_all(pool: Transformer, k: dict[str, int], windows: torch.Tensor, tail_frac: float, modes: int, s: int,
            batch: int = 8) -> dict[str, Modes]:
    """Every routed matrix's modes (and sketches) from its inputs over `windows` run through the whole pool."""
    lins = pool.projections()
    out = {}
    for n, x in tqdm(record_inputs(pool, k, windows, batch).items(), total=len(k), desc="fitting modes",
                     unit="matrix"):
        lin = lins[n]
        t = max(1, round(k[n] * tail_frac))
        e2 = (F.linear(x, lin.V) * lin.U.norm(dim=0)) ** 2
        tails = fit_modes(e2, k[n] - t, t, modes)
        out[n] = Modes(k[n] - t, tails, *(fit_sketch(lin, x, tails, s) if s else ()))
    return out


@contextmanager
def selection(pool: Transformer, config: str, k: dict[str, int], modes: dict[str, Modes],
              counts: dict[str, torch.Tensor]) -> Iterator[None]:
    lins = pool.projections()
    try:
        for n in k:
            lin = lins[n]
            if config == "static":
                lin.live = k[n]
            elif config == "token-energy":
                lin.forward = lambda x, lin=lin, kn=k[n]: token_topk(lin, x, kn)
            elif config in ("modes-oracle", "modes-sketch"):
                md = modes[n]
                masks = md.masks(lin.rank)
                cnt = counts.setdefault(f"{config}:{n}", torch.zeros(len(masks)))
                lin.forward = lambda x, lin=lin, md=md, mk=masks, sk=config == "modes-sketch", cn=cnt: \
                    mode_forward(lin, x, md, mk, sk, cn)
            else:
                raise ValueError(f"unknown config {config!r}; choose from {', '.join(CONFIGS)}")
        yield
    finally:
        restore(lins, k)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_modes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="svd-llm", choices=BASES)
    ap.add_argument("--model", default="models/reference")
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--pool-factor", type=float, default=2.0)
    ap.add_argument("--calib", default=str(WIKI_VALID), help="whitening calibration and mode-fitting text")
    ap.add_argument("--windows", type=int, default=0, help="held-out windows (0: all 157 of test_windows)")
    ap.add_argument("--fit-windows", type=int, default=32, help="WikiText-2 valid windows fitting the modes")
    ap.add_argument("--modes", type=int, default=8, help="tails a matrix")
    ap.add_argument("--tail", type=float, default=0.25, help="a tail's share of K")
    ap.add_argument("--sketch", type=int, default=4, help="sketch rows a tail (modes-sketch)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    a = ap.parse_args(argv)
    if not Path(a.calib).is_file():
        print(f"error: --calib {a.calib}: no such file", file=sys.stderr)
        return 2
    if a.windows < 0 or min(a.batch, a.fit_windows, a.modes, a.sketch) < 1 or not 0 < a.tail <= 1:
        print("error: --windows >= 0; --batch, --fit-windows, --modes, --sketch >= 1; 0 < --tail <= 1 wanted",
              file=sys.stderr)
        return 2
    t0 = time.time()
    tok = Tokenizer.load(a.model)
    dense, _ = load_checkpoint(a.model, "cpu", torch.float32)
    pool, k, r_max = build_pool(a.model, a.base, a.keep, a.calib, a.pool_factor, progress=False)
    configs = ["static", *[c for c in a.configs if c != "static"]]
    fit = _windows(Path(a.calib).read_text(encoding="utf-8", errors="replace"), tok, 256, a.fit_windows)
    modes = fit_all(pool, k, fit, a.tail, a.modes, a.sketch)
    windows = test_windows(tok)
    if a.windows:
        windows = windows[:a.windows]
    P, S = 64, windows.shape[1]
    counts: dict[str, torch.Tensor] = {}
    per = score_configs(pool, dense, windows, configs, lambda c: selection(pool, c, k, modes, counts), a.batch,
                        f"modes ({a.base})", P)
    res = summarize(per, S - P)
    lins = pool.projections()
    static_w = sum((lins[n].in_features + lins[n].out_features) * r for n, r in k.items())
    sketch_w = sum(lins[n].in_features * a.modes * a.sketch for n in k)
    for c, r in res.items():
        r["decode_weights_vs_static"] = {"static": 1.0, "modes-sketch": 1 + sketch_w / static_w,
                                         "modes-oracle": None, "token-energy": None}[c]
        for cfg in ("modes-oracle", "modes-sketch"):
            if c == cfg:  # how evenly the tokens spread over the tails, averaged over the matrices
                shares = [v / v.sum() for key, v in counts.items() if key.startswith(cfg + ":")]
                r["largest_mode_share"] = float(sum(float(s.max()) for s in shares) / len(shares))
                r["mode0_share"] = float(sum(float(s[0]) for s in shares) / len(shares))
        print(f"{c}: perplexity {r['perplexity']:.2f}, top-1 {r['top1_agreement']:.4f}, KL {r['kl']:.4f}, "
              f"Δ NLL {r['dnll']:+.4f} ± {r['ci95']:.4f}"
              + (f", largest mode {r['largest_mode_share']:.2f}, mode 0 {r['mode0_share']:.2f}"
                 if "mode0_share" in r else ""))
    if a.out:
        from rankserve.bench.decode import write_json
        write_json(Path(a.out), dict(base=a.base, keep=a.keep, pool_factor=a.pool_factor, calib=Path(a.calib).name,
                                     modes=a.modes, tail=a.tail, sketch=a.sketch, fit_windows=a.fit_windows,
                                     windows=len(windows), seq_len=S, prompt_len=P, results=res,
                                     seconds=round(time.time() - t0, 1),
                                     command="python -m rankserve.bench.parse_modes "
                                             + " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
