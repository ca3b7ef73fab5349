"""The per-kernel step's split-K plan at B > 1 (kernels/lowrank_linear.py `split_k`): programs per block of rows
rounded up (`ceil`, the plan since session 4: can deal a few more programs than the GPU has SMs) against rounded down
(`floor`: at most one program per SM, the rule session 29 found right for the one-launch step's V stages,
kernels/step_rows.py `_rows_v_split`).

One model per case; both plans' per-kernel steps (one CUDA graph a step, ~290 kernels) built on it and timed in
alternation, `--rounds` rounds of `--repeats` repeats each, so drift between builds and over time falls on both alike.
Per plan: the median ms/token over all repeats, min/max, each V stage's split and program count, and a greedy check of
the plan against the eager runtime (64 teacher-forced steps, bench/decode.py `greedy_match`).

    python -m rankserve.bench.split_probe --out bench/results/split-probe-h200.json        # GPU
    python -m rankserve.bench.split_probe --device cpu --preset tiny --cases svd-llm:0.6:16:4 --out /tmp/sp.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import triton

from rankserve.bench.decode import (DTYPES, build_model, empty_cache, greedy_match, make_decoder, plan_ranks,
                                    time_fast, write_json)
from rankserve.kernels import lowrank_linear
from rankserve.workers.align import GPU_ALIGN
from rankserve.workers.config import preset

CASES = ["svd-llm:0.6:128:8", "dobi:0.6:128:8", "basis-sharing:0.6:128:8", "svd-llm:0.8:128:8", "svd-llm:0.6:128:4"]
CURRENT = lowrank_linear.split_k


def floor_split_k(B: int, N: int, K: int, on_gpu: bool, sms: int, waves: int, live: int = 0) -> int:
    """`split_k` with the programs per row block rounded down: row blocks x split <= waves x sms where it can be."""
    if B == 1 or waves <= 0 or K % 16:
        return 1
    BLOCK_N, BLOCK_K, _, _ = lowrank_linear.gemv_config(B, N, on_gpu, K)
    blocks = triton.cdiv(live or N, BLOCK_N)
    return max(1, min(waves * sms // blocks, K // (2 * BLOCK_K)))


def ceil_split_k(B: int, N: int, K: int, on_gpu: bool, sms: int, waves: int, live: int = 0) -> int:
    """`split_k` with the programs per row block rounded up (the plan this probe started from)."""
    if B == 1 or waves <= 0 or K % 16:
        return 1
    BLOCK_N, BLOCK_K, _, _ = lowrank_linear.gemv_config(B, N, on_gpu, K)
    blocks = triton.cdiv(live or N, BLOCK_N)
    return max(1, min(triton.cdiv(waves * sms, blocks), K // (2 * BLOCK_K)))


PLANS = {"ceil": ceil_split_k, "floor": floor_split_k}


@contextmanager
def plan(fn):
    """Decoders built inside the block plan their V stages' splits with `fn` (FastDecoder reads the module's
    split_k when it builds its step)."""
    lowrank_linear.split_k = fn
    try:
        yield
    finally:
        lowrank_linear.split_k = CURRENT


def splits_of(dec) -> list[dict[str, Any]]:
    """Layer 0's V-stage splits: stage and programs per block of rows (stages left whole are not listed)."""
    return [dict(stage=group, split=n) for group, (n, _) in sorted(dec.splits[0].items())]


def run_case(spec: str, args) -> dict[str, Any]:
    family, keep, P, B = spec.split(":")
    keep, P, B = float(keep), int(P), int(B)
    cfg = preset(args.preset)
    dev, dt = args.device, DTYPES[args.device]
    ranks, groups = plan_ranks(cfg, family, keep)
    model = build_model(cfg, ranks, groups, dev, dt, align=GPU_ALIGN if dev == "cuda" else 1)
    S = P + args.tokens + 16
    decs = {}
    for name, fn in PLANS.items():
        with plan(fn):
            decs[name] = make_decoder(model, B, S, "triton", "step", pdl="off", one_launch=False)
    times: dict[str, list[float]] = {n: [] for n in PLANS}
    for _ in range(args.rounds):
        for name, dec in decs.items():
            times[name] += time_fast(dec, P, args.tokens, args.repeats)
    case: dict[str, Any] = dict(case=spec, plans={})
    for name, dec in decs.items():
        ts = times[name]
        case["plans"][name] = dict(ms_per_token=round(statistics.median(ts), 4), ms_min=round(min(ts), 4),
                                   ms_max=round(max(ts), 4), repeats=len(ts), splits=splits_of(dec))
    del decs
    with plan(PLANS["floor"]):
        case["greedy_check_floor"] = greedy_match(model, make_decoder(model, B, P + 65, "triton", "step", pdl="off",
                                                                      one_launch=False), P, 64)
    c, f = case["plans"]["ceil"]["ms_per_token"], case["plans"]["floor"]["ms_per_token"]
    case["floor_vs_ceil"] = round(f / c - 1, 4)
    print(f"{spec}: ceil {c:.3f}  floor {f:.3f} ms/token ({case['floor_vs_ceil']:+.1%}); "
          f"splits ceil {case['plans']['ceil']['splits']} floor {case['plans']['floor']['splits']}", flush=True)
    del model
    gc.collect()
    empty_cache()
    return case


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# Split-K plan of the per-kernel step at B > 1: {res['device']}", "",
             f"torch {res['torch']}, triton {res['triton']}; random weights, {res['dtype']}; {res['rounds']} rounds x "
             f"{res['repeats']} repeats of {res['tokens']} steps per plan, alternating. Command: `{res['command']}`.", "",
             "| case | ceil (ms/token, min-max) | floor (ms/token, min-max) | floor vs ceil | V-stage splits, layer 0 "
             "(ceil / floor) | greedy check, floor |", "| --- | --- | --- | --- | --- | --- |"]
    for c in res["cases"]:
        p = c["plans"]
        sp = lambda k: ", ".join(f"{s['stage']} {s['split']}" for s in p[k]["splits"]) or "none"  # noqa: E731
        g = c["greedy_check_floor"]
        lines.append(f"| {c['case']} | {p['ceil']['ms_per_token']:.3f} ({p['ceil']['ms_min']:.3f}-"
                     f"{p['ceil']['ms_max']:.3f}) | {p['floor']['ms_per_token']:.3f} ({p['floor']['ms_min']:.3f}-"
                     f"{p['floor']['ms_max']:.3f}) | {c['floor_vs_ceil']:+.1%} | {sp('ceil')} / {sp('floor')} | "
                     f"{g['token_match']:.1%}{', near-ties' if g['near_ties'] else ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write (the markdown goes next to it)")
    ap.add_argument("--cases", nargs="+", default=CASES, help="family:keep:prompt:batch, batch > 1")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--preset", default="llama-7b")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("the split probe times CUDA graphs: run it on a GPU (--device cpu is a smoke test)", file=sys.stderr)
        return 2
    if any(int(c.split(":")[3]) < 2 for c in a.cases):
        print("split-K applies at batch > 1 only: every case needs batch >= 2", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res: dict[str, Any] = dict(device=torch.cuda.get_device_name() if a.device == "cuda" else "CPU (smoke test)",
                               torch=torch.__version__, triton=triton.__version__, dtype=str(DTYPES[a.device]),
                               tokens=a.tokens, repeats=a.repeats, rounds=a.rounds, cases=[],
                               command="python -m rankserve.bench.split_probe " + " ".join(argv or sys.argv[1:]))
    out = Path(a.out)
    for spec in a.cases:
        res["cases"].append(run_case(spec, a))
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        write_json(out, res)
        md = out.with_suffix(".md")
        tmp = md.with_name(f".{md.name}.tmp")
        tmp.write_text(markdown(res))
        tmp.replace(md)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
