"""Does choosing the K components per token help where choosing them per prompt did not? (CPU, reference model)

bench/parse_oracle.py found that a subset fitted to a window's scored tokens halves the KL to the dense model,
while a subset fitted to the prompt (or to the continuation's first half) does not help the rest: what the tokens
need is specific to each token. This measures the simplest per-token choice there is, on the same held-out
WikiText-2 windows and the same pool (compress/parse.py `build_pool`, whitening on WikiText-2 valid, r_max = 2 K):

    static         the first K components of every matrix (static truncation; the criterion's baseline)
    token-energy   for each token and matrix, the K components with the largest output energy |c_i| ||u_i||,
                   c = V x over all r_max components: the exact per-token layer-local optimum when U's columns are
                   orthogonal (SVD-LLM's are), a greedy one otherwise (Basis Sharing's per-member U). It needs V x
                   at r_max, so at decode it reads r_max in + K out weights a matrix, not K (in + out)
    token-threshold  per token, the components whose energy clears a per-matrix threshold, set on WikiText-2 valid
                   (not the scored text) so that K are kept on average: what a kernel can do without a top-K
                   across the whole rank (each U tile decides for its own components); reads K columns of U on
                   average, a count that varies by token (reported)
    token-block    token-energy in blocks of `--block` consecutive components (the round(K / block) blocks of largest
                   summed squared energy): what a GPU kernel can skip in U's rows of [out, r] storage, where one
                   component is 2 bytes of each row and a 128-byte line holds 64
    static-bytes   static truncation at the rank that reads the same bytes at decode as token-energy:
                   r' = (r_max in + K out) / (in + out), capped at r_max
    pool           all r_max components (the pool's own quality)
    reroute-N      re-route every N tokens from the past: positions are cut into blocks of N from the window's start,
                   and every token of block b keeps the K components of largest summed squared energy over block
                   b - 1's tokens (block 0: static's first K). The most favourable closed form of the engine's
                   `reroute_every` (it re-runs the prompt's routers on the whole history): the choice follows the
                   latest tokens, with no router in between. A kernel would read V at r_max once per N tokens on
                   the block's stored inputs and K components of V and U at every other step (`--every`)

Scored as bench/parse_oracle.py scores (teacher-forced continuation after a 64-token prompt, against the dense
model): perplexity, top-1 agreement, KL and the paired per-window Δ NLL against static.

Usage: python -m rankserve.bench.parse_pertoken --base svd-llm --out bench/results/parse-pertoken-svd-llm.json
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rankserve.bench.parse import WIKI_VALID, _windows, test_windows
from rankserve.bench.parse_oracle import score, summarize
from rankserve.compress.parse import BASES, build_pool
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.model import FactorizedLinear, Transformer
from rankserve.workers.tokenizer import Tokenizer

CONFIGS = ("static", "token-energy", "token-threshold", "token-block", "static-bytes", "pool")


def token_topk(lin: FactorizedLinear, x: torch.Tensor, k: int) -> torch.Tensor:
    """y = U (m ⊙ V x) with m, per token, the k components of largest |c_i| ||u_i||: x (..., in) -> (..., out)."""
    c = F.linear(x, lin.V)  # (..., r_max)
    energy = c.abs() * lin.U.norm(dim=0)  # (..., r_max)
    keep = torch.zeros_like(c).scatter_(-1, energy.topk(k, dim=-1).indices, 1.0)
    return F.linear(c * keep, lin.U)


def token_rerouted(lin: FactorizedLinear, x: torch.Tensor, k: int, every: int) -> torch.Tensor:
    """y = U (m ⊙ V x), m the same for every token of a block of `every` positions: the k components of largest
    summed |c_i|^2 ||u_i||^2 over the previous block's tokens (the first block: components 0..k-1, static's).
    x (B, S, in) -> (B, S, out); blocks start at position 0."""
    c = F.linear(x, lin.V)  # (B, S, r_max)
    B, S, r = c.shape
    nb = -(-S // every)
    e2 = F.pad((c * lin.U.norm(dim=0)) ** 2, (0, 0, 0, nb * every - S))  # (B, nb * every, r_max)
    past = e2.unflatten(1, (nb, every)).sum(2)[:, :-1]  # (B, nb - 1, r_max): each block's summed energies
    first = torch.zeros(B, 1, r, dtype=c.dtype)
    first[..., :k] = 1.0
    later = torch.zeros_like(past).scatter_(-1, past.topk(k, dim=-1).indices, 1.0)  # block b + 1's mask
    keep = torch.cat([first, later], 1).repeat_interleave(every, 1)[:, :S]  # (B, S, r_max)
    return F.linear(c * keep, lin.U)


def token_blocks(lin: FactorizedLinear, x: torch.Tensor, k: int, block: int) -> torch.Tensor:
    """y = U (m ⊙ V x) with m, per token, the round(k / block) blocks of `block` consecutive components of largest
    summed |c_i|^2 ||u_i||^2 (the last block may be short): x (..., in) -> (..., out)."""
    c = F.linear(x, lin.V)  # (..., r_max)
    r = c.shape[-1]
    nb = -(-r // block)
    e2 = F.pad((c * lin.U.norm(dim=0)) ** 2, (0, nb * block - r))  # (..., nb * block)
    top = e2.unflatten(-1, (nb, block)).sum(-1).topk(min(nb, max(1, round(k / block))), dim=-1).indices
    keep = torch.zeros(*c.shape[:-1], nb, dtype=c.dtype).scatter_(-1, top, 1.0)
    return F.linear(c * keep.repeat_interleave(block, -1)[..., :r], lin.U)


def token_threshold(lin: FactorizedLinear, x: torch.Tensor, tau: float, kept: list[float]) -> torch.Tensor:
    """y = U (m ⊙ V x) with m, per token, the components of |c_i| ||u_i|| >= tau; appends the mean kept count."""
    c = F.linear(x, lin.V)  # (..., r_max)
    keep = (c.abs() * lin.U.norm(dim=0) >= tau).to(c.dtype)
    kept.append(float(keep.sum(-1).mean()))
    return F.linear(c * keep, lin.U)


@torch.no_grad()
def record_inputs(pool: Transformer, names: Iterable[str], windows: torch.Tensor,
                  batch: int = 8) -> dict[str, torch.Tensor]:
    """Each named projection's inputs (N, in), every token of `windows` (n, S) run through the whole pool."""
    lins = pool.projections()
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}

    def record(x: torch.Tensor, lin: FactorizedLinear, n: str) -> torch.Tensor:
        seen[n].append(x.reshape(-1, x.shape[-1]))
        return F.linear(F.linear(x, lin.V), lin.U)

    try:
        for n in seen:
            lins[n].forward = lambda x, lin=lins[n], n=n: record(x, lin, n)
        for i in range(0, len(windows), batch):
            pool(windows[i:i + batch])
    finally:
        restore(lins, seen)
    return {n: torch.cat(v) for n, v in seen.items()}


@torch.no_grad()
def calibrate_thresholds(pool: Transformer, k: dict[str, int], windows: torch.Tensor,
                         batch: int = 8) -> dict[str, float]:
    """Per routed matrix, the energy threshold that keeps k of its r_max components per token on average over
    `windows` (n, S), run through the whole pool."""
    lins = pool.projections()
    out = {}
    for n, x in record_inputs(pool, k, windows, batch).items():
        e = (F.linear(x, lins[n].V).abs() * lins[n].U.norm(dim=0)).flatten()  # every token's energies
        drop = round(len(e) * (1 - k[n] / lins[n].rank))  # the energies below the threshold
        out[n] = float(e.kthvalue(drop).values) if drop else 0.0
    return out


def restore(lins: dict[str, FactorizedLinear], names: Iterable[str]) -> None:
    """Undo a selection: the named projections back to all their components and their own forward."""
    for n in names:
        lins[n].live = None
        lins[n].__dict__.pop("forward", None)


@torch.no_grad()
def score_configs(pool: Transformer, dense: Transformer, windows: torch.Tensor, configs: list[str],
                  select: Callable[[str], ContextManager], batch: int, desc: str,
                  prompt_len: int = 64) -> dict[str, dict[str, list[float]]]:
    """Per config, the per-window scores of parse_oracle.score (nll, agree, kl) with `select(config)` applied,
    windows (n, S) taken `batch` at a time against the dense model's log-probabilities."""
    per: dict[str, dict[str, list[float]]] = {c: {"nll": [], "agree": [], "kl": []} for c in configs}
    for i in tqdm(range(0, len(windows), batch), desc=desc, unit="batch"):
        x = windows[i:i + batch]
        ref = F.log_softmax(dense(x), -1)[:, prompt_len - 1:-1]
        for c in configs:
            with select(c):
                for m, v in score(pool, None, x, ref, prompt_len).items():
                    per[c][m] += v
    return per


def bytes_matched_rank(lin: FactorizedLinear, k: int) -> int:
    """Static rank reading as many weights at decode as token-energy's r_max rows of V plus k columns of U."""
    n_in, n_out, r_max = lin.in_features, lin.out_features, lin.rank
    return min(r_max, round((r_max * n_in + k * n_out) / (n_in + n_out)))


@contextmanager
def selection(pool: Transformer, config: str, k: dict[str, int], tau: dict[str, float] | None = None,
              kept: dict[str, list[float]] | None = None, block: int = 8) -> Iterator[None]:
    """Run every routed projection of `pool` with `config`'s choice of components (see the module doc);
    token-threshold takes the thresholds `tau` and appends each call's mean kept count to kept[name]."""
    lins = pool.projections()
    try:
        for n, lin in ((n, lins[n]) for n in k):
            if config == "static":
                lin.live = k[n]
            elif config == "static-bytes":
                lin.live = bytes_matched_rank(lin, k[n])
            elif config == "token-energy":
                lin.forward = lambda x, lin=lin, kn=k[n]: token_topk(lin, x, kn)
            elif config == "token-block":
                lin.forward = lambda x, lin=lin, kn=k[n]: token_blocks(lin, x, kn, block)
            elif config == "token-threshold":
                if tau is None or kept is None:
                    raise ValueError("token-threshold needs thresholds and a kept-count record")
                lin.forward = lambda x, lin=lin, t=tau[n], rec=kept.setdefault(n, []): token_threshold(lin, x, t, rec)
            elif config.startswith("reroute-") and config[8:].isdigit() and int(config[8:]) >= 1:
                lin.forward = lambda x, lin=lin, kn=k[n], e=int(config[8:]): token_rerouted(lin, x, kn, e)
            elif config != "pool":
                raise ValueError(f"unknown config {config!r}; choose from {', '.join(CONFIGS)} or reroute-N")
        yield
    finally:
        restore(lins, k)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_pertoken", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="svd-llm", choices=BASES)
    ap.add_argument("--model", default="models/reference")
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--pool-factor", type=float, default=2.0)
    ap.add_argument("--calib", default=str(WIKI_VALID), help="whitening calibration text (the criterion's)")
    ap.add_argument("--windows", type=int, default=0, help="held-out windows (0: all 157 of test_windows)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--calib-windows", type=int, default=32, help="WikiText-2 valid windows setting the thresholds")
    ap.add_argument("--block", type=int, default=8, help="token-block's components a block")
    ap.add_argument("--every", type=int, nargs="*", default=[], help="add reroute-N configs for these N")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    a = ap.parse_args(argv)
    if not Path(a.calib).is_file():
        print(f"error: --calib {a.calib}: no such file", file=sys.stderr)
        return 2
    if a.windows < 0 or a.batch < 1 or a.calib_windows < 1 or a.block < 1 or any(n < 1 for n in a.every):
        print("error: --windows >= 0, --batch, --calib-windows, --block and every --every >= 1 wanted", file=sys.stderr)
        return 2
    t0 = time.time()
    tok = Tokenizer.load(a.model)
    dense, _ = load_checkpoint(a.model, "cpu", torch.float32)
    pool, k, r_max = build_pool(a.model, a.base, a.keep, a.calib, a.pool_factor, progress=False)
    configs = ["static", *[c for c in a.configs if c != "static"], *[f"reroute-{n}" for n in a.every]]
    tau = calibrate_thresholds(pool, k, _windows(Path(a.calib).read_text(encoding="utf-8", errors="replace"), tok,
                                                 256, a.calib_windows)) if "token-threshold" in configs else None
    kept: dict[str, list[float]] = {}
    windows = test_windows(tok)
    if a.windows:
        windows = windows[:a.windows]
    P, S = 64, windows.shape[1]
    per = score_configs(pool, dense, windows, configs, lambda c: selection(pool, c, k, tau, kept, a.block), a.batch,
                        f"per-token selection ({a.base})", P)
    res = summarize(per, S - P)
    lins = pool.projections()
    weights = {"static": sum((lins[n].in_features + lins[n].out_features) * r for n, r in k.items())}
    weights["token-energy"] = sum(lins[n].in_features * r_max[n] + lins[n].out_features * k[n] for n in k)
    weights["static-bytes"] = sum((lins[n].in_features + lins[n].out_features) * bytes_matched_rank(lins[n], k[n])
                                  for n in k)
    if kept:  # U columns read on average: the kept count, each matrix weighted as its calls
        weights["token-threshold"] = sum(lins[n].in_features * r_max[n] + lins[n].out_features * sum(v) / len(v)
                                         for n, v in kept.items())
        res["token-threshold"]["kept_vs_k"] = sum(sum(v) / len(v) / k[n] for n, v in kept.items()) / len(kept)
    weights["token-block"] = sum(lins[n].in_features * r_max[n] + lins[n].out_features
                                 * min(r_max[n], max(1, round(k[n] / a.block)) * a.block) for n in k)
    weights["pool"] = sum((lins[n].in_features + lins[n].out_features) * r_max[n] for n in k)
    for e in a.every:  # K of V and U a step, plus V at r_max once a block (on the block's stored inputs)
        weights[f"reroute-{e}"] = weights["static"] + sum(lins[n].in_features * r_max[n] for n in k) / e
    for c, r in res.items():
        r["decode_weights_vs_static"] = weights[c] / weights["static"]
        extra = f", kept {r['kept_vs_k']:.3f} K on average" if "kept_vs_k" in r else ""
        print(f"{c}: perplexity {r['perplexity']:.2f}, top-1 {r['top1_agreement']:.4f}, KL {r['kl']:.4f}, "
              f"Δ NLL {r['dnll']:+.4f} ± {r['ci95']:.4f}, weights read at decode "
              f"{r['decode_weights_vs_static']:.3f}×{extra}")
    if a.out:
        from rankserve.bench.decode import write_json
        write_json(Path(a.out), dict(base=a.base, keep=a.keep, pool_factor=a.pool_factor, calib=Path(a.calib).name,
                                     windows=len(windows), seq_len=S, prompt_len=P, results=res,
                                     seconds=round(time.time() - t0, 1),
                                     command="python -m rankserve.bench.parse_pertoken "
                                             + " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
