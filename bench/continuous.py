"""What continuous batching buys the engine: a queue of requests of mixed lengths served by up to 8 rows, as static
batches (8 at a time, FIFO, each decoded until its longest row ends) against rows that join the running batch as
others free their places (`BatchStream.add`).

All requests arrive at once; each generates a length drawn from [longest / 8, longest] (seeded, `ignore_eos`,
greedy) after a prompt of about `--prompt-tokens` tokens cut from tests/data/tinyshakespeare-head.txt. Per mode:
wall time (median of `--repeats`), generated tokens/s, decode steps, mean rows per step, request latency p50 / p90
from the queue's start, and where the time went (one instrumented pass, a device sync around each phase:
the decode steps, the joining rows' prefills, layout changes).

On the GPU the default model is random weights at the LLaMA-7B shape with svd-llm ranks at keep 0.6 (as
bench/decode.py builds it) and the reference model's tokenizer; its vocabulary is that tokenizer's (12,288 rows of
embedding and head instead of 32,000), so a token id always decodes. `--model-dir` serves a checkpoint instead.

    python -m rankserve.bench.continuous --out bench/results/continuous-h200.json            # GPU, 7B shape
    python -m rankserve.bench.continuous --model-dir models/stories260K --requests 8 --longest 16 \\
        --out /tmp/continuous-cpu.json                                                     # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from rankserve.workers.engine import Engine, StreamEvent, _Batch
from rankserve.workers.sampler import SamplingParams
from rankserve.workers.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "tinyshakespeare-head.txt"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_7b(keep: float = 0.6) -> Engine:
    """Random svd-llm-shaped factors at the LLaMA-7B shape on the GPU, with the reference model's tokenizer."""
    from rankserve.bench.decode import build_model, plan_ranks
    from rankserve.workers.align import GPU_ALIGN
    from rankserve.workers.config import preset

    tok = Tokenizer.load(ROOT / "models" / "reference")
    cfg = preset("llama-7b", vocab_size=tok.vocab_size, max_position_embeddings=2048)
    ranks, groups = plan_ranks(cfg, "svd-llm", keep)
    model = build_model(cfg, ranks, groups, "cuda", torch.bfloat16, align=GPU_ALIGN)
    return Engine(model, tok, max_batch_size=8)


def make_queue(eng: Engine, n: int, longest: int, prompt_tokens: int, seed: int = 0) -> list[tuple[str, SamplingParams]]:
    """n (prompt, params): prompts cut from the text at seeded offsets, lengths uniform in [longest / 8, longest]."""
    text = TEXT.read_text(encoding="utf-8")
    g = torch.Generator().manual_seed(seed)
    chars = 4 * prompt_tokens  # ~4 characters a token; the prompts' real lengths are reported
    out = []
    for _ in range(n):
        at = int(torch.randint(0, max(1, len(text) - chars), (1,), generator=g))
        m = int(torch.randint(max(1, longest // 8), longest + 1, (1,), generator=g))
        out.append((text[at:at + chars], SamplingParams(max_new_tokens=m, ignore_eos=True)))
    return out


OnEvent = Callable[[int, StreamEvent], None]  # (request number, its event)


def serve_static(eng: Engine, queue: list, on_event: OnEvent) -> list[int]:
    """Batches of max_batch_size in arrival order, each decoded to its end; -> rows per step."""
    rows: list[int] = []
    B = eng.max_batch_size
    for i in range(0, len(queue), B):
        stream = eng.stream_batch([p for p, _ in queue[i:i + B]], [sp for _, sp in queue[i:i + B]])
        for step in stream:
            rows.append(len(step))
            for j, ev in step.items():
                on_event(i + j, ev)
    return rows


def serve_continuous(eng: Engine, queue: list, on_event: OnEvent) -> list[int]:
    """Rows join the running batch whenever it has room; -> rows per step."""
    rows: list[int] = []
    stream = eng.stream_batch([], [])
    which: dict[int, int] = {}
    todo = list(enumerate(queue))
    while True:
        while todo and stream.room():
            k, (p, sp) = todo.pop(0)
            which[stream.add(p, sp)] = k
        try:
            step = next(stream)
        except StopIteration:
            return rows
        rows.append(len(step))
        for j, ev in step.items():
            on_event(which[j], ev)


def timed_pass(eng: Engine, queue: list, serve) -> dict[str, Any]:
    ends = [0.0] * len(queue)

    def on_event(k: int, ev: StreamEvent) -> None:
        if ev.finish_reason is not None:
            ends[k] = time.perf_counter()

    sync()
    t0 = time.perf_counter()
    rows = serve(eng, queue, on_event)
    sync()
    wall = time.perf_counter() - t0
    lat = sorted(e - t0 for e in ends)
    return dict(wall_s=wall, steps=len(rows), mean_rows_per_step=sum(rows) / len(rows),
                latency_p50_s=lat[len(lat) // 2], latency_p90_s=lat[int(0.9 * (len(lat) - 1))])


def phases(eng: Engine, queue: list, serve) -> dict[str, float]:
    """Seconds in each phase of the batch loop (device-synced around each): decode steps, prefills, layouts."""
    spent = {"decode_steps_s": 0.0, "prefills_s": 0.0, "layout_s": 0.0}
    names = {"_decode_step": "decode_steps_s", "_prefill": "prefills_s", "_arrange": "layout_s"}
    real = {n: getattr(_Batch, n) for n in names}

    def wrap(n: str):
        def fn(self, *a):
            sync()
            t = time.perf_counter()
            out = real[n](self, *a)
            sync()
            spent[names[n]] += time.perf_counter() - t
            return out
        return fn

    try:
        for n in names:
            setattr(_Batch, n, wrap(n))
        serve(eng, queue, lambda k, ev: None)
    finally:
        for n, f in real.items():
            setattr(_Batch, n, f)
    return {k: round(v, 4) for k, v in spent.items()}


def prefill_latency(eng: Engine, lengths: list[int], repeats: int = 5) -> list[dict[str, Any]]:
    """ms to prefill one row of a prompt of each length into slot 1 of a 2-row cache: the eager forward against
    the replayed graph (or, on the CPU, the same padded forward run eagerly); median of `repeats`; the last
    logits' largest difference between the two."""
    from rankserve.workers.kv_cache import KVCache

    cfg, w = eng.cfg, eng.model.embed.weight
    graphs = eng._prefill_graphs()
    out = []
    for n in lengths:
        if n >= eng.max_seq_len:
            continue
        cache = KVCache(cfg.num_hidden_layers, 2, eng.max_seq_len, cfg.num_key_value_heads, cfg.head_dim,
                        device=w.device, dtype=w.dtype)
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()

        def eager() -> torch.Tensor:
            view = cache.rows(1, 2)
            view.seqlens.zero_()
            return eng.model(torch.tensor([ids], device=w.device), view, last_only=True)[0]

        row: dict[str, Any] = dict(tokens=n)
        with torch.inference_mode():
            for name, fn in (("eager_ms", eager), ("graph_ms", lambda: graphs.prefill(ids, cache, 1))):
                fn()
                ts = []
                for _ in range(repeats):
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    ts.append((time.perf_counter() - t0) * 1e3)
                row[name] = round(statistics.median(ts), 3)
            row["max_abs_logit_diff"] = float((eager() - graphs.prefill(ids, cache, 1)).abs().max())
        out.append(row)
    return out


def markdown(res: dict[str, Any]) -> str:
    a = res["args"]
    lines = [f"# Continuous batching in the engine: {res['device']}", "",
             f"Model: {res['model']}. {a['requests']} requests arrive at once, prompts of {res['prompt_tokens']} "
             f"tokens, each generating a length drawn from [{max(1, a['longest'] // 8)}, {a['longest']}] "
             f"({res['tokens']} tokens in all; greedy, ignore_eos), up to 8 rows at a time. torch {res['torch']}. "
             f"Command: `{res['command']}`.", "",
             "| mode | wall s (median of %d) | tokens/s | decode steps | rows per step | latency p50 / p90 (s) | "
             "in decode steps / prefills / layout changes (s, one synced pass) |" % a["repeats"],
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode in ("static", "continuous"):
        r = res[mode]
        p = r["phases"]
        lines.append(f"| {mode} | {r['wall_s']:.3f} | {r['tokens_per_s']:.0f} | {r['steps']} | "
                     f"{r['mean_rows_per_step']:.2f} | {r['latency_p50_s']:.3f} / {r['latency_p90_s']:.3f} | "
                     f"{p['decode_steps_s']} / {p['prefills_s']} / {p['layout_s']} |")
    lines += ["", f"Continuous over static: **{res['speedup']:.2f}x** the tokens/s. Each row's greedy tokens equal "
              f"between the two modes for {res['rows_equal']} of {a['requests']} requests (bf16 on the GPU: a row "
              f"decoded in another batch size may part at a near-tie).", "",
              "One row's prefill (what a joining request costs the running rows), ms, median of 5: the eager "
              "forward against the engine's replayed graph (workers/prefill_graph.py; on the CPU the same padded "
              "forward, eager):", "",
              "| prompt tokens | eager ms | graph ms | max abs logit difference |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['tokens']} | {r['eager_ms']} | {r['graph_ms']} | {r['max_abs_logit_diff']:.3g} |"
              for r in res["prefill"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (the markdown goes next to it)")
    p.add_argument("--model-dir", default=None, help="a checkpoint to serve; default: random 7B shape (GPU)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--longest", type=int, default=256, help="longest generation; lengths from longest / 8")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-lengths", type=int, nargs="*", default=[16, 128, 512, 2000],
                   help="one-row prefill timings, eager against the replayed graph (lengths under the context)")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if a.model_dir is None and not cuda:
        p.error("the 7B shape needs a CUDA GPU; give --model-dir for a CPU run")
    eng = Engine.load(a.model_dir, device="cuda" if cuda else "cpu") if a.model_dir else random_7b()
    model = a.model_dir or "random weights, LLaMA-7B shape, svd-llm ranks at keep 0.6, bf16, vocabulary 12,288"
    queue = make_queue(eng, a.requests, a.longest, a.prompt_tokens)
    res: dict[str, Any] = dict(device=torch.cuda.get_device_name() if cuda else "CPU", torch=torch.__version__,
                               model=model, args=vars(a), tokens=sum(sp.max_new_tokens for _, sp in queue),
                               prompt_tokens=round(statistics.mean(len(eng.encode_prompt(q)) for q, _ in queue)),
                               command=" ".join(["python -m rankserve.bench.continuous", *argv]))
    ids: dict[str, list[list[int]]] = {}
    for mode, serve in (("static", serve_static), ("continuous", serve_continuous)):
        ids[mode] = [[] for _ in queue]
        serve(eng, queue, lambda k, ev: ids[mode][k].append(ev.token_id))  # warm-up (every bucket's decoder), tokens
        passes = sorted((timed_pass(eng, queue, serve) for _ in range(a.repeats)), key=lambda r: r["wall_s"])
        res[mode] = dict(passes[len(passes) // 2], phases=phases(eng, queue, serve))
        res[mode]["tokens_per_s"] = res["tokens"] / res[mode]["wall_s"]
        print(mode, json.dumps(res[mode]), flush=True)
    res["speedup"] = res["static"]["wall_s"] / res["continuous"]["wall_s"]
    res["rows_equal"] = sum(x == y for x, y in zip(ids["static"], ids["continuous"]))
    res["prefill"] = prefill_latency(eng, a.prefill_lengths)
    out = Path(a.out)
    for path, text in ((out, json.dumps(res, indent=1) + "\n"), (out.with_suffix(".md"), markdown(res))):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
