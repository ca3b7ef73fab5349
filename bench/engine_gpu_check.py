"""GPU smoke check of the engine on the small models (the bundled stories260K, the reference model, and svd-llm
compressions of both): the fast decode path (per-kernel or one-launch) at B = 1 and 3 against the CPU fp32 engine,
logprobs against a teacher-forced forward, the cost of asking for logprobs, the worker's batches
(`Engine.stream_batch`: rows against each alone, 8 requests batched against one by one) and echo scoring
(`Engine.prompt_logprobs` against the logprobs generation reported).

CI runs the kernels under TRITON_INTERPRET=1, where tl.dot takes any shape and there is no L2 prefetch: this check
is what found head_dim 8 failing to compile on the H200 (kernels/decode_attention.py, workers/fast_decode.py).

Run (GPU):  python -m rankserve.bench.engine_gpu_check --out bench/results/engine-gpu-check.json
Per model and batch: the first greedy token that differs from the CPU fp32 run (None: all 32 equal) with the CPU
top-2 margin there (a near-tie in bf16), the largest |logprob - teacher-forced log-softmax| (bf16 paths), the
logprob gap of greedy tokens that are not the top-1 entry (0: an exact tie between two ids), and ms/token of 64
tokens (prefill included, median of 5) without and with logprobs=5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rankserve.workers.engine import Engine
from rankserve.workers.sampler import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
STORY_PROMPTS = ["Once upon a time", "Lily", "The dog"]
WIKI_PROMPTS = ["The history of the city", "It was", "A"]


def compress(src: Path, out: Path, keep: float, calib_tokens: int) -> Path:
    subprocess.run([sys.executable, "-P", "-m", "rankserve.cli", "compress", "--method", "svd-llm", "--keep", str(keep),
                    "--calib", str(ROOT / "tests" / "data" / "tinyshakespeare-head.txt"), "--calib-tokens",
                    str(calib_tokens), str(src), str(out)], check=True)
    return out


def check(model_dir: Path, prompts: list[str], n: int = 32) -> dict:
    gpu, cpu = Engine.load(model_dir, device="cuda"), Engine.load(model_dir)
    res: dict = {}
    for B in (1, 3):
        sps = [SamplingParams(max_new_tokens=n, logprobs=3, ignore_eos=True) for _ in range(B)]
        rs, ref = gpu.generate_batch(prompts[:B], sps), cpu.generate_batch(prompts[:B], sps)
        r = rs[0]
        ids = gpu.encode_prompt(prompts[0], sps[0]) + r.token_ids
        with torch.no_grad():  # teacher-forced: the steps that chose each generated token
            lp = torch.log_softmax(gpu.model(torch.tensor([ids], device="cuda"))[0].double(), -1)[len(ids) - n - 1:-1]
        got = torch.tensor([l.logprob for l in r.logprobs], dtype=torch.float64, device="cuda")
        want = lp[torch.arange(n, device="cuda"), torch.tensor(r.token_ids, device="cuda")]
        first = [next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), None)
                 for x, y in zip(rs, ref)]
        res[f"B{B}"] = dict(
            first_mismatch_vs_cpu_fp32=first,
            cpu_top2_margin_at_first_mismatch=[None if i is None else round(y.logprobs[i].top[0][1] -
                                                                           y.logprobs[i].top[1][1], 5)
                                               for i, y in zip(first, ref)],
            max_abs_logprob_diff_vs_forward=float((got - want).abs().max()),
            greedy_not_top1_logprob_gaps=[round(l.top[0][1] - l.logprob, 6) for x in rs for l in x.logprobs
                                          if l.token != l.top[0][0]],
            text=r.text[:60])
    times = {}
    for k in (None, 5):
        ts = []
        for _ in range(5):
            p = SamplingParams(max_new_tokens=64, logprobs=k, ignore_eos=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gpu.generate(prompts[0], p)
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) / 64 * 1e3)
        times[f"logprobs={k}"] = round(statistics.median(ts), 4)
    res["ms_per_token_64_tokens_incl_prefill_median5"] = times
    res["one_launch"] = any(d.step_kernel is not None for d in gpu._decoders.values())
    res["stream_batch"] = check_stream_batch(gpu, prompts)
    res["prompt_logprobs"] = check_prompt_logprobs(gpu, prompts[0])
    return res


def check_stream_batch(gpu: Engine, prompts: list[str]) -> dict:
    """The worker's batches on the GPU: rows of different lengths, one stopped from outside at step 5, against each
    prompt alone (greedy; a bf16 batch may part from B = 1 at a near-tie); then 8 requests of 64 tokens one after
    another against one batch of 8 (what batching buys a replica)."""
    lens = [32, 20, 12][:len(prompts)]
    sps = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens]
    alone = [gpu.generate(p, sp).token_ids for p, sp in zip(prompts, sps)]
    got: list[list[int]] = [[] for _ in prompts]
    batch = gpu.stream_batch(prompts, sps)
    for i, step in enumerate(batch):
        for row, ev in zip(got, step):
            if ev is not None:
                row.append(ev.token_id)
        if i == 4 and len(prompts) > 1:
            batch.stop(1, "cancelled")
    batch.close()
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(got, alone)]
    eight = [prompts[i % len(prompts)] for i in range(8)]
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)

    def timed(fn) -> float:
        ts = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    one_by_one = timed(lambda: [gpu.generate(p, sp) for p in eight])
    batched = timed(lambda: [None for _ in gpu.stream_batch(eight, [sp] * 8)])
    return dict(rows_tokens=[len(g) for g in got], first_mismatch_vs_alone=first,
                eight_requests_of_64_tokens_s=dict(one_by_one=round(one_by_one, 4), one_batch=round(batched, 4),
                                                   speedup=round(one_by_one / batched, 2)))


def check_prompt_logprobs(gpu: Engine, prompt: str) -> dict:
    """echo scoring on the GPU: prompt + a generated completion, scored in one forward, against the logprobs the
    generation reported (bf16: the eager forward and the fast decode path round differently)."""
    gen = gpu.generate(prompt, SamplingParams(max_new_tokens=32, logprobs=3, ignore_eos=True))
    ids = gpu.tokenizer.encode(prompt)
    if gpu.tokenizer.encode(prompt + gen.text) != ids + gen.token_ids:
        return dict(round_trip=False)
    tail = gpu.prompt_logprobs(prompt + gen.text, 3)[len(ids) - 1:]
    return dict(round_trip=True, tokens_equal=[e.token for e in tail] == [e.token for e in gen.logprobs],
                max_abs_logprob_diff=round(max(abs(a.logprob - b.logprob) for a, b in zip(tail, gen.logprobs)), 5),
                top1_alternative_equal=sum(a.top[0][0] == b.top[0][0] for a, b in zip(tail, gen.logprobs)) / len(tail))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: this check needs a CUDA GPU")
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"stories260K-svd-llm-0.8": (compress(ROOT / "models" / "stories260K", Path(tmp) / "s", 0.8, 32768),
                                              STORY_PROMPTS),
                  "reference-svd-llm-0.6": (compress(ROOT / "models" / "reference", Path(tmp) / "r", 0.6, 8192),
                                            WIKI_PROMPTS),
                  "reference": (ROOT / "models" / "reference", WIKI_PROMPTS),
                  "stories260K": (ROOT / "models" / "stories260K", STORY_PROMPTS)}
        for name, (d, prompts) in models.items():
            out[name] = check(d, prompts)
            print(name, json.dumps(out[name]), flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
