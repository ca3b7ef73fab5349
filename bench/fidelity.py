"""Baseline fidelity table: dense, svd, svd-llm and basis-sharing at keep 0.8 and 0.6 on the reference model and
on stories260K, through the fidelity harness (compress/fidelity.py). CPU; compressed models are cached.

    python -m rankserve.bench.fidelity --out bench/results/fidelity --max-tokens 40000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rankserve.compress.factorize import compress_model
from rankserve.compress.fidelity import fidelity, fidelity_table

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/fidelity", help="writes OUT.json and OUT.md")
    ap.add_argument("--models", nargs="+", default=["models/reference", "models/stories260K"])
    ap.add_argument("--methods", nargs="+", default=["svd", "svd-llm", "basis-sharing"])
    ap.add_argument("--keeps", nargs="+", type=float, default=[0.8, 0.6])
    ap.add_argument("--data", default=str(SHARED / "wikitext-2-raw-test" / "wiki.test.raw"), help="held-out text")
    ap.add_argument("--calib", default=str(SHARED / "wikitext-2-pytorch-examples" / "valid.txt"), help="calibration text")
    ap.add_argument("--calib-tokens", type=int, default=131072)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=40000, help="held-out tokens scored per model")
    ap.add_argument("--cache", default=".cache/fidelity")
    a = ap.parse_args(argv)
    results, md = [], ["# Fidelity baselines", "",
                       f"Held-out text: `{Path(a.data).name}` (first {a.max_tokens} tokens, windows of {a.seq_len}); "
                       f"calibration: `{Path(a.calib).name}` ({a.calib_tokens} tokens). Greedy identity: first 16 greedy "
                       "tokens of the 16 prompts in `bench/prompts/fidelity.txt` equal the dense model's. Command: "
                       f"`python -m rankserve.bench.fidelity {' '.join(argv or sys.argv[1:])}`", ""]
    for model in a.models:
        rows = []
        for method in ["dense"] + a.methods:
            for keep in ([1.0] if method == "dense" else a.keeps):
                t0 = time.time()
                path = Path(model)
                if method != "dense":
                    path = Path(a.cache) / f"{Path(model).name}-{method}-{keep}"
                    if not path.is_dir():
                        compress_model(model, path, method, keep, calib_text=None if method == "svd" else a.calib,
                                       calib_tokens=a.calib_tokens, calib_seq_len=a.seq_len, progress=False)
                r = fidelity(path, a.data, reference_dir=model, seq_len=a.seq_len, max_tokens=a.max_tokens,
                             progress=False)
                r.update(base=Path(model).name, method=method, keep_target=keep, seconds=time.time() - t0)
                rows.append(r)
                print(f"{Path(model).name:12s} {method:14s} {keep:.1f}: ppl {r['perplexity']:9.2f} "
                      f"top1 {r['top1_agreement']:.3f} KL {r['kl']:.3f} greedy {r['greedy_identity']:.2f}", flush=True)
        results += rows
        md.append(fidelity_table(rows, title=Path(model).name))
    Path(a.out + ".json").write_text(json.dumps(results, indent=1))
    Path(a.out + ".md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
