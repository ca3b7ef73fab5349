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
import functools
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


def write_results(out: Path, res: dict[str, Any], md: str) -> None:
    """The results as JSON at `out` and their markdown beside it (.md), each written to a temporary name and renamed:
    a run killed mid-write leaves the previous files whole."""
    for path, text in ((out, json.dumps(res, indent=1) + "\n"), (out.with_suffix(".md"), md)):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def random_7b(keep: float = 0.6, parse: bool = False) -> Engine:
    """Random svd-llm-shaped factors at the LLaMA-7B shape on the GPU, with the reference model's tokenizer.
    `parse`: a PARSE pool of 2 K components a matrix with random routers instead (K: the static rank at `keep`),
    its decoders allowed 100 GB (a slots set of the pool is ~16 GB; the default 40 % of the GPU holds three)."""
    from rankserve.bench.decode import build_model, plan_ranks
    from rankserve.workers.align import GPU_ALIGN
    from rankserve.workers.config import preset
    from rankserve.workers.parse import Routers

    tok = Tokenizer.load(ROOT / "models" / "reference")
    cfg = preset("llama-7b", vocab_size=tok.vocab_size, max_position_embeddings=2048)
    ranks, groups = plan_ranks(cfg, "svd-llm", keep)
    if not parse:
        return Engine(build_model(cfg, ranks, groups, "cuda", torch.bfloat16, align=GPU_ALIGN), tok, max_batch_size=8)
    shapes = cfg.linear_shapes()
    r_max = {n: min(2 * k, min(shapes[n.rsplit(".", 1)[1]])) for n, k in ranks.items()}
    pool = build_model(cfg, r_max, {}, "cuda", torch.bfloat16, seed=1, align=GPU_ALIGN)
    lins = pool.projections()
    g = torch.Generator(device="cuda").manual_seed(0)
    routers = Routers(R={n: torch.randn(r, lins[n].in_features, device="cuda", generator=g) for n, r in r_max.items()},
                      b={n: torch.zeros(r, device="cuda") for n, r in r_max.items()}, k=dict(ranks), r_max=r_max,
                      head={}, perm={})
    return Engine(pool, tok, max_batch_size=8, routers=routers, decoder_memory_bytes=100 * 2**30)


def make_queue(eng: Engine, n: int, longest: int, prompt_tokens: int, seed: int = 0,
               union: float = 1.05) -> list[tuple[str, SamplingParams, dict | None]]:
    """n (prompt, params, PARSE subset or None): prompts cut from the text at seeded offsets, lengths uniform in
    [longest / 8, longest]; on a PARSE engine, subsets sharing all but a few components, so that any 8 of them
    have a union of about `union` K (routed subsets of 8 prompts: 1.04-1.20 K, bench/results/parse.md)."""
    text = TEXT.read_text(encoding="utf-8")
    g = torch.Generator().manual_seed(seed)
    chars = 4 * prompt_tokens  # ~4 characters a token; the prompts' real lengths are reported
    out = []
    for _ in range(n):
        at = int(torch.randint(0, max(1, len(text) - chars), (1,), generator=g))
        m = int(torch.randint(max(1, longest // 8), longest + 1, (1,), generator=g))
        out.append((text[at:at + chars], SamplingParams(max_new_tokens=m, ignore_eos=True)))
    if eng.routers is None:
        return [(p, sp, None) for p, sp in out]
    from rankserve.bench.parse_speed import overlapping_subsets

    subs = overlapping_subsets(eng.routers, n, 1 + (union - 1) * (n - 1) / 7, seed)  # 8 rows: `union` K
    return [(p, sp, sub) for (p, sp), sub in zip(out, subs)]


OnEvent = Callable[[int, StreamEvent], None]  # (request number, its event)


def serve_static(eng: Engine, queue: list, on_event: OnEvent) -> list[int]:
    """Batches of max_batch_size in arrival order, each decoded to its end; -> rows per step."""
    rows: list[int] = []
    B = eng.max_batch_size
    for i in range(0, len(queue), B):
        chunk = queue[i:i + B]
        stream = eng.stream_batch([p for p, _, _ in chunk], [sp for _, sp, _ in chunk],
                                  None if eng.routers is None else [sub for _, _, sub in chunk], checked=True)
        for step in stream:
            rows.append(len(step))
            for j, ev in step.items():
                on_event(i + j, ev)
    return rows


def serve_continuous(eng: Engine, queue: list, on_event: OnEvent, join_min: int = 1) -> list[int]:
    """Rows join the running batch as `BatchStream.admits` lets them: once it has room for `join_min` of them (or is
    empty); -> rows per step."""
    rows: list[int] = []
    saved, eng.join_min = eng.join_min, join_min
    try:
        stream = eng.stream_batch([], [])
        which: dict[int, int] = {}
        todo = list(enumerate(queue))
        while True:
            for _ in range(stream.admits(len(todo))):
                k, (p, sp, sub) = todo.pop(0)
                which[stream.add(p, sp, sub, checked=True)] = k
            try:
                step = next(stream)
            except StopIteration:
                return rows
            rows.append(len(step))
            for j, ev in step.items():
                on_event(which[j], ev)
    finally:
        eng.join_min = saved


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
    if graphs is None:  # PARSE: its joins replay the rank slots' graphs (bench/slot_prefill.py times those)
        return []
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


def first_step(eng: Engine, n: int = 8, tokens: int = 512, repeats: int = 5) -> dict[str, Any]:
    """ms of a batch's first step (n prompts prefilled, one token each): n copies of one prompt (a request's n
    choices: one prefill, the others copy its cache rows) against n different prompts of the same length; median
    of `repeats` after a warm-up."""
    text = TEXT.read_text(encoding="utf-8")
    chars = 4 * tokens
    while len(eng.tokenizer.encode(text[:chars], bos=True)) >= eng.max_seq_len:  # a small vocabulary: more tokens
        chars = chars * 3 // 4
    same = [text[:chars]] * n
    different = [text[i * chars:(i + 1) * chars] for i in range(n)]
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
    out: dict[str, Any] = dict(rows=n, prompt_tokens=len(eng.encode_prompt(same[0])))
    subs = None if eng.routers is None else [make_queue(eng, 1, 1, 1)[0][2]] * n  # PARSE: one subset for all
    for name, prompts in (("same_prompt_ms", same), ("different_prompts_ms", different)):
        ts = []
        for _ in range(repeats + 1):
            stream = eng.stream_batch(prompts, [sp] * n, subs, checked=True)
            sync()
            t0 = time.perf_counter()
            next(stream)
            sync()
            ts.append((time.perf_counter() - t0) * 1e3)
            stream.close()
        out[name] = round(statistics.median(ts[1:]), 3)
        out[name.replace("_ms", "_prefills")] = stream._batch.prefills
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
    for mode in res.get("modes", ["static", "continuous"]):
        r = res[mode]
        p = r["phases"]
        lines.append(f"| {mode} | {r['wall_s']:.3f} | {r['tokens_per_s']:.0f} | {r['steps']} | "
                     f"{r['mean_rows_per_step']:.2f} | {r['latency_p50_s']:.3f} / {r['latency_p90_s']:.3f} | "
                     f"{p['decode_steps_s']} / {p['prefills_s']} / {p['layout_s']} |")
    best = res.get("best", "continuous")
    lines += ["", f"{best[0].upper() + best[1:]} over static: **{res['speedup']:.2f}x** the tokens/s. Each row's greedy "
              f"tokens equal between the two for {res['rows_equal']} of {a['requests']} requests (bf16 on the GPU: a "
              f"row decoded in another batch size may part at a near-tie)."]
    if res.get("first_step"):
        f = res["first_step"]
        lines += ["", f"A batch's first step, {f['rows']} rows of {f['prompt_tokens']}-token prompts (each prefilled, one "
                  f"token each), median of 5: {f['same_prompt_ms']} ms when they are one prompt's {f['rows']} choices "
                  f"({f['same_prompt_prefills']} prefill, the others copy its cache rows) against "
                  f"{f['different_prompts_ms']} ms for {f['rows']} different prompts ({f['different_prompts_prefills']} "
                  f"prefilled)."]
    if not res["prefill"]:
        return "\n".join(lines) + "\n"
    lines += ["", "One row's prefill (what a joining request costs the running rows), ms, median of 5: the eager "
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
    p.add_argument("--join-min", type=int, nargs="+", default=[1],
                   help="rows join only when this many places are free (or the batch is empty); several: each")
    p.add_argument("--first-step-tokens", type=int, default=512,
                   help="prompt length of the first-step timing (8 copies of one prompt vs 8 prompts); 0: skip")
    p.add_argument("--parse-graph-tokens", type=int, default=None,
                   help="PARSE: Engine.parse_graph_tokens (joins up to this long prefill by graphs; 0: eagerly)")
    p.add_argument("--parse", action="store_true",
                   help="GPU: a PARSE pool with random routers; each request its own subset (8 rows' union ~1.05 K)")
    p.add_argument("--prefill-lengths", type=int, nargs="*", default=[16, 128, 512, 2000],
                   help="one-row prefill timings, eager against the replayed graph (lengths under the context)")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if a.model_dir is None and not cuda:
        p.error("the 7B shape needs a CUDA GPU; give --model-dir for a CPU run")
    eng = Engine.load(a.model_dir, device="cuda" if cuda else "cpu") if a.model_dir else random_7b(parse=a.parse)
    model = a.model_dir or ("random weights, LLaMA-7B shape, svd-llm ranks at keep 0.6, bf16, vocabulary 12,288" +
                            ("; a PARSE pool of 2 K components a matrix, random routers, each request its own "
                             "subset (any 8 share all but ~5 % of K: union ~1.05 K)" if a.parse else ""))
    if a.parse_graph_tokens is not None:
        eng.parse_graph_tokens = a.parse_graph_tokens
    eng.prefix = None  # the passes repeat the same queue: measure batching, not prefix-cache hits
    queue = make_queue(eng, a.requests, a.longest, a.prompt_tokens)
    res: dict[str, Any] = dict(device=torch.cuda.get_device_name() if cuda else "CPU", torch=torch.__version__,
                               model=model, args=vars(a), tokens=sum(sp.max_new_tokens for _, sp, _ in queue),
                               prompt_tokens=round(statistics.mean(len(eng.encode_prompt(q)) for q, _, _ in queue)),
                               command=" ".join(["python -m rankserve.bench.continuous", *argv]))
    ids: dict[str, list[list[int]]] = {}
    modes = [("static", serve_static)] + [("continuous" if j == 1 else f"continuous, joining {j}+ at once",
                                           functools.partial(serve_continuous, join_min=j)) for j in a.join_min]
    res["modes"] = [m for m, _ in modes]
    for mode, serve in modes:
        ids[mode] = [[] for _ in queue]
        serve(eng, queue, lambda k, ev: ids[mode][k].append(ev.token_id))  # warm-up (every bucket's decoder), tokens
        passes = sorted((timed_pass(eng, queue, serve) for _ in range(a.repeats)), key=lambda r: r["wall_s"])
        res[mode] = dict(passes[len(passes) // 2], phases=phases(eng, queue, serve))
        res[mode]["tokens_per_s"] = res["tokens"] / res[mode]["wall_s"]
        print(mode, json.dumps(res[mode]), flush=True)
    best = min(res["modes"][1:], key=lambda m: res[m]["wall_s"])
    res["speedup"] = res["static"]["wall_s"] / res[best]["wall_s"]
    res["best"] = best
    res["rows_equal"] = sum(x == y for x, y in zip(ids["static"], ids[best]))
    res["prefill"] = prefill_latency(eng, a.prefill_lengths)
    res["first_step"] = first_step(eng, tokens=a.first_step_tokens) if a.first_step_tokens else None
    write_results(Path(a.out), res, markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
