"""One K-of-r_max subset for every prompt, chosen by what the loss is sensitive to: is there a better fixed subset than
static truncation's first K (the base's whitened order)? If there were, a router's bias alone could take it.

Every matrix's subset is scored on WikiText-2 valid windows (the calibration text; the first `--windows`) with the
pool at static's masks, from the gradient of KL(dense || pool) with respect to a per-token mask m (B, S, r_max)
that multiplies each component's coefficient (m = 1 on static's K, 0 beyond): g = dKL/dm is the first-order change of
the loss from switching that component on (off components) or off (minus, on components), at that token.

    static       components 0..K-1
    energy       the K of largest summed output energy, sum over tokens of (v_i . x)^2 ||u_i||^2 (the base's
                 order, re-measured on these windows)
    fisher       the K of largest sum g^2 (the squared per-token sensitivity, a diagonal empirical Fisher)
    first-order  the K of smallest sum g (the linearised loss is lowest): the KD stage's first gradient, taken whole
    swap-N       static with N swaps a matrix: the N kept components of largest sum g out, the N dropped ones of
                 smallest sum g in (the first-order choice, a step at a time)

Scored as bench/parse_oracle.py scores (teacher-forced continuation after a 64-token prompt, against the dense
model) on WikiText-2 valid's last `--dev` windows (not used for the scores) and on the test slice the other quality
benches use (`test_windows`).

Usage: python -m rankserve.bench.parse_fixed --base svd-llm --out bench/results/parse-fixed-svd-llm.json
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rankserve.bench.parse import WIKI_VALID, _windows, test_windows
from rankserve.bench.parse_oracle import summarize
from rankserve.bench.parse_pertoken import score_configs
from rankserve.compress.parse import BASES, build_pool
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.model import FactorizedLinear, Transformer
from rankserve.workers.tokenizer import Tokenizer

SCORES = ("energy", "fisher", "first-order")


def sensitivities(pool: Transformer, dense: Transformer, k: dict[str, int], windows: torch.Tensor,
                  batch: int = 8) -> dict[str, dict[str, torch.Tensor]]:
    """{score: {proj: (r_max,) float64}} over windows (n, S): "energy" sum (v_i.x)^2 ||u_i||^2, "grad" sum g and
    "fisher" sum g^2, g = dKL(dense || pool)/dm per token at static's masks (module docstring). Leaves the pool's
    forwards as they were."""
    lins = pool.projections()
    out = {s: {n: torch.zeros(lins[n].rank, dtype=torch.float64) for n in k} for s in ("energy", "grad", "fisher")}
    held: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def masked(n: str, lin: FactorizedLinear):
        def forward(h: torch.Tensor) -> torch.Tensor:
            c = F.linear(h, lin.V)  # (B, S, r_max)
            m = (torch.arange(c.shape[-1]) < k[n]).to(c.dtype).expand_as(c).clone().requires_grad_(True)
            held[n] = (m, c.detach())
            return F.linear(c * m, lin.U)
        return forward

    try:
        for n in k:
            lins[n].forward = masked(n, lins[n])
        for i in tqdm(range(0, len(windows), batch), desc="sensitivities", unit="batch"):
            x = windows[i:i + batch]
            with torch.no_grad():
                ref = F.log_softmax(dense(x), -1)  # (B, S, V)
            lp = F.log_softmax(pool(x), -1)
            (ref.exp() * (ref - lp)).sum(-1).mean().backward()
            for n, (m, c) in held.items():
                g = m.grad.double()  # (B, S, r_max)
                out["grad"][n] += g.sum((0, 1))
                out["fisher"][n] += (g ** 2).sum((0, 1))
                out["energy"][n] += ((c.double() * lins[n].U.detach().norm(dim=0).double()) ** 2).sum((0, 1))
            held.clear()
    finally:
        for n in k:
            lins[n].__dict__.pop("forward", None)  # back to the class's forward
    return out


def fixed_masks(sens: dict[str, dict[str, torch.Tensor]], k: dict[str, int], r_max: dict[str, int],
                config: str) -> dict[str, torch.Tensor]:
    """{proj: (r_max,) 0/1} for a config of the module docstring."""
    masks = {}
    for n in k:
        m = (torch.arange(r_max[n]) < k[n]).float()
        if config in SCORES:
            s = -sens["grad"][n] if config == "first-order" else sens[config][n]
            m = torch.zeros(r_max[n])
            m[s.topk(k[n]).indices] = 1.0
        elif config.startswith("swap-"):
            g, swaps = sens["grad"][n], min(int(config[5:]), k[n], r_max[n] - k[n])
            m[g[:k[n]].topk(swaps).indices] = 0.0
            m[k[n] + (-g[k[n]:]).topk(swaps).indices] = 1.0
        elif config != "static":
            raise ValueError(f"unknown config {config!r}")
        masks[n] = m
    return masks


@contextmanager
def applied(pool: Transformer, masks: dict[str, torch.Tensor]) -> Iterator[None]:
    """The pool with one fixed subset {proj: (r_max,) 0/1} for every row, as a (1, r_max) mask that broadcasts."""
    lins = pool.projections()
    try:
        for n, m in masks.items():
            lins[n].mask = m[None]
        yield
    finally:
        for n in masks:
            lins[n].mask = None


def evaluate(pool: Transformer, dense: Transformer, windows: torch.Tensor, configs: dict[str, dict[str, torch.Tensor]],
             prompt_len: int, batch: int, desc: str) -> dict[str, dict]:
    per = score_configs(pool, dense, windows, list(configs), lambda c: applied(pool, configs[c]), batch, desc,
                        prompt_len)
    return summarize(per, windows.shape[1] - prompt_len)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_fixed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="svd-llm", choices=BASES)
    ap.add_argument("--model", default="models/reference")
    ap.add_argument("--keep", type=float, default=0.6)
    ap.add_argument("--pool-factor", type=float, default=2.0)
    ap.add_argument("--calib", default=str(WIKI_VALID), help="calibration text; its windows also give the scores")
    ap.add_argument("--windows", type=int, default=480, help="calibration-text windows of 256 the scores are summed on")
    ap.add_argument("--dev", type=int, default=160, help="the calibration text's last windows, scored (not summed on)")
    ap.add_argument("--test-windows", type=int, default=0, help="test windows scored (0: all of test_windows)")
    ap.add_argument("--swaps", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    a = ap.parse_args(argv)
    if not Path(a.calib).is_file():
        print(f"error: --calib {a.calib}: no such file", file=sys.stderr)
        return 2
    if a.windows < 1 or a.dev < 1 or a.test_windows < 0 or a.batch < 1 or any(s < 1 for s in a.swaps):
        print("error: --windows, --dev, --batch and every --swaps >= 1, --test-windows >= 0 wanted", file=sys.stderr)
        return 2
    t0 = time.time()
    tok = Tokenizer.load(a.model)
    text = Path(a.calib).read_text(encoding="utf-8", errors="replace")
    every = _windows(text, tok, 256, len(tok.encode(text, bos=False)) // 255)  # (n, 256)
    if a.windows + a.dev > len(every):
        print(f"error: {a.calib} gives {len(every)} windows of 256; --windows {a.windows} + --dev {a.dev} is more",
              file=sys.stderr)
        return 2
    dense, _ = load_checkpoint(a.model, "cpu", torch.float32)
    dense.requires_grad_(False)
    pool, k, r_max = build_pool(a.model, a.base, a.keep, a.calib, a.pool_factor, progress=False)
    pool.requires_grad_(False)
    sens = sensitivities(pool, dense, k, every[:a.windows], a.batch)
    names = ["static", *SCORES, *[f"swap-{s}" for s in a.swaps]]
    configs = {c: fixed_masks(sens, k, r_max, c) for c in names}
    kept = {c: sum(float(m[n][:k[n]].sum()) / k[n] for n in k) / len(k) for c, m in configs.items()}
    test = test_windows(tok)
    if a.test_windows:
        test = test[:a.test_windows]
    res = {"dev": evaluate(pool, dense, every[-a.dev:], configs, 64, a.batch, "dev windows"),
           "test": evaluate(pool, dense, test, configs, 64, a.batch, "test windows")}
    for where, table in res.items():
        print(f"{where}:")
        for c, r in table.items():
            r["static_kept"] = kept[c]
            print(f"  {c}: perplexity {r['perplexity']:.2f}, top-1 {r['top1_agreement']:.4f}, KL {r['kl']:.4f}, "
                  f"Δ NLL {r['dnll']:+.4f} ± {r['ci95']:.4f}, {kept[c]:.3f} of static's components kept")
    if a.out:
        from rankserve.bench.decode import write_json
        write_json(Path(a.out), dict(base=a.base, keep=a.keep, pool_factor=a.pool_factor, calib=Path(a.calib).name,
                                     windows=a.windows, dev=a.dev, test_windows=len(test), seq_len=256, prompt_len=64,
                                     results=res, seconds=round(time.time() - t0, 1),
                                     command="python -m rankserve.bench.parse_fixed "
                                             + " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
