"""PARSE routed vs static, window by window, on `rankserve eval`'s protocol: the paired difference with its interval.

    python -m rankserve.bench.parse_paired CKPT --data wiki.test.raw --reference models/reference \
        --out bench/results/parse-paired-svd-llm.json [--max-tokens 0 --seq-len 256 --prompt-len 64]

CKPT is a PARSE checkpoint (`rankserve train-parse`). The text is cut into `rankserve eval`'s windows (compress/
evaluate.py: non-overlapping, the last one shifted back); in each, the first `prompt_len` tokens are the prompt and
the rest are scored. "route" routes every window's subset on its prompt (what the service does on a cache miss),
"static" uses the base's first K components (the static baseline at the same K); the dense reference gives top-1
agreement. Both modes score the same tokens, so their per-window differences pair: the JSON holds the totals (equal
to `rankserve eval --parse-mode route|static`'s), the mean per-window difference of NLL and of top-1 agreement with
a 95 % normal interval, and how many windows each mode wins. CPU, fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from rankserve.compress.evaluate import windows
from rankserve.workers.checkpoint import load_checkpoint
from rankserve.workers.parse import apply, load_parse, select_batch
from rankserve.workers.tokenizer import Tokenizer

MODES = ("route", "static")


def paired(ckpt: str | Path, text: str, reference: str | Path, seq_len: int = 256, prompt_len: int = 64,
           max_tokens: int = 0, batch_size: int = 8) -> dict:
    """Totals per mode and the paired per-window differences (route − static); see the module doc."""
    model, _ = load_checkpoint(ckpt, "cpu", torch.float32)
    ref, _ = load_checkpoint(reference, "cpu", torch.float32)
    routers = load_parse(ckpt, model)
    if routers is None:
        raise ValueError(f"{ckpt} is not a PARSE checkpoint")
    if not 1 <= prompt_len < seq_len:
        raise ValueError(f"prompt_len must be in [1, seq_len={seq_len}), got {prompt_len}")
    ids = torch.tensor(Tokenizer.load(ckpt).encode(text, bos=True)[:max_tokens or None])  # (N,)
    static = routers.static_subset()
    rows = []  # per window: tokens scored, and per mode its NLL sum and top-1 agreements
    wins = windows(len(ids), seq_len, seq_len)
    with torch.inference_mode():
        for b in range(0, len(wins), batch_size):
            batch = wins[b:b + batch_size]
            x = torch.stack([ids[s:e] for s, e, _ in batch])  # (B, S)
            ref_logits = ref(x)  # (B, S, V)
            logits = {}
            for mode in MODES:
                apply(model, select_batch(model, routers, x[:, :prompt_len]) if mode == "route"
                      else [static] * len(batch))
                logits[mode] = model(x)
            for i, (s, e, f) in enumerate(batch):
                lo = max(f - s, prompt_len - 1)  # as compress/evaluate.py: past the prompt and earlier windows
                if lo >= e - s:
                    continue
                y = ids[s + lo + 1:e + 1]  # (T,) targets
                top = ref_logits[i, lo:e - s].argmax(-1)  # (T,)
                row = {"n": len(y)}
                for mode, l in logits.items():
                    lp = F.log_softmax(l[i, lo:e - s], dim=-1)  # (T, V)
                    row[mode] = (float(-lp.gather(1, y[:, None]).double().sum()), int((lp.argmax(-1) == top).sum()))
                rows.append(row)
    n = sum(r["n"] for r in rows)
    out: dict = {"checkpoint": str(ckpt), "windows": len(rows), "tokens": n, "seq_len": seq_len,
                 "prompt_len": prompt_len}
    for mode in MODES:
        nll = sum(r[mode][0] for r in rows) / n
        out[mode] = {"perplexity": math.exp(nll), "nll": nll, "top1_agreement": sum(r[mode][1] for r in rows) / n}
    d_nll = torch.tensor([(r["route"][0] - r["static"][0]) / r["n"] for r in rows], dtype=torch.float64)
    d_top = torch.tensor([(r["route"][1] - r["static"][1]) / r["n"] for r in rows], dtype=torch.float64)
    half = lambda t: float(1.96 * t.std() / math.sqrt(len(t))) if len(t) > 1 else float("nan")  # noqa: E731
    out["route_minus_static"] = {"nll": float(d_nll.mean()), "nll_ci95": half(d_nll),
                                 "top1": float(d_top.mean()), "top1_ci95": half(d_top),
                                 "windows_route_lower_nll": int((d_nll < 0).sum()),
                                 "windows_static_lower_nll": int((d_nll > 0).sum())}
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| checkpoint | windows / tokens | static: perplexity / top-1 | route: perplexity / top-1 | Δ NLL (95 %) "
             "| Δ top-1 (95 %) | windows route / static lower |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        d = r["route_minus_static"]
        lines.append(f"| {Path(r['checkpoint']).name} | {r['windows']} / {r['tokens']} | "
                     f"{r['static']['perplexity']:.2f} / {r['static']['top1_agreement']:.4f} | "
                     f"{r['route']['perplexity']:.2f} / {r['route']['top1_agreement']:.4f} | "
                     f"{d['nll']:+.4f} ± {d['nll_ci95']:.4f} | {d['top1']:+.4f} ± {d['top1_ci95']:.4f} | "
                     f"{d['windows_route_lower_nll']} / {d['windows_static_lower_nll']} |")
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
