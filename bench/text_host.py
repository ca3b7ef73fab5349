"""Host time of a row's text as tokens arrive (`workers/engine._Row.push`: detokenize, stop strings, hold-back):
a long generation's tokens pushed one at a time, on the CPU, against decoding every token again each step (the way
before session 35, kept here as the baseline). The tokens are WikiText-2 text's own; no model runs.

    python -m rankserve.bench.text_host --out bench/results/text-host-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from rankserve.workers.engine import _Row, whole_text
from rankserve.workers.sampler import SamplingParams
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "wikitext2-raw-test-head.txt"


class _WholeRow(_Row):
    """The baseline: the prompt's last tokens and every generated token decoded again at each push."""

    def _text(self, tok: Tokenizer) -> str:
        return whole_text(tok, self.context, self.ids)


def push_all(row_type: type[_Row], tok: Tokenizer, ids: list[int], tail: int) -> dict:
    """Push ids[4:] after the prompt ids[:4]; seconds in all, ms a token over the last `tail`, the text."""
    row = row_type(ids[:4], SamplingParams(max_new_tokens=len(ids), ignore_eos=True), ())
    t0 = time.perf_counter()
    for i, t in enumerate(ids[4:]):
        if i == len(ids) - 4 - tail:
            t1 = time.perf_counter()
        row.push(t, tok)
    t2 = time.perf_counter()
    return dict(seconds=round(t2 - t0, 3), last_ms_per_token=round((t2 - t1) * 1e3 / tail, 4), text=row.released)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.text_host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="results JSON")
    ap.add_argument("--tokens", type=int, default=16384, help="generated tokens pushed")
    ap.add_argument("--tail", type=int, default=1000, help="ms a token is timed over the last this many")
    ap.add_argument("--models", nargs="+", default=["stories260K", "reference"], help="tokenizers (models/...)")
    a = ap.parse_args(argv)
    if not 0 < a.tail <= a.tokens:
        ap.error(f"--tail must be in (0, --tokens], got {a.tail}")
    out: dict = {"host": platform.processor() or platform.machine(), "tokens": a.tokens, "tail": a.tail}
    for m in a.models:
        tok = Tokenizer.load(ROOT / "models" / m)
        text = TEXT.read_text()
        ids = tok.encode(text * (a.tokens // len(tok.encode(text)) + 1))[:a.tokens + 4]  # 4: the prompt
        new, old = push_all(_Row, tok, ids, a.tail), push_all(_WholeRow, tok, ids, a.tail)
        out[m] = dict(incremental={k: v for k, v in new.items() if k != "text"},
                      whole={k: v for k, v in old.items() if k != "text"}, same_text=new["text"] == old["text"])
        print(m, json.dumps(out[m]), flush=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
