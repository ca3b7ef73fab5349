"""PARSE routed vs static, window by window, on `rankserve eval`'s protocol: the paired difference with its interval.

    python -m rankserve.bench.parse_paired CKPT --data wiki.test.raw --reference models/reference \
        --out bench/results/parse-paired-svd-llm.json [--max-tokens 0 --seq-len 256 --prompt-len 64]

CKPT is a PARSE checkpoint (`rankserve train-parse`). The text is cut into `rankserve eval`'s windows (compress/
evaluate.py: non-overlapping, the last one shifted back); in each, the first `prompt_len` tokens are the prompt and
the rest are scored. "route" routes every window's subset on its prompt (what the service does on a cache miss),
"static" uses the base's first K components (the static baseline at the same K); the dense reference gives top-1
agreement. Both modes score the same tokens (each is one `compare` run, as `rankserve eval --parse-mode route|static`
runs it), so their per-window differences pair: the JSON holds the totals (equal to eval's), the mean per-window
difference of NLL and of top-1 agreement with a 95 % normal interval, and how many windows each mode wins. CPU, fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from rankserve.compress.evaluate import compare
from rankserve.compress.fidelity import parse_masks
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.model import Transformer
from rankserve.workers.parse import Routers, clear, load_parse
from rankserve.workers.tokenizer import Tokenizer

MODES = ("route", "static")


def paired(ckpt: str | Path, text: str, reference: str | Path, seq_len: int = 256, prompt_len: int = 64,
           max_tokens: int = 0, batch_size: int = 8) -> dict:
    """Totals per mode and the paired per-window differences (route − static); see the module doc. Each mode is
    one `compare` over eval's windows (compress/evaluate.py), its masks as `rankserve eval --parse-mode` sets them."""
    model, _ = load_checkpoint(ckpt, "cpu", torch.float32)
    ref, _ = load_checkpoint(reference, "cpu", torch.float32)
    routers = load_parse(ckpt, model)
    if routers is None:
        raise ValueError(f"{ckpt} is not a PARSE checkpoint")
    return {"checkpoint": str(ckpt)} | paired_scores(model, ref, routers, Tokenizer.load(ckpt), text, seq_len,
                                                     prompt_len, max_tokens, batch_size)


def paired_scores(model: Transformer, ref: Transformer, routers: Routers, tok: Tokenizer, text: str,
                  seq_len: int = 256, prompt_len: int = 64, max_tokens: int = 0, batch_size: int = 8) -> dict:
    """`paired` of a PARSE pool and its routers already loaded (on any one device)."""
    if prompt_len < 1:
        raise ValueError(f"routing needs a prompt: prompt_len must be at least 1, got {prompt_len}")
    out: dict = {"seq_len": seq_len, "prompt_len": prompt_len}
    rows: dict[str, list[tuple[int, float, int]]] = {}  # per mode, per window: (tokens, NLL sum, agreements)
    for mode in MODES:
        rows[mode] = []
        masks, _ = parse_masks(model, routers, mode, prompt_len)
        r = compare(model, ref, tok, text, seq_len, None, max_tokens or None, batch_size, prompt_len=prompt_len,
                    masks=masks, per_window=rows[mode])
        out[mode] = {"perplexity": r["perplexity"], "nll": r["nll"], "top1_agreement": r["top1_agreement"],
                     "kl": r["kl"]}
    clear(model)
    out.update(windows=len(rows["route"]), tokens=sum(n for n, _, _ in rows["route"]))
    pairs = list(zip(rows["route"], rows["static"], strict=True))  # the same windows, the same tokens
    d_nll = torch.tensor([(a[1] - b[1]) / a[0] for a, b in pairs], dtype=torch.float64)
    d_top = torch.tensor([(a[2] - b[2]) / a[0] for a, b in pairs], dtype=torch.float64)
    half = lambda t: float(1.96 * t.std() / math.sqrt(len(t))) if len(t) > 1 else float("nan")  # noqa: E731
    out["route_minus_static"] = {"nll": float(d_nll.mean()), "nll_ci95": half(d_nll),
                                 "top1": float(d_top.mean()), "top1_ci95": half(d_top),
                                 "windows_route_lower_nll": int((d_nll < 0).sum()),
                                 "windows_static_lower_nll": int((d_nll > 0).sum())}
    return out


def interval_cells(d: dict) -> str:
    """Two table cells: Δ NLL and Δ top-1 of a `route_minus_static` dict, each with its 95 % half-width."""
    return f"{d['nll']:+.4f} ± {d['nll_ci95']:.4f} | {d['top1']:+.4f} ± {d['top1_ci95']:.4f}"


def markdown(results: list[dict]) -> str:
    lines = ["| checkpoint | windows / tokens | static: perplexity / top-1 | route: perplexity / top-1 | Δ NLL (95 %) "
             "| Δ top-1 (95 %) | windows route / static lower |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        d = r["route_minus_static"]
        lines.append(f"| {Path(r['checkpoint']).name} | {r['windows']} / {r['tokens']} | "
                     f"{r['static']['perplexity']:.2f} / {r['static']['top1_agreement']:.4f} | "
                     f"{r['route']['perplexity']:.2f} / {r['route']['top1_agreement']:.4f} | "
                     f"{interval_cells(d)} | {d['windows_route_lower_nll']} / {d['windows_static_lower_nll']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.parse_paired", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="PARSE checkpoints")
    ap.add_argument("--data", required=True, help="held-out text")
    ap.add_argument("--reference", required=True, help="the dense model")
    ap.add_argument("--out", required=True, help="writes OUT (JSON) and OUT with .md")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=0, help="score the text's first N tokens (0 = all)")
    a = ap.parse_args(argv)
    text = Path(a.data).read_text(encoding="utf-8", errors="replace")
    results = [paired(c, text, a.reference, a.seq_len, a.prompt_len, a.max_tokens) for c in a.checkpoints]
    out = Path(a.out)
    cmd = "python -m rankserve.bench.parse_paired " + " ".join(argv if argv is not None else sys.argv[1:])
    out.write_text(json.dumps({"command": cmd, "results": results}, indent=1) + "\n")
    out.with_suffix(".md").write_text(f"Command: `{cmd}`\n\n" + markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
