"""Where prefill time goes on a GPU: bf16 GEMM throughput at prefill shapes, SM clock under load, and the top
kernels of one eager prefill (torch profiler). Usage: python -m rankserve.bench.prefill_probe --out probe.json"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.prefill_probe")
    ap.add_argument("--out", default="prefill-probe.json")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from rankserve.bench.decode import build_model, plan_ranks
    from rankserve.workers.config import preset
    from rankserve.workers.kv_cache import KVCache

    res: dict = {"gpu": torch.cuda.get_device_name(), "gemm": []}
    for M, N, K in ((2048, 4096, 4096), (2048, 1228, 4096), (2048, 4096, 1228), (8192, 8192, 8192)):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ms = do_bench(lambda: a @ b, return_mode="median")
        res["gemm"].append(dict(M=M, N=N, K=K, ms=ms, tflops=2 * M * N * K / ms / 1e9))
        clk = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        res["gemm"][-1]["smi_after"] = clk
        print(res["gemm"][-1], flush=True)
    cfg = preset("llama-7b")
    ranks, groups = plan_ranks(cfg, "svd-llm", 0.6)
    model = build_model(cfg, ranks, groups, "cuda", torch.bfloat16)
    S = args.tokens
    x = torch.randint(0, cfg.vocab_size, (1, S), device="cuda")

    def prefill():
        cache = KVCache(cfg.num_hidden_layers, 1, S, cfg.num_key_value_heads, cfg.head_dim, device="cuda",
                        dtype=torch.bfloat16)
        return model(x, cache, last_only=True)

    with torch.inference_mode():
        res["prefill_ms"] = do_bench(prefill, return_mode="median")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            prefill()
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    res["profile"] = table
    print(f"prefill {S}: {res['prefill_ms']:.1f} ms\n{table}", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
