"""What chunked prefill buys the rows already decoding when long prompts join their batch.

`--rows` requests with short prompts decode together; every `--every` steps a request with a long prompt (about
`--long-tokens` tokens) joins. With `Engine.prefill_chunk` = 0 each long prompt is prefilled whole at the step it
joins, and every decoding row waits for it; with a chunk of C tokens it goes in C tokens a step. Per chunk size:
the decoding rows' gaps between tokens (p50 / p99 / max over every gap of every short row), the long requests'
time to first token, the whole run's wall time and tokens/s (median of `--repeats` passes after a warm-up that
captures the graphs), and whether every request's greedy tokens equal the whole-prompt run's.

    python -m rankserve.bench.chunked_prefill --out bench/results/chunked-prefill-h200.json     # GPU, 7B shape
    python -m rankserve.bench.chunked_prefill --model-dir models/stories260K --rows 2 --long-tokens 200 \\
        --chunks 0 64 --joins 2 --every 4 --gen 24 --long-gen 4 --out /tmp/chunked.json      # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rankserve.bench.continuous import TEXT, random_7b, sync, write_results
from rankserve.workers.engine import Engine
from rankserve.workers.sampler import SamplingParams


def prompts(eng: Engine, rows: int, joins: int, long_tokens: int) -> tuple[list[str], list[str]]:
    """Short prompts (~one line each) and long ones (~long_tokens tokens), cut from the text at different places."""
    text = TEXT.read_text(encoding="utf-8")
    lines = [l for l in text.splitlines() if len(l) > 20]
    short = [lines[7 * i] for i in range(rows)]
    ids = eng.tokenizer.encode(text, bos=False)
    step = max(1, (len(ids) - long_tokens) // max(1, joins))
    long = [eng.tokenizer.decode(ids[j * step:j * step + long_tokens - 1]) for j in range(joins)]
    return short, long


def one_pass(eng: Engine, short: list[str], long: list[str], a: argparse.Namespace,
             subsets: list[dict] | None = None) -> dict[str, Any]:
    """One run of the scenario: -> per-request tokens, the short rows' gaps between tokens, the long ones' TTFT.
    `subsets`: PARSE, one per request (short ones first)."""
    gen, long_gen = SamplingParams(max_new_tokens=a.gen, ignore_eos=True), SamplingParams(max_new_tokens=a.long_gen,
                                                                                          ignore_eos=True)
    stream = eng.stream_batch([], [])
    which: dict[int, int] = {}  # stream row -> request (short ones first)
    tokens: list[list[int]] = [[] for _ in short + long]
    last: dict[int, float] = {}
    gaps: list[float] = []
    added: dict[int, float] = {}
    ttft: list[float] = []
    sync()
    t0 = time.perf_counter()
    sub = subsets or [None] * (len(short) + len(long))
    for k, p in enumerate(short):
        which[stream.add(p, gen, sub[k], checked=True)] = k
    step = 0
    while True:
        j, due = divmod(step, a.every)
        if due == 0 and 1 <= j <= len(long):
            k = len(short) + j - 1
            which[stream.add(long[j - 1], long_gen, sub[k], checked=True)] = k
            added[k] = time.perf_counter()
        try:
            events = next(stream)
        except StopIteration:
            break
        now = time.perf_counter()  # the step ended: greedy picks were read back from the device
        for i, ev in events.items():
            k = which[i]
            if k < len(short) and k in last:
                gaps.append(now - last[k])
            elif k >= len(short) and not tokens[k]:
                ttft.append(now - added[k])
            last[k] = now
            tokens[k].append(ev.token_id)
        step += 1
    sync()
    wall = time.perf_counter() - t0
    stream.close()
    return dict(wall_s=wall, tokens=tokens, gaps=gaps, ttft=ttft, steps=step)


def chunk_costs(eng: Engine, sizes: list[int], repeats: int = 5) -> list[dict[str, Any]]:
    """ms for one chunk of each size (median of `repeats`, device-synced): at the prompt's start and after half the
    context is filled, against the one-row prefill of a whole prompt that long (the engine's PrefillGraphs)."""
    from rankserve.workers.kv_cache import KVCache

    chunks, whole = eng._chunked_prefill(), eng._prefill_graphs() or None
    cfg = eng.cfg
    cache = KVCache(cfg.num_hidden_layers, 1, eng.max_seq_len, cfg.num_key_value_heads, cfg.head_dim,
                    device=eng.device, dtype=eng.model.embed.weight.dtype)
    ids = [int(i) for i in torch.randint(3, cfg.vocab_size, (eng.max_seq_len,), generator=torch.Generator().manual_seed(0))]

    def timed(fn) -> float:
        fn()  # first call: capture
        ts = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            ts.append(1e3 * (time.perf_counter() - t))
        return round(statistics.median(ts), 2)

    out = []
    for c in sizes:
        half = eng.max_seq_len // 2
        row = dict(tokens=c, chunk_at_0_ms=timed(lambda: chunks.run(ids, 0, c)),
                   chunk_at_half_ms=timed(lambda: chunks.run(ids, half, c)) if half + c <= eng.max_seq_len else None)
        row["whole_prompt_ms"] = timed(lambda: whole.prefill(ids[:c], cache, 0)) if whole is not None else None
        out.append(row)
        print("chunk cost", json.dumps(row), flush=True)
    return out


def summary(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The median pass by wall time; its gap and TTFT statistics in ms."""
    p = sorted(passes, key=lambda r: r["wall_s"])[len(passes) // 2]
    gaps = sorted(p["gaps"])

    def q(x: float) -> float:
        return round(1e3 * gaps[min(len(gaps) - 1, int(x * len(gaps)))], 2)

    n = sum(len(t) for t in p["tokens"])
    return dict(wall_s=round(p["wall_s"], 4), tokens_per_s=round(n / p["wall_s"], 1), steps=p["steps"],
                gap_p50_ms=q(0.5), gap_p99_ms=q(0.99), gap_max_ms=round(1e3 * gaps[-1], 2),
                ttft_long_ms=[round(1e3 * t, 1) for t in p["ttft"]],
                ttft_long_median_ms=round(1e3 * statistics.median(p["ttft"]), 1), tokens=p["tokens"])


def markdown(res: dict[str, Any]) -> str:
    a = res["args"]
    lines = [f"# Chunked prefill: {res['device']}", "",
             f"Model: {res['model']}. {a['rows']} requests with short prompts ({res['short_tokens']} tokens on average) "
             f"decode {a['gen']} tokens each; every {a['every']} steps one of {a['joins']} requests with a long prompt "
             f"({res['long_tokens']} tokens on average) joins and decodes {a['long_gen']}. Greedy, ignore_eos; up to "
             f"{res['max_batch_size']} rows. torch {res['torch']}. Median pass of {a['repeats']} by wall time, after a "
             f"warm-up pass. Command: `{res['command']}`.", "",
             "| prefill chunk | short rows' gap between tokens p50 / p99 / max (ms) | long prompts' TTFT, median (ms) | "
             "wall s | tokens/s | decode steps | requests' tokens equal to whole prompts' |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in a["chunks"]:
        r = res["runs"][str(c)]
        lines.append(f"| {c or 'whole prompt'} | {r['gap_p50_ms']} / {r['gap_p99_ms']} / {r['gap_max_ms']} | "
                     f"{r['ttft_long_median_ms']} | {r['wall_s']} | {r['tokens_per_s']} | {r['steps']} | "
                     f"{r['equal']} of {len(r['tokens'])} |")
    if not res["chunk_costs"]:  # PARSE: its chunks run eagerly, not timed alone
        return "\n".join(lines) + "\n"
    lines += ["", "One chunk alone (ms, median of 5, device-synced): at position 0 and after half the context, against the "
              "one-row prefill of a whole prompt of that length (workers/prefill_graph.py):", "",
              "| tokens | chunk at 0 | chunk at half the context | whole prompt |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['tokens']} | {r['chunk_at_0_ms']} | {r['chunk_at_half_ms']} | {r['whole_prompt_ms']} |"
              for r in res["chunk_costs"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (the markdown goes next to it)")
    p.add_argument("--model-dir", default=None, help="a checkpoint to serve; default: random 7B shape (GPU)")
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 512, 1024],
                   help="Engine.prefill_chunk values to run (0: whole prompts, the baseline; runs first)")
    p.add_argument("--rows", type=int, default=4, help="requests with short prompts, decoding from the start")
    p.add_argument("--gen", type=int, default=160, help="tokens each short request generates")
    p.add_argument("--long-tokens", type=int, default=1800, help="tokens of each long prompt (about)")
    p.add_argument("--joins", type=int, default=4, help="long requests, joining one every --every steps")
    p.add_argument("--every", type=int, default=32)
    p.add_argument("--long-gen", type=int, default=16, help="tokens each long request generates")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parse-graph-tokens", type=int, default=None,
                   help="PARSE: Engine.parse_graph_tokens (joins up to this long prefill by graphs; 0: eagerly)")
    p.add_argument("--parse", action="store_true",
                   help="GPU: a PARSE pool with random routers, each request its own subset (any 8: union ~1.05 K); "
                   "its chunks run eagerly")
    a = p.parse_args(argv)
    if 0 not in a.chunks:
        p.error("--chunks must include 0 (whole prompts): the baseline every other row is compared with")
    a.chunks = [0] + [c for c in a.chunks if c != 0]
    cuda = torch.cuda.is_available()
    if a.model_dir is None and not cuda:
        p.error("the 7B shape needs a CUDA GPU; give --model-dir for a CPU run")
    eng = Engine.load(a.model_dir, device="cuda" if cuda else "cpu") if a.model_dir else random_7b(parse=a.parse)
    if a.parse_graph_tokens is not None:
        eng.parse_graph_tokens = a.parse_graph_tokens
    eng.prefix = None  # the passes repeat the same prompts: measure chunking, not prefix-cache hits
    if a.rows + 1 > eng.max_batch_size:
        p.error(f"--rows leaves no place for a long prompt (max_batch_size {eng.max_batch_size})")
    short, long = prompts(eng, a.rows, a.joins, a.long_tokens)
    subsets = None
    if eng.routers is not None:
        from rankserve.bench.parse_speed import overlapping_subsets

        subsets = overlapping_subsets(eng.routers, a.rows + a.joins, 1 + 0.05 * (a.rows + a.joins - 1) / 7, 0)
    n_short = [len(eng.encode_prompt(s)) for s in short]
    n_long = [len(eng.encode_prompt(s, room=a.long_gen)) for s in long]  # refused here if past the context
    res: dict[str, Any] = dict(device=torch.cuda.get_device_name() if cuda else "CPU", torch=torch.__version__,
                               model=a.model_dir or "random weights, LLaMA-7B shape, svd-llm ranks at keep 0.6, bf16, "
                               "vocabulary 12,288, context 2,048" + ("; a PARSE pool of 2 K components a matrix, random "
                               "routers, each request its own subset (union ~1.05 K)" if a.parse else ""), args=vars(a),
                               short_tokens=round(statistics.mean(n_short)), long_tokens=round(statistics.mean(n_long)),
                               max_batch_size=eng.max_batch_size,
                               command=" ".join(["python -m rankserve.bench.chunked_prefill", *argv]), runs={})
    for c in a.chunks:
        eng.prefill_chunk = c
        one_pass(eng, short, long, a, subsets)  # warm-up: decoders, prefill and chunk graphs
        r = summary([one_pass(eng, short, long, a, subsets) for _ in range(a.repeats)])
        base = res["runs"].get("0", r)["tokens"]
        r["equal"] = sum(x == y for x, y in zip(r["tokens"], base))
        res["runs"][str(c)] = r
        print(c, json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    res["chunk_costs"] = chunk_costs(eng, [c for c in a.chunks if c] + ([a.long_tokens] if cuda else [])) \
        if eng.routers is None else []
    write_results(Path(a.out), res, markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
