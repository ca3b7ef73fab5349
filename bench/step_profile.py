"""Per-kernel GPU time of one decode step: static truncation vs PARSE rank slots (torch profiler), one run.

LLaMA-7B shape, random bf16 weights, svd-llm ranks at keep 0.6 as K, a pool of 2 K, ranks padded as the engine
pads them on the GPU; the slots hold `--union` x K components per matrix (overlapping subsets, as
`bench/parse_speed.py` draws them). Both eager (graph="none") and graph replay (graph="step").

Usage: python -m rankserve.bench.step_profile --out step-profile-h200.json [--batch 8] [--union 1.05]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

from rankserve.bench.decode import build_model, plan_ranks, write_json
from rankserve.bench.parse_speed import overlapping_subsets
from rankserve.workers.align import GPU_ALIGN
from rankserve.workers.config import preset
from rankserve.workers.fast_decode import DecodeConfig, FastDecoder
from rankserve.workers.parse import Routers
from rankserve.workers.parse_decode import ParseSlots


def kernel_times(dec: FastDecoder, steps: int = 10, prompt: int = 128) -> dict[str, float]:
    """Mean GPU ms per decode step, by kernel name (first 60 characters)."""
    cfg, B = dec.cfg, dec.dcfg.batch_size
    dev = dec.tokens.device
    with torch.inference_mode():
        dec.prefill(torch.randint(0, cfg.vocab_size, (B, prompt), device=dev))
        for _ in range(3):
            dec.step(dec.logits.argmax(-1))
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                dec.step(dec.logits.argmax(-1))
            torch.cuda.synchronize()
    agg: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name[:60]] += e.device_time / steps / 1e3
    return dict(agg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rankserve.bench.step_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/step-profile.json")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--union", type=float, default=1.05)
    ap.add_argument("--preset", default="llama-7b")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench step_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg, dev, dt, B = preset(args.preset), "cuda", torch.bfloat16, args.batch
    K, _ = plan_ranks(cfg, "svd-llm", 0.6)
    shapes = cfg.linear_shapes()
    r_max = {n: min(2 * k, min(shapes[n.rsplit(".", 1)[1]])) for n, k in K.items()}
    static = build_model(cfg, K, {}, dev, dt, align=GPU_ALIGN)
    pool = build_model(cfg, r_max, {}, dev, dt, seed=1, align=GPU_ALIGN)
    routers = Routers(R={}, b={}, k=dict(K), r_max=r_max, head={}, perm={})
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, batch=B, union=args.union, runs={})
    for graph in ("none", "step"):
        dcfg = DecodeConfig(batch_size=B, max_seq_len=256, graph=graph)
        res["runs"][f"static-{graph}"] = kernel_times(FastDecoder(static, dcfg))
        slots = ParseSlots(pool, routers, dcfg, align=GPU_ALIGN)
        slots.load(overlapping_subsets(routers, B, args.union, seed=15))
        res["runs"][f"slots-{graph}"] = kernel_times(slots.decoder)
        del slots
        torch.cuda.empty_cache()
    for name, ks in res["runs"].items():
        top = sorted(ks.items(), key=lambda kv: -kv[1])[:4]
        print(f"{name}: {sum(ks.values()):.3f} ms of kernels per step; " +
              ", ".join(f"{k.split('(')[0]} {v:.3f}" for k, v in top), flush=True)
    write_json(Path(args.out), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
