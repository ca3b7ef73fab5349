"""Where the step goes when a PARSE request joins a running batch (GPU, 7B shape).

Four short requests decode; every `--every` steps a long one joins. The step each joins in is timed (wall, synced),
and, after a warm-up join, profiled twice: with cProfile (host functions, cumulative) and with torch.profiler (the
ops' host and device time). The rank-slot load is also timed on its own: a changed batch (a row replaced) and the
same batch again. Writes OUT.json and OUT-*.txt (the profiles).

    python -m rankserve.bench.join_probe --out join-probe-h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from rankserve.bench.chunked_prefill import prompts
from rankserve.bench.continuous import random_7b, sync
from rankserve.bench.parse_speed import overlapping_subsets
from rankserve.workers.sampler import SamplingParams


def _timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return 1e3 * (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--joins", type=int, default=4)
    p.add_argument("--every", type=int, default=12)
    p.add_argument("--long-tokens", type=int, default=1800)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("join_probe needs a CUDA GPU: it profiles the 7B-shape PARSE engine's fast path")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    eng = random_7b(parse=True)
    eng.prefill_chunk = 0
    short, long = prompts(eng, a.rows, a.joins, a.long_tokens)
    subsets = overlapping_subsets(eng.routers, a.rows + a.joins, 1 + 0.05 * (a.rows + a.joins - 1) / 7, 0)
    gen = SamplingParams(max_new_tokens=a.every * (a.joins + 2), ignore_eos=True)
    stream = eng.stream_batch([], [])
    for k, s in enumerate(short):
        stream.add(s, gen, subsets[k], checked=True)
    res: dict = {"steps": [], "join_steps": []}
    step = 0
    for j in range(a.joins):
        for _ in range(a.every):
            res["steps"].append(_timed(lambda: next(stream)))
            step += 1
        stream.add(long[j], SamplingParams(max_new_tokens=4, ignore_eos=True), subsets[a.rows + j], checked=True)
        if j == 2:
            prof = cProfile.Profile()
            prof.enable()
            ms = _timed(lambda: next(stream))
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
            out.with_name(out.stem + "-cprofile.txt").write_text(buf.getvalue())
        elif j == 3:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                ms = _timed(lambda: next(stream))
            txt = tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
            txt += "\n\n" + tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            out.with_name(out.stem + "-torchprof.txt").write_text(txt)
        else:
            ms = _timed(lambda: next(stream))
        res["join_steps"].append(ms)
        print(f"join {j}: step {ms:.1f} ms", flush=True)
    stream.close()
    res["median_step_ms"] = statistics.median(res["steps"])
    # the slot load alone, at the batch size the joins ran at
    slots = eng._slots[max(eng._slots)]  # the largest batch bucket built: the one the joins ran in
    B = slots.B
    base = subsets[:B]
    swapped = subsets[1:B + 1]
    from rankserve.workers.parse_batching import membership
    res["slot_B"] = B
    res["membership_ms"] = statistics.median(_timed(lambda: membership(base, eng.routers)) for _ in range(3))
    with torch.inference_mode():  # the engine's tensors are inference tensors
        res["slot_load_changed_ms"] = [_timed(lambda: slots.load(swapped if i % 2 == 0 else base)) for i in range(4)]
        res["slot_load_same_ms"] = [_timed(lambda: slots.load(base)) for _ in range(3)]
        prof = cProfile.Profile()
        prof.enable()
        _timed(lambda: slots.load(swapped))
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    out.with_name(out.stem + "-load-cprofile.txt").write_text(buf.getvalue())
    res["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "steps"}, indent=1))


if __name__ == "__main__":
    main()
