"""Closed-form energy routing on the reference model: does a prompt's own component energies pick better subsets?

For each routed matrix, component i's output energy on a set of tokens is ‖U[:, i]‖² · mean_t (V[i] · x_t)².
Score s_i = λ · (its energy on the prompt's first `prompt_len` tokens) + (1 − λ) · (its energy on `--prior-text`,
by default WikiText-2 valid, the static baseline's calibration text), top-K per matrix; λ = 0 is a calibration-only
order, λ = 1 the prompt alone. Scored as bench/parse.py does (prompt → frozen subset → continuation vs the dense
model), next to static truncation and the checkpoint's trained routers. `--split valid` tunes λ on the second half
of WikiText-2 valid (the prior uses its first 64 windows); `--split test` is WikiText-2 test.

Usage: python -m rankserve.bench.parse_energy --base svd-llm --tag valid --lams 0 0.25 0.5 --split test [--out F]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rankserve.bench.decode import write_json
from rankserve.bench.parse import WIKI_VALID, _score, _windows, add_cached_args, load_cached, test_windows, vs_static
from rankserve.workers.parse import select_batch


class Energies:
    """Forward hooks on the routed projections: per row, mean over the first `upto` tokens of (V x)² · ‖U‖²."""

    def __init__(self, model, names) -> None:
        self.model, self.upto, self.acc = model, 0, {}
        lins = {n: l for n, l in model.projections().items() if n in names}
        self.unorm = {n: (l.U.float() ** 2).sum(0) for n, l in lins.items()}  # (r_max,)
        self.hooks = [l.register_forward_hook(self._hook(n)) for n, l in lins.items()]

    def _hook(self, name):
        def f(mod, inp, out):
            z = inp[0].float() @ mod.V.float().T  # (B, S, r_max)
            self.acc[name] = (z[:, :self.upto] ** 2).mean(1) * self.unorm[name]  # (B, r_max)
        return f

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor, upto: int) -> dict[str, torch.Tensor]:
        self.acc, self.upto = {}, upto
        self.model(x)
        return dict(self.acc)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_energy", description=__doc__.split("\n\n")[0])
    add_cached_args(ap)
    ap.add_argument("--lams", nargs="+", type=float, default=[0.0, 0.25, 0.5])
    ap.add_argument("--split", default="test", choices=["valid", "test"])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prior-text", default=str(WIKI_VALID),
                    help="text of the calibration prior (default WikiText-2 valid, the static baseline's calibration; "
                         "pass the checkpoint's own calibration text when it was calibrated on another)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    loaded = load_cached(a.cache, a.model, a.base, a.tag)
    if loaded is None:
        return 2
    tok, dense, static, model, routers = loaded
    valid = WIKI_VALID.read_text()
    energies = Energies(model, routers.k)
    prior: dict[str, torch.Tensor] = {}
    calib = _windows(Path(a.prior_text).read_text(encoding="utf-8", errors="replace"), tok, 256, 64)  # the prior:
    # every token of its first 64 windows
    for i in range(0, len(calib), 8):
        for n, e in energies(calib[i:i + 8], 256).items():
            prior[n] = prior.get(n, 0) + e.sum(0) / len(calib)
    if a.split == "valid":  # the next 100 windows of valid
        ids, body = tok.encode(valid, bos=False), 255
        windows = torch.tensor([[tok.bos_id] + ids[(64 + i) * body:(65 + i) * body] for i in range(100)])
    else:
        windows = test_windows(tok)
    subsets: dict[str, list[dict]] = {f"energy λ={lam:g}": [] for lam in a.lams}
    learned: list[dict] = []
    with torch.inference_mode():
        for i in range(0, len(windows), 8):
            x = windows[i:i + 8]
            e = energies(x, a.prompt_len)
            for lam in a.lams:
                for b in range(x.shape[0]):
                    subsets[f"energy λ={lam:g}"].append({"v": 1, "k": {
                        n: sorted(torch.topk(lam * e[n][b] + (1 - lam) * prior[n], k).indices.tolist())
                        for n, k in routers.k.items()}})
            learned += select_batch(model, routers, x[:, :a.prompt_len])
    energies.close()
    configs = {"static": (static, None), "trained routers": (model, learned)}
    configs.update({name: (model, s) for name, s in subsets.items()})
    res = _score(dense, configs, windows, a.prompt_len, 8)
    out = vs_static(res)
    for name, o in out.items():
        print(f"{name:16s} perplexity {o['perplexity']:.2f}  top-1 {o['top1_agreement']:.4f}  "
              f"ΔNLL vs static {o['dnll']:+.4f} ± {o['ci95']:.4f}", flush=True)
    if a.out:
        write_json(Path(a.out), dict(base=a.base, tag=a.tag, split=a.split, prompt_len=a.prompt_len,
                                     windows=len(windows), results=out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
