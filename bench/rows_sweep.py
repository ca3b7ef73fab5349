"""Tiles of the B > 1 one-launch step (kernels/step_rows.py) timed on the GPU against the per-kernel step, one model.

Each config is RowsConfig's fields in order: programs per SM, V tile (rows, columns), U tile, pipeline depth, warps,
and optionally the V stages' least tiles a chunk, then the gate/up U and q/k/v U tiles.
ms/token is the median of repeats of greedy decoding (graph replay, bench/decode.py's time_fast) at the LLaMA-7B
shape with random svd-llm factors at keep 0.6; `resident` is how many programs of the compiled kernel fit an SM.

    python -m rankserve.bench.rows_sweep --batch 8 --out rows-sweep-h200.json \
        --configs 2,16,256,16,128,3,4 2,16,512,16,256,3,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from rankserve.bench.decode import build_model, copy_bandwidth, make_decoder, plan_ranks, time_fast, weight_bytes_read
from rankserve.workers.align import GPU_ALIGN
from rankserve.workers.config import preset


def parse_config(spec: str) -> tuple:
    """'pps,vn,vk,un,uk,stages,warps[,min_tiles[,gn,gk,qn,qk]]' -> RowsConfig's fields (gate/up U and q/k/v U tiles
    last; without them every U stage takes the U tile, as the sweeps of session 27 before RowsConfig had them)."""
    v = [int(x) for x in spec.split(",")]
    if len(v) not in (7, 8, 12):
        raise ValueError(f"config {spec!r}: 7, 8 or 12 integers wanted (pps,vn,vk,un,uk,stages,warps[,min_tiles"
                         "[,gn,gk,qn,qk]])")
    least = v[7] if len(v) > 7 else 2
    gu, qkv = ((v[8], v[9]), (v[10], v[11])) if len(v) == 12 else ((v[3], v[4]), (v[3], v[4]))  # 7-8: all U alike
    return v[0], (v[1], v[2]), (v[3], v[4]), v[5], v[6], least, gu, qkv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8])
    ap.add_argument("--configs", nargs="+", default=["2,16,256,16,128,3,4"])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=480, help="start no config after this many seconds")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    configs = [parse_config(c) for c in a.configs]
    t0 = time.perf_counter()
    cfg = preset("llama-7b")
    ranks, groups = plan_ranks(cfg, "svd-llm", 0.6)
    model = build_model(cfg, ranks, groups, "cuda", torch.bfloat16, align=GPU_ALIGN)
    bw = copy_bandwidth("cuda")
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw,
               weight_bytes=weight_bytes_read(model), argv=sys.argv[1:] if argv is None else argv, rows=[])
    S = a.prompt + a.tokens + 16
    for B in a.batch:
        base = time_fast(make_decoder(model, B, S, "triton", "step"), a.prompt, a.tokens, a.repeats)
        res["rows"].append(dict(batch=B, config="per-kernel", ms=statistics.median(base), all=base))
        print(f"B={B} per-kernel {statistics.median(base):.3f} ms", flush=True)
        for c, spec in zip(configs, a.configs):
            if time.perf_counter() - t0 > a.budget_s:
                print("budget spent: stopping", flush=True)
                break
            try:
                dec = make_decoder(model, B, S, "triton", "step", one_launch=True, one_launch_tiles=c)
                ms = time_fast(dec, a.prompt, a.tokens, a.repeats)
                k = dec.step_kernel
                res["rows"].append(dict(batch=B, config=spec, ms=statistics.median(ms), all=ms, grid=k.grid[0],
                                        resident=k.resident))
                print(f"B={B} {spec}: {statistics.median(ms):.3f} ms (grid {k.grid[0]}, resident {k.resident})",
                      flush=True)
                del dec
            except Exception as e:  # one config failing (shared memory, registers) must not stop the sweep
                res["rows"].append(dict(batch=B, config=spec, error=f"{type(e).__name__}: {e}"[:400]))
                print(f"B={B} {spec}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
