"""What the prefix cache saves a chat-like load: requests that share a long system prompt, each with its own question.

`--requests` prompts = one system prompt of about `--system-tokens` tokens + a different question of about
`--question-tokens` tokens, sent one at a time (B = 1: time to first token is the prefill) and as one batch of
`--batch` joining rows. With the prefix cache off every request prefills its whole prompt; on, the first one fills
the cache and the others prefill only past the shared blocks. Per mode: time to first token (median over the
requests after the first, which fills the cache), the wall time of the batch, the prompt tokens taken from the
cache, and whether each request's greedy tokens equal the cache-off run's.

    python -m rankserve.bench.prefix_cache --out bench/results/prefix-cache-h200.json     # GPU, 7B shape
    python -m rankserve.bench.prefix_cache --model-dir models/stories260K --system-tokens 200 \\
        --question-tokens 16 --requests 4 --out /tmp/prefix.json                         # CPU smoke test
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
from rankserve.workers.prefix_cache import PrefixCache
from rankserve.workers.sampler import SamplingParams


def chat_prompts(eng: Engine, n: int, system_tokens: int, question_tokens: int) -> tuple[str, list[str]]:
    """-> one system prompt cut from the text, and n prompts: it + a different question cut from further on."""
    ids = eng.tokenizer.encode(TEXT.read_text(encoding="utf-8"), bos=False)
    system = eng.tokenizer.decode(ids[:system_tokens])
    at = system_tokens + 1000
    return system, [system + "\n" + eng.tokenizer.decode(ids[at + i * 97: at + i * 97 + question_tokens])
                    for i in range(n)]


def one_by_one(eng: Engine, prompts: list[str], gen: int) -> tuple[list[float], list[list[int]]]:
    """-> each request's time to first token (s) and its tokens, run alone one after another."""
    ttft, tokens = [], []
    for p in prompts:
        sync()
        t0 = time.perf_counter()
        stream = eng.stream(p, SamplingParams(max_new_tokens=gen, ignore_eos=True))
        out = [next(stream).token_id]
        ttft.append(time.perf_counter() - t0)
        out += [ev.token_id for ev in stream]
        tokens.append(out)
    return ttft, tokens


def batched(eng: Engine, prompts: list[str], gen: int) -> float:
    """Wall seconds for all prompts through one running batch (the first alone, the rest joining at the next step)."""
    sp = SamplingParams(max_new_tokens=gen, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    stream = eng.stream_batch(prompts[:1], [sp])
    next(stream)
    for p in prompts[1:]:
        stream.add(p, sp)
    for _ in stream:
        pass
    sync()
    return time.perf_counter() - t0


def markdown(res: dict[str, Any]) -> str:
    a = res["args"]
    lines = [f"# Prefix cache: {res['device']}", "",
             f"Model: {res['model']}. {a['requests']} requests, each one system prompt of {res['system_tokens']} tokens "
             f"+ its own question (prompts of {res['prompt_tokens']} tokens on average), generating {a['gen']} "
             f"tokens (greedy, ignore_eos). torch {res['torch']}. Command: `{res['command']}`.", "",
             "| prefix cache | TTFT one at a time, median of requests 2.. (ms) | first request's TTFT (ms) | "
             f"{a['batch']} requests through one batch, wall s | prompt tokens from the cache | tokens equal to off |",
             "| --- | --- | --- | --- | --- | --- |"]
    for mode in ("off", "on"):
        r = res[mode]
        lines.append(f"| {mode} | {r['ttft_ms_median']} | {r['ttft_ms_first']} | {r['batch_wall_s']} | "
                     f"{r['hit_tokens']} | {r['equal']} of {a['requests']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (the markdown goes next to it)")
    p.add_argument("--model-dir", default=None, help="a checkpoint to serve; default: random 7B shape (GPU)")
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="requests through one running batch (<= max_batch_size)")
    p.add_argument("--gen", type=int, default=16)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if a.model_dir is None and not cuda:
        p.error("the 7B shape needs a CUDA GPU; give --model-dir for a CPU run")
    eng = Engine.load(a.model_dir, device="cuda" if cuda else "cpu") if a.model_dir else random_7b()
    if eng.prefix is None:
        p.error("this engine has no prefix cache (a PARSE model)")
    system, prompts = chat_prompts(eng, a.requests, a.system_tokens, a.question_tokens)
    n = [len(eng.encode_prompt(q, room=a.gen)) for q in prompts]  # refused here if past the context
    res: dict[str, Any] = dict(device=torch.cuda.get_device_name() if cuda else "CPU", torch=torch.__version__,
                               model=a.model_dir or "random weights, LLaMA-7B shape, svd-llm ranks at keep 0.6, bf16, "
                               "vocabulary 12,288, context 2,048", args=vars(a), prompt_tokens=round(statistics.mean(n)),
                               system_tokens=len(eng.tokenizer.encode(system, bos=True)),
                               command=" ".join(["python -m rankserve.bench.prefix_cache", *argv]))
    budget = eng.prefix.max_bytes
    for mode in ("off", "on"):
        eng.prefix = PrefixCache(budget) if mode == "on" else None
        one_by_one(eng, prompts[:1] + prompts[-1:], a.gen)  # warm-up: decoders, prefill and chunk graphs
        batched(eng, prompts[:a.batch], a.gen)
        if eng.prefix is not None:
            eng.prefix = PrefixCache(budget)  # empty again: the first request fills it
        ttft, tokens = one_by_one(eng, prompts, a.gen)
        hit = eng.prefix.hit_tokens if eng.prefix is not None else 0
        walls = sorted(batched(eng, prompts[:a.batch], a.gen) for _ in range(3))
        res[mode] = dict(ttft_ms=[round(1e3 * t, 2) for t in ttft], ttft_ms_first=round(1e3 * ttft[0], 2),
                         ttft_ms_median=round(1e3 * statistics.median(ttft[1:]), 2), batch_wall_s=round(walls[1], 4),
                         hit_tokens=hit, tokens=tokens)
        res[mode]["equal"] = sum(x == y for x, y in zip(tokens, res["off"]["tokens"]))
        print(mode, json.dumps({k: v for k, v in res[mode].items() if k != "tokens"}), flush=True)
    write_results(Path(a.out), res, markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
