"""What batching in the worker buys: one `Worker` replica in-process (no Ray cluster, no HTTP), closed-loop clients,
the same requests at several `max_batch_size` values (1 = one generation at a time, the worker before batching).

Each of `--clients` clients sends `--requests` completions one after another (`--max-tokens` tokens each, or with
`--mixed-lengths` a length drawn per request from [max_tokens / 8, max_tokens]; sampled at temperature 0.8 with a
seed per request, `ignore_eos` so every request does the work it asks for). Per batch size: throughput (generated
tokens / wall time), request latency p50 / p90, time to first token p50, and how many rows the decode steps held.
`--join on off` runs each with and without continuous batching (the worker's `join_running`).
Writes `bench/results/worker-batching-<tag>.{json,md}`.

    python -m rankserve.bench.worker_batching --tag cpu
    python -m rankserve.bench.worker_batching --tag cpu-continuous --mixed-lengths --join on off --batch-sizes 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROMPTS = ["Once upon a time", "The little dog ran to the park", "Lily and Ben went to the beach", "One day, a bird",
           "Tom had a big red ball", "The sun was hot and the sky was blue", "Mia found a shiny stone", "A cat sat"]


async def _client(worker, c: int, n: int, max_tokens: int, out: list[dict[str, float]], jitter_ms: float,
                  mixed: bool = False) -> None:
    rng = np.random.default_rng(c)
    lengths = np.random.default_rng(1000 + c).integers(max(1, max_tokens // 8), max_tokens + 1, size=n)
    for i in range(n):
        if jitter_ms:  # clients come back one by one, as over a network
            await asyncio.sleep(rng.uniform(0, jitter_ms) / 1e3)
        sampling = dict(max_new_tokens=int(lengths[i]) if mixed else max_tokens, temperature=0.8, top_p=1.0, top_k=0, seed=1000 * c + i, stop=(),
                        ignore_eos=True)
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        async for ev in worker.stream(PROMPTS[(c + i) % len(PROMPTS)], sampling, cached=False, subset=None):
            if ev["event"] == "token" and ttft is None:
                ttft = time.perf_counter() - t0
            elif ev["event"] == "end":
                tokens = ev["completion_tokens"]
            elif ev["event"] == "error":
                raise RuntimeError(ev["message"])
        out.append(dict(latency_s=time.perf_counter() - t0, ttft_s=ttft or 0.0, tokens=tokens))


class _Rows:
    """Stands in for the worker's rows-per-step histogram: keeps every value."""

    def __init__(self) -> None:
        self.values: list[int] = []

    def observe(self, value: int, tags=None) -> None:
        self.values.append(value)


def run_one(model_dir: str, batch_size: int, clients: int, requests: int, max_tokens: int,
            threads: int, jitter_ms: float = 0.0, batch_wait_ms: float = 0.0, join: bool = True,
            mixed: bool = False) -> dict[str, Any]:
    from rankserve.deployments.worker import Worker

    worker = Worker.func_or_class("bench", {"model_dir": model_dir, "torch_threads": threads,
                                            "max_batch_size": batch_size, "max_tokens": max_tokens,
                                            "request_timeout_s": 3600.0, "batch_wait_ms": batch_wait_ms,
                                            "join_running": join})
    rows = worker.m_batch_rows = _Rows()
    sizes = rows.values

    async def go() -> tuple[list[dict[str, float]], float]:
        await worker.generate(PROMPTS[0], dict(max_new_tokens=4), cached=False, subset=None)  # warm-up
        sizes.clear()
        out: list[dict[str, float]] = []
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(worker, c, requests, max_tokens, out, jitter_ms, mixed)
                               for c in range(clients)))
        return out, time.perf_counter() - t0

    out, wall = asyncio.run(go())
    lat = np.array([r["latency_s"] for r in out])
    tokens = sum(r["tokens"] for r in out)
    return dict(max_batch_size=batch_size, requests=len(out), tokens=tokens, wall_s=round(wall, 3),
                tokens_per_s=round(tokens / wall, 1), latency_p50_s=round(float(np.percentile(lat, 50)), 4),
                latency_p90_s=round(float(np.percentile(lat, 90)), 4),
                ttft_p50_s=round(float(np.median([r["ttft_s"] for r in out])), 4),
                mean_step_rows=round(float(np.mean(sizes)), 2) if sizes else 0.0)


def markdown(res: dict[str, Any]) -> str:
    a = res["args"]
    lines = [f"# Batching in the worker: {res['tag']}", "",
             f"One `Worker` replica in-process, model `{a['model_dir']}`, {a['threads']} torch thread(s), "
             f"{a['clients']} closed-loop clients x {a['requests']} requests x "
             f"{'a length drawn from [%d, %d]' % (max(1, a['max_tokens'] // 8), a['max_tokens']) if a.get('mixed_lengths') else a['max_tokens']} tokens "
             f"(temperature 0.8, ignore_eos; each client waits uniform(0, {a.get('jitter_ms', 0.0):g}) ms before a "
             f"request). Machine: {res['machine']}. Command: `{res['command']}`.", "",
             "| joins a running batch | batch_wait_ms | max_batch_size | tokens/s | vs 1 | latency p50 / p90 (s) | "
             "TTFT p50 (s) | rows per step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = res["rows"][0]["tokens_per_s"]
    for r in res["rows"]:
        lines.append(f"| {'yes' if r.get('join', True) else 'no'} | {r.get('batch_wait_ms', 0.0):g} | "
                     f"{r['max_batch_size']} | {r['tokens_per_s']} | "
                     f"{r['tokens_per_s'] / base:.2f}x | {r['latency_p50_s']} / {r['latency_p90_s']} | "
                     f"{r['ttft_p50_s']} | {r['mean_step_rows']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="models/stories260K")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jitter-ms", type=float, default=0.0, help="each client waits uniform(0, J) ms before a request")
    p.add_argument("--batch-wait-ms", type=float, nargs="+", default=[0.0],
                   help="the worker's batch_wait_ms; several values: each batch size runs with each")
    p.add_argument("--mixed-lengths", action="store_true",
                   help="each request's max_tokens drawn from [max_tokens / 8, max_tokens] (seeded per client)")
    p.add_argument("--join", choices=["on", "off"], nargs="+", default=["on"],
                   help="continuous batching (the worker's join_running); several: each batch size runs with each")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", default=str(RESULTS))
    a = p.parse_args(argv)
    if a.batch_sizes[0] != 1:
        p.error("the first batch size is the baseline; start the list with 1")
    rows = []
    for join in a.join:
        for w in a.batch_wait_ms:
            for b in a.batch_sizes:
                rows.append({**run_one(a.model_dir, b, a.clients, a.requests, a.max_tokens, a.threads, a.jitter_ms, w,
                                       join == "on", a.mixed_lengths), "batch_wait_ms": w, "join": join == "on"})
                print(json.dumps(rows[-1]), flush=True)
    res = dict(tag=a.tag, args=vars(a), rows=rows, machine=f"{platform.processor() or platform.machine()}, "
               f"{os.cpu_count()} CPUs", command=" ".join(["python -m rankserve.bench.worker_batching", *argv]))
    out = Path(a.out_dir)
    for name, text in ((f"worker-batching-{a.tag}.json", json.dumps(res, indent=1)),
                       (f"worker-batching-{a.tag}.md", markdown(res))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
